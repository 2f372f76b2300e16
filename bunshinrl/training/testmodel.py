"""A real Hugging Face model directory that needs no download: bunshinrl.training.testmodel.make(dir).

It writes what a user's Qwen2 checkpoint holds (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json with a ChatML chat template that
renders tools and Hermes `<tool_call>` blocks), so AutoModelForCausalLM, AutoTokenizer and
vLLM load it exactly as they would load Qwen2.5: a Qwen2 architecture with random weights,
a few hundred thousand parameters (head_dim 64: vLLM's CPU attention needs at least 32), and
a byte-level BPE tokenizer trained here with `tokenizers` on the task suite's own text
(prompts, tool schemas, candidate calls, typical observations, the template's scaffolding).
The same seed writes bit-identical files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..calls.task import Task
from ..policies.chat import SYSTEM_PROMPT, render_action
from .tasks import suite

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Not special: they must survive detokenization, since tool-call parsers (vLLM's hermes, ours)
# read them from the text, as in Qwen2.5's tokenizer.
TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen2.5's ChatML layout, written compactly: tools listed in the system turn, calls as Hermes
# <tool_call> JSON, tool results as user turns in <tool_response>.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = '" + SYSTEM_PROMPT + "' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for tc in message['tool_calls'] or [] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Dimensions: Qwen2 with 2 layers, hidden 128, 2 heads of 64, one KV head.
DIMS: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048}
VOCAB_SIZE = 1024

_OBSERVATIONS = (
    "wrote 6 bytes to /root/out/a.txt", "[exit 1]", "[exit 0]", "[error] cannot read /root/out/a.txt",
    "tests ok: 3/6", "FAIL add(2, 3) = -1, expected 5", "FAIL mul(3, 4) = 13, expected 12", "service stopped",
    "service listening on 8081", "pong\n[status 200]", "unconfigured\n[status 200]",
    "[error] no service answering on 127.0.0.1:8081 (curl exit 7)", "README\na.txt\nb.txt",
    "invalid tool call: Expecting ',' delimiter", "[error] unknown tool 'run'; available: read_file, shell",
)


def _corpus(tasks: Sequence[Task]) -> list[str]:
    """Text the tokenizer learns its merges from: every task's rendered turns, with each candidate
    reply and typical observations, in the chat layout itself."""
    from jinja2 import Environment

    env = Environment()
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string(CHAT_TEMPLATE)
    texts = []
    for t in tasks:
        tools = t.agent_tools.schemas()
        texts.append(template.render(messages=[{"role": "user", "content": t.prompt}], tools=tools,
                                     add_generation_prompt=True))
        for a in t.actions:
            reply = render_action(a)
            texts.append(f"{IM_START}assistant\n{reply}{IM_END}\n")
            for obs in _OBSERVATIONS:
                texts.append(f"{IM_START}user\n<tool_response>\n{obs}\n</tool_response>{IM_END}\n")
    return texts


def train_tokenizer(tasks: Sequence[Task] | None = None, vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE tokenizer (Qwen2's kind) trained on the suite's text, as a
    transformers fast tokenizer with the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tasks = list(tasks) if tasks is not None else suite()
    # Qwen2's own normalizer and pre-tokenizer: AutoTokenizer gives a Qwen2 checkpoint a
    # Qwen2Tokenizer, which installs these whatever tokenizer.json says, so training with
    # anything else would tokenize differently from how the model is then served.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAGS) - 3, min_frequency=2,
                                  special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(tasks) * 4, trainer=trainer)
    tok.add_tokens(list(TAGS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                   additional_special_tokens=[IM_START, IM_END], clean_up_tokenization_spaces=False,
                                   model_max_length=DIMS["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make(path: str | os.PathLike[str], *, seed: int = 0, tasks: Sequence[Task] | None = None,
         **dims: Any) -> Path:
    """Write the test model to `path` (created) and return it. Loads with
    AutoModelForCausalLM.from_pretrained(path) / AutoTokenizer.from_pretrained(path), and serves
    with `python -m vllm.entrypoints.openai.api_server --model path`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(tasks)
    size = dims.pop("vocab_size", None) or -(-len(tokenizer) // 64) * 64
    # Untied embeddings: vLLM 0.32's in-place weight reload leaves a tied lm_head stale (sync.py).
    settings: dict[str, Any] = {**DIMS, "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                                "use_sliding_window": False, **dims}
    cfg = Qwen2Config(vocab_size=size, bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
                      eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                      pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT), **settings)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.bunshin_test_model = True  # HFPolicy constrains decoding by default for this model only
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tk = out / "tokenizer_config.json"
    tk.write_text(json.dumps({**json.loads(tk.read_text()), "tokenizer_class": "Qwen2Tokenizer"}, indent=2) + "\n")
    # Sampling defaults a server applies when a request leaves them out: plain sampling, so that
    # no top-k or top-p silently narrows what the policy draws from.
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=[cfg.eos_token_id], pad_token_id=cfg.pad_token_id,
                     do_sample=True, temperature=1.0, top_p=1.0, top_k=0).save_pretrained(out)
    return out
