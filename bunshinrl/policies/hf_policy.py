"""HFPolicy: any Hugging Face causal LM as a bunshinrl policy (rolled out in process with
`generate`) and as the learner GRPOTrainer trains.

    policy = HFPolicy.from_pretrained("/models/Qwen2.5-0.5B-Instruct", suite())

The prompt is the task and the history rendered by the tokenizer's own chat template, the
task's tools passed as OpenAI function schemas (`apply_chat_template(..., tools=...)`). The
reply is parsed in the model family's tool-call format (see chat.py); a malformed call becomes
an "invalid tool call: ..." observation. Every decision is sampled with its own seed
(seeds.sample_seed) on a batch of one, so the same weights and history give the same reply
however the engine interleaves rollouts. With `constrain`, decoding is limited to the task's
candidate calls exactly as vLLM's `structured_outputs` choice limits it (constrain.py); by
default that is on only for the project's test model, which is far too small to call tools
unaided. Each decision is recorded as a Turn (prompt ids, reply ids, their log-probs).

generate() runs under a lock: one model, one decision at a time (the engine's other samples
keep running their tools meanwhile).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# One intra-op thread unless the process chose otherwise, set before torch starts its OpenMP
# pool: rollouts fork workspaces from many threads at once, and on a small host an OpenMP pool
# spin-waiting after every op takes the cores from the workspaces.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from .._async import run_blocking
from ..calls.policy import Action, SampleContext, Step
from ..calls.replies import parse_reply
from ..calls.task import Task
from .chat import SYSTEM_PROMPT, candidate_replies, messages, template_messages
from .constrain import ChoiceConstraint, Vocabulary
from .seeds import sample_seed
from .turns import Turn, TurnKey, TurnLog


def is_test_model(path: str | os.PathLike[str]) -> bool:
    cfg = Path(path) / "config.json"
    try:
        return bool(json.loads(cfg.read_text()).get("bunshin_test_model"))
    except (OSError, ValueError):
        return False


class HFPolicy:
    """A causal LM and its tokenizer, for the tasks `tasks`."""

    def __init__(self, model: Any, tokenizer: Any, tasks: Sequence[Task] | Mapping[str, Task], *,
                 seed: int = 0, temperature: float = 1.0, max_new_tokens: int = 256, constrain: bool = False,
                 system: str | None = SYSTEM_PROMPT, name: str = "") -> None:
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy decoding is not a sampling policy)")
        self.model = model
        self.tokenizer = tokenizer
        self.tasks = dict(tasks) if isinstance(tasks, Mapping) else {t.id: t for t in tasks}
        self.seed = seed
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.constrain = constrain
        self.system = system
        self.name = name
        self.weight_version = "0"
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        self.vocab = Vocabulary(tokenizer, self.eos_ids, size=model.config.vocab_size)
        self._schemas = {k: t.agent_tools.schemas() for k, t in self.tasks.items()}
        self._constraints: dict[tuple[str, ...], ChoiceConstraint] = {}
        self.turns = TurnLog()
        self._lock = threading.Lock()
        self.model.eval()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str],
                        tasks: Sequence[Task] | Mapping[str, Task],
                        *, constrain: bool | None = None, dtype: torch.dtype = torch.float32,
                        **kwargs: Any) -> HFPolicy:
        """Load a local model directory (or a hub name, which needs network). constrain=None:
        on for the project's test model only."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if constrain is None:
            constrain = is_test_model(path)
        return cls(model, tokenizer, tasks, constrain=constrain, name=str(path), **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- prompts and constraints ----

    def prompt_ids(self, task_id: str, prompt: str, history: Sequence[Step]) -> list[int]:
        msgs = template_messages(messages(prompt or self.tasks[task_id].prompt, history, self.system))
        enc = self.tokenizer.apply_chat_template(msgs, tools=self._schemas[task_id], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)
        return list(enc["input_ids"])

    def choices(self, task_id: str) -> tuple[str, ...] | None:
        return candidate_replies(self.tasks[task_id]) if self.constrain else None

    def constraint(self, choices: Sequence[str]) -> ChoiceConstraint:
        key = tuple(choices)
        c = self._constraints.get(key)
        if c is None:
            c = self._constraints[key] = ChoiceConstraint(self.vocab, key)
        return c

    # ---- sampling (rollouts) ----

    def generate(self, prompt_ids: Sequence[int], seed: int, choices: Sequence[str] | None = None,
                 ) -> tuple[list[int], list[float], str]:
        """(reply ids, their log-probs, finish reason) sampled with `seed`. The log-probs are
        those of the distribution sampled from: after the constraint's mask, at the temperature."""
        n = len(prompt_ids)
        allow = None
        if choices is not None:
            con = self.constraint(choices)

            def allow(_batch: int, ids: torch.Tensor) -> list[int]:
                # Never empty (an all -inf row would be NaN): a dead end can only end.
                return list(con.allowed(ids[n:].tolist()) or self.eos_ids)

        with self._lock, torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=torch.tensor([list(prompt_ids)], device=self.device),
                attention_mask=torch.ones(1, n, dtype=torch.long, device=self.device),
                do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0, max_new_tokens=self.max_new_tokens,
                prefix_allowed_tokens_fn=allow, eos_token_id=list(self.eos_ids),
                pad_token_id=self.tokenizer.pad_token_id, return_dict_in_generate=True, output_scores=True)
        ids = out.sequences[0, n:].tolist()
        logps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, ids, strict=False)]
        ids = ids[:len(logps)]
        finish = "stop" if ids and ids[-1] in self.eos_ids else "length"
        return ids, logps, finish

    def decide(self, ctx: SampleContext, history: Sequence[Step]) -> tuple[Turn, str]:
        prompt = self.prompt_ids(ctx.task_id, ctx.prompt, history)
        choices = self.choices(ctx.task_id)
        seed = sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history))
        ids, logps, finish = self.generate(prompt, seed, choices)
        text = self.tokenizer.decode([i for i in ids if i not in self.eos_ids], skip_special_tokens=True)
        return Turn(tuple(prompt), tuple(ids), tuple(logps), choices, self.weight_version, finish), text

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        turn, text = await run_blocking(self.decide, ctx, history)
        self.turns.record(ctx.epoch, ctx.task_id, ctx.sample, len(history), turn)
        return parse_reply(text, self.tasks[ctx.task_id].agent_tools)

    def take_turns(self, epoch: int) -> dict[TurnKey, Turn]:
        return self.turns.take(epoch)

    # ---- training ----

    def parameters(self) -> Any:
        return self.model.parameters()

    def token_logprobs(self, ids: torch.Tensor, attention: torch.Tensor,
                       constrained: Sequence[tuple[int, int, Sequence[int]]] = (), model: Any = None) -> torch.Tensor:
        """[rows, len] log-prob of each token given the ones before it (column 0 is 0), at the
        policy's temperature. constrained: (row, col, allowed token ids) for each token that
        was sampled under a constraint, whose log-prob is then that of the masked distribution.
        model: another model with this one's tokenizer (the frozen reference)."""
        model = self.model if model is None else model
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / self.temperature
        if constrained:
            mask = torch.full((len(constrained), logits.shape[-1]), float("-inf"))
            for k, (_r, _c, allowed) in enumerate(constrained):
                mask[k, list(allowed)] = 0.0
            mask = mask.to(logits.device)
            rows = torch.tensor([r for r, _, _ in constrained], device=logits.device)
            cols = torch.tensor([c - 1 for _, c, _ in constrained], device=logits.device)
            logits = logits.index_put((rows, cols), logits[rows, cols] + mask)
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return torch.cat([torch.zeros(ids.shape[0], 1, device=lp.device), lp], dim=1)

    @torch.no_grad()
    def turn_logprobs(self, turn: Turn) -> list[float]:
        """This model's log-probs of a recorded turn's reply tokens, under the turn's constraint:
        what the rollout engine's `turn.logprobs` would be had it run these very weights."""
        ids = torch.tensor([list(turn.prompt_ids + turn.response_ids)], device=self.device)
        n = len(turn.prompt_ids)
        allowed = self.constraint(turn.choices).allowed_each(list(turn.response_ids)) if turn.choices else []
        lp = self.token_logprobs(ids, torch.ones_like(ids), [(0, n + j, a) for j, a in enumerate(allowed)])
        return lp[0, n:].tolist()

    def parameters_digest(self) -> str:
        """A hash of the weights: equal digests mean bit-identical models."""
        h = hashlib.sha256()
        for k, v in sorted(self.model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().float().contiguous().numpy().tobytes())
        return h.hexdigest()

    def save_weights(self, path: str | os.PathLike[str]) -> Path:
        """The weights as a checkpoint directory a server reloads from (safetensors, HF names)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, safe_serialization=True)
        return out


__all__ = ["HFPolicy", "is_test_model"]
