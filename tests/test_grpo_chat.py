"""The test model loads as a Hugging Face checkpoint; its chat template renders tools and the
trajectory; replies parse as tool calls (Hermes and bare JSON), malformed ones as invalid
calls; constrained decoding allows what vLLM's grammar allows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bunshinrl import INVALID_TOOL, Step, ToolCall, parse_message, parse_reply, render_call
from bunshinrl.calls.policy import FinalAnswer
from bunshinrl.grpo import suite
from bunshinrl.policies.chat import candidate_replies, messages

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bunshinrl.grpo import testmodel  # noqa: E402
from bunshinrl.policies.constrain import ChoiceConstraint, Vocabulary  # noqa: E402

TASKS = {t.id: t for t in suite()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testmodel.make(tmp_path_factory.mktemp("tiny"))


def test_test_model_is_a_standard_qwen2_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.model_type == "qwen2" and cfg.architectures == ["Qwen2ForCausalLM"]
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM's CPU attention needs it
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 1_000_000, n
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer"  # what a Qwen checkpoint's tokenizer_config names
    assert tok.eos_token == "<|im_end|>" and "<tool_call>" in tok.get_vocab()
    # Suite text round-trips and tokenizes compactly (merges were learned from it).
    text = candidate_replies(TASKS["fix-both"])[2]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2
    # The same seed writes the same model; another seed other weights, the same tokenizer.
    again, other = testmodel.make(tmp_path / "a"), testmodel.make(tmp_path / "b", seed=1)
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_chat_template_renders_tools_and_the_trajectory(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from bunshinrl.policies.chat import template_messages

    tok = AutoTokenizer.from_pretrained(model_dir)
    task = TASKS["service-pong"]
    call = ToolCall("write_file", {"path": "/root/svc/config.json", "content": '{"body": "pong"}'})
    history = [Step(call, "wrote 16 bytes to /root/svc/config.json", 0),
               Step(ToolCall(INVALID_TOOL, {"error": "unterminated <tool_call>", "text": "<tool_call>{"}),
                    "invalid tool call: unterminated <tool_call>", 1)]
    msgs = template_messages(messages(task.prompt, history))
    text = tok.apply_chat_template(msgs, tools=task.agent_tools.schemas(), add_generation_prompt=True,
                                   tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    tools_block = text[text.index("<tools>"):text.index("</tools>")]
    listed = [json.loads(line)["function"]["name"] for line in tools_block.splitlines()[1:]]
    assert listed == ["shell", "read_file", "write_file", "http_get"]  # hidden tools are never offered
    assert f"<|im_start|>user\n{task.prompt}<|im_end|>" in text
    # The past call is rendered exactly as the model is to write one, its result as a tool response.
    assert f"<|im_start|>assistant\n{render_call(call)}<|im_end|>" in text
    assert "<tool_response>\nwrote 16 bytes to /root/svc/config.json\n</tool_response>" in text
    # A malformed call: the model's own text, then the complaint.
    assert "<|im_start|>assistant\n<tool_call>{<|im_end|>\n<|im_start|>user\ninvalid tool call:" in text


def test_tool_call_parsing() -> None:
    tools = TASKS["files-ab"].agent_tools
    call = ToolCall("write_file", {"path": "/root/out/a.txt", "content": "alpha\n"})
    assert parse_reply(render_call(call), tools) == call
    assert parse_reply("Let me write it.\n" + render_call(call) + "\nthen check.", tools) == call
    assert parse_reply('{"name": "shell", "arguments": {"cmd": "ls"}}', tools) == ToolCall("shell", {"cmd": "ls"})
    assert parse_reply('{"name": "shell", "parameters": {"cmd": "ls"}}', tools) == ToolCall("shell", {"cmd": "ls"})
    # Parallel calls: every block, in order (or the first one only, as with parallel_tool_calls=false).
    ls = ToolCall("shell", {"cmd": "ls"})
    two = render_call(call) + render_call(ls)
    assert parse_reply(two, tools) == (call, ls)
    assert parse_reply(two, tools, parallel=False) == call
    # One bad block voids the whole reply.
    bad = parse_reply(two + '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', tools)
    assert isinstance(bad, ToolCall) and bad.name == INVALID_TOOL and "rm_rf" in bad.args["error"]
    assert parse_reply("All files are written.", tools) == FinalAnswer("All files are written.")

    def why(text: str) -> str:
        a = parse_reply(text, tools)
        assert isinstance(a, ToolCall) and a.name == INVALID_TOOL, a
        assert a.args["text"] == text
        return a.args["error"]

    assert "delimiter" in why('<tool_call>\n{"name": "shell" "arguments": {}}\n</tool_call>')
    assert why('<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}') == "unterminated <tool_call>"
    assert "name" in why('<tool_call>{"arguments": {}}</tool_call>')
    assert "object" in why('<tool_call>{"name": "shell", "arguments": [1]}</tool_call>')
    assert "no tool named 'rm_rf'" in why('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')
    assert "no tool named '__reward__'" in why('<tool_call>{"name": "__reward__", "arguments": {}}</tool_call>')
    assert "missing argument(s) content" in why('<tool_call>{"name": "write_file", "arguments": '
                                                '{"path": "/x"}}</tool_call>')
    assert "JSON" in why('{"name": "shell", "arguments": "{broken"}')
    # A server's parsed tool_calls (arguments as a JSON string) go through the same checks.
    msg = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}]}
    assert parse_message(msg, tools) == ToolCall("shell", {"cmd": "ls"})
    msg["tool_calls"].append({"id": "c2", "type": "function", "function": {"name": "read_file",
                                                                          "arguments": '{"path": "/a"}'}})
    assert parse_message(msg, tools) == (ToolCall("shell", {"cmd": "ls"}), ToolCall("read_file", {"path": "/a"}))
    assert parse_message({"role": "assistant", "content": "done"}, tools) == FinalAnswer("done")


def test_the_invalid_call_tool_answers_in_the_engine_without_touching_anything() -> None:
    import asyncio

    tool = TASKS["files-ab"].engine_tools[INVALID_TOOL]
    obs = asyncio.run(tool.run(None, {"error": "unterminated <tool_call>", "text": "x"}))  # type: ignore[arg-type]
    assert obs == "invalid tool call: unterminated <tool_call>"


def test_choice_constraint_allows_exactly_the_continuations_of_the_choices(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = Vocabulary(tok, [tok.eos_token_id])
    choices = candidate_replies(TASKS["fix-both"])
    con = ChoiceConstraint(vocab, choices)
    first = con.allowed([])
    assert tok.convert_tokens_to_ids("<tool_call>") in first and tok.eos_token_id not in first
    for i in first:  # every allowed first token starts some choice, and every choice starts with one
        assert any(c.encode().startswith(vocab.bytes[i]) for c in choices)
    assert all(any(c.encode().startswith(vocab.bytes[i]) for i in first) for c in choices)
    # Any tokenization of a choice is allowed, then only end-of-sequence.
    for text in choices:
        for ids in (tok.encode(text, add_special_tokens=False), [tok.convert_tokens_to_ids(t) for t in
                                                                   tok.tokenize(text[:3])] + tok.encode(
                                                                       text[3:], add_special_tokens=False)):
            for j, t in enumerate(ids):
                assert t in con.allowed(ids[:j]), (text, j)
            assert con.allowed(ids) == (tok.eos_token_id,)
    # Text that leaves every choice is a dead end.
    off = tok.encode("<tool_call>\nhello", add_special_tokens=False)
    assert con.allowed(off) == ()
