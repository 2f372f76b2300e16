"""VLLMPolicy: rollouts from a model loaded in-process with vLLM (a GPU host).

Only usable where vllm is installed and a CUDA GPU is visible; everywhere else constructing it
raises BackendUnavailable saying which of the two is missing. vllm is imported inside the
constructor, never at module import, and this project installs neither vllm nor a CUDA torch:
a CPU install stays free of CUDA wheels, and a GPU host brings its own vllm.

Each decision is one llm.chat() call with the task's tools, a per-decision seed (the same seeds
as every other backend) and, with constrain=True, a guided choice among the task's candidate
action texts. The completion's cumulative log-probability is kept as the behaviour log-prob.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._async import run_blocking
from ..adapters.openai_tools import tool_schemas
from ..policy import Action, SampleContext, Step
from .actions import parse_action
from .openai_policy import chat_messages
from .rollout import sample_seed
from .tasks import VerifiableTask


class BackendUnavailable(RuntimeError):
    """A policy backend cannot run on this machine (missing package or hardware)."""


def vllm_available() -> tuple[bool, str]:
    """(usable, why not). Cheap: finds the packages without importing vllm."""
    if importlib.util.find_spec("vllm") is None:
        return False, ("vllm is not installed; VLLMPolicy needs vllm and a CUDA GPU. Install vllm on a GPU "
                       "host (this project never installs it, so CPU installs never pull CUDA wheels)")
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return False, "vllm is installed but no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return True, ""


def _default_params_factory() -> Callable[..., Any]:
    from vllm import SamplingParams

    def make(*, seed: int, temperature: float, max_tokens: int, choices: Sequence[str] | None) -> Any:
        kw: dict[str, Any] = {"seed": seed, "temperature": temperature, "max_tokens": max_tokens, "logprobs": 0}
        if choices is not None:
            # The structured-output API was renamed in vLLM 0.11; support both spellings.
            try:
                from vllm.sampling_params import StructuredOutputsParams

                kw["structured_outputs"] = StructuredOutputsParams(choice=list(choices))
            except ImportError:
                from vllm.sampling_params import GuidedDecodingParams

                kw["guided_decoding"] = GuidedDecodingParams(choice=list(choices))
        return SamplingParams(**kw)

    return make


class VLLMPolicy:
    """A bunshinrl Policy sampling from vllm.LLM(model).

    llm / params_factory replace the vLLM engine and SamplingParams constructor (an engine
    shared with a trainer that syncs weights into it, or a stand-in in tests).
    """

    def __init__(self, model: str, tasks: Sequence[VerifiableTask] | Mapping[str, VerifiableTask], *,
                 seed: int = 0, temperature: float = 1.0, max_tokens: int = 256, constrain: bool = True,
                 llm: Any | None = None, params_factory: Callable[..., Any] | None = None,
                 **llm_kwargs: Any) -> None:
        if llm is None:
            ok, why = vllm_available()
            if not ok:
                raise BackendUnavailable(f"VLLMPolicy is unavailable here: {why}")
            from vllm import LLM

            llm = LLM(model=model, seed=seed, **llm_kwargs)
        self.llm = llm
        self.params = params_factory or _default_params_factory()
        self.model = model
        self.tasks = dict(tasks) if isinstance(tasks, Mapping) else {t.id: t for t in tasks}
        self.seed = seed
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.constrain = constrain
        self._schemas = {k: tool_schemas(t.agent_tools) for k, t in self.tasks.items()}
        self._behaviour: dict[tuple[int, str, int, int], float] = {}
        self._lock = threading.Lock()

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        task = self.tasks[ctx.task_id]
        seed = sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history))
        params = self.params(seed=seed, temperature=self.temperature, max_tokens=self.max_tokens,
                             choices=task.actions if self.constrain else None)
        messages = chat_messages(ctx.prompt or task.prompt, history)
        outputs = await run_blocking(self.llm.chat, [messages], params, use_tqdm=False,
                                     tools=self._schemas[ctx.task_id])
        completion = outputs[0].outputs[0]
        logp = getattr(completion, "cumulative_logprob", None)
        if logp is not None:
            with self._lock:
                self._behaviour[(ctx.epoch, ctx.task_id, ctx.sample, len(history))] = float(logp)
        return parse_action(completion.text)

    def behaviour_logprobs(self, epoch: int) -> dict[tuple[str, int, int], float]:
        with self._lock:
            keys = [k for k in self._behaviour if k[0] == epoch]
            return {k[1:]: self._behaviour.pop(k) for k in keys}
