"""bunshinrl inside verl (0.9): a BaseTool its tool registry loads, an agent loop its registry
finds, and a client for its token-level server interface on a vLLM OpenAI-compatible server.

    # tool_config.yaml, loaded by verl's initialize_tools_from_config
    tools:
      - class_name: bunshinrl.adapters.verl.BunshinTool
        config: {type: native, task: fix-both, template: {rootfs: host}}

BunshinTool is verl's own BaseTool, built as `BunshinTool(config=..., tool_schema=...)`. Its
`execute` runs the call on the trajectory's Rollout (bunshinrl.rollout.core): the prefix cache may skip
it, a speculative branch may already have run it. The trajectory is `agent_data.request_id`,
one per sample (never a dataset-level field), so each sample has its own workspace.

BunshinAgentLoop (`@register("bunshin_agent")`) is verl's ToolAgentLoop with bunshinrl's rollout
around it: it starts the sample's Rollout in its GRPO group (the samples sharing verl's `uid`
fork one snapshot of the task's initialized workspace; with the prefix cache they stand on its
root state), its turns' tool calls go through BunshinTool (parallel calls run in order), the
calls it predicts run while the server generates, and when the episode ends the task's
verifier scores the final state into `AgentLoopOutput.reward_score`.

verl's conversation cannot be cut back, so a sample whose served step does not reproduce (the
rollout core's Rewound: a cached observation its own workspace would not have produced, met at a
later call or, at the latest, as the episode ends: nothing is scored before the replays behind
the sample's hits are verified) is not rewound: BunshinAgentLoop ends the episode there,
discards it, and re-rolls the whole trajectory with the cache off for it
(Runtime.start(cached=False): every call runs on the trajectory's own workspace).
`extra_fields["bunshin"]` counts `rerolled` and `rerolled_seconds` (the discarded attempt's time)
beside the divergences, the discarded attempt's included with their outcome (`outcome_rerolled`),
so `divergences_unaccounted` stays 0. A BunshinTool driven by another agent loop refuses such a trajectory
instead: its later calls fail and it is scored 0.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from ..calls.signature import ToolCall
from ..calls.task import Task
from ..calls.tools import is_hidden
from ..rollout.core import Rewound, Rollout
from .runtime import Runtime, plain, resolve_task, rollout_metrics, task_options, with_discarded_attempt

log = logging.getLogger(__name__)


class _Reroll(BaseException):
    """A served step of a trajectory BunshinAgentLoop runs did not reproduce: the episode ends
    here and is rolled again. A BaseException so that verl's tool agent loop, which turns a tool's
    Exception into the model's next observation, lets it through to BunshinAgentLoop.run."""


# Trajectories (request ids) whose agent loop re-rolls them on a divergence.
_REROLLING: set[str] = set()


class BunshinTool(BaseTool):
    """One tool of a bunshinrl task, as verl's BaseTool.

    config: {"type": "native", "task": a task id or "module:attribute", "template": WorkspaceSpec
    fields for its workspaces (optional), "tool": the tool's name (default: the schema's)}.
    Without tool_schema the schema is the task tool's own.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        name, template = task_options(config)
        self.task: Task = resolve_task(name, template)
        tool = config.get("tool") or (tool_schema.function.name if tool_schema is not None else None)
        if not tool:
            raise ValueError("config needs 'tool' (or a tool_schema naming the function)")
        if is_hidden(str(tool)):
            raise ValueError(f"{tool!r} is the harness's own tool and is never offered to a model")
        self.tool = self.task.agent_tools[str(tool)]
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(self.tool.schema()))
        self._warned = False

    @property
    def runtime(self) -> Runtime:
        return Runtime.shared()

    def _trajectory(self, instance_id: str, kwargs: Mapping[str, Any]) -> str:
        explicit = kwargs.get("trajectory_id")
        if explicit:
            return str(explicit)
        agent_data = kwargs.get("agent_data")
        request_id = getattr(agent_data, "request_id", None)
        if request_id:
            return str(request_id)
        if not self._warned:
            log.warning("no trajectory for tool %s (pass agent_data or trajectory_id): its workspace lasts one call",
                        self.name)
            self._warned = True
        return instance_id

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        # create_kwargs are dataset-level (shared by a GRPO group): they never name a trajectory.
        return instance_id or f"bunshin-{uuid.uuid4().hex}", ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        key = self._trajectory(instance_id, kwargs)
        rollout = self.runtime.get(key) or await self.runtime.start(key, self.task)
        try:
            obs = await rollout.call(ToolCall(self.name, parameters))
        except Rewound:
            if key in _REROLLING:
                raise _Reroll() from None
            raise  # refused: verl's loop shows the model the error, later calls fail
        return ToolResponse(text=obs), 0.0, {"trajectory_id": key, "served": rollout.served[-1]}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The task's verifier on the trajectory's final state; the trajectory ends here. A
        trajectory whose served step does not reproduce (found as it ends: the replays behind its
        hits are awaited first) is refused: scored 0 (BunshinAgentLoop re-rolls it instead)."""
        try:
            r = await self.runtime.end(self._trajectory(instance_id, kwargs))
        except Rewound:
            return 0.0
        return float(r.reward) if r is not None and r.reward is not None else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        # verl releases after every call; the trajectory outlives that. A call that named no
        # trajectory was its own.
        if self.runtime.get(instance_id) is not None:
            await self.runtime.discard(instance_id)


@register("bunshin_agent")
class BunshinAgentLoop(ToolAgentLoop):
    """verl's tool agent loop with bunshinrl's rollout around each sample (see the module doc).

    runtime: bunshinrl.adapters.runtime.RuntimeConfig fields (from verl's agent_loop_config_path
    entry). constrain: decode only the task's candidate replies (vLLM's structured outputs), for
    a model too small to call tools unaided. The sample's task is `extra_info.bunshin_task`, else
    the one its BunshinTools name.
    """

    def __init__(self, *args: Any, runtime: Mapping[str, Any] | None = None, constrain: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.runtime = Runtime.shared(plain(runtime) if runtime is not None else None)
        self.constrain = bool(constrain)
        ours = [t for t in self.tools.values() if isinstance(t, BunshinTool)]
        if not ours:
            raise ValueError("bunshin_agent needs BunshinTools in the tool config (multi_turn.tool_config_path)")
        self._default_tasks = {t.task.id: t.task for t in ours}
        self._task: Task | None = None
        self._group: str | None = None
        self._agent_data: AgentData | None = None
        self._cached = True

    def _sample_task(self, kwargs: Mapping[str, Any]) -> Task:
        name = plain(kwargs.get("extra_info")).get("bunshin_task")
        if name:
            return self._default_tasks.get(str(name)) or resolve_task(str(name))
        if len(self._default_tasks) != 1:
            raise ValueError(f"the tools name tasks {sorted(self._default_tasks)}: say which one a sample is with "
                             "extra_info.bunshin_task")
        return next(iter(self._default_tasks.values()))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        self._task = task = self._sample_task(kwargs)
        uid = kwargs.get("uid")
        self._group = str(uid) if uid is not None else None
        if self.constrain:
            from ..policies.chat import candidate_replies

            sampling_params = {**sampling_params, "structured_outputs": {"choice": list(candidate_replies(task))}}
        t = time.monotonic()
        episode = await self._episode(sampling_params, kwargs, cached=True)
        rerolled_seconds, diverged = 0.0, None
        if isinstance(episode, Rollout):
            # A served step did not reproduce: the attempt is discarded, the trajectory rolled
            # again with every call run on its own workspace.
            diverged, rerolled_seconds = episode, time.monotonic() - t
            episode = await self._episode(sampling_params, kwargs, cached=False)
        assert not isinstance(episode, Rollout)
        output, rollout = episode
        output.reward_score = rollout.reward
        metrics = rollout_metrics(rollout)
        if diverged is not None:
            metrics = with_discarded_attempt(metrics, diverged)
        metrics["rerolled_seconds"] = round(rerolled_seconds, 3)
        output.extra_fields["bunshin"] = metrics
        return output

    async def _episode(self, sampling_params: dict[str, Any], kwargs: Mapping[str, Any],
                       cached: bool) -> tuple[AgentLoopOutput, Rollout] | Rollout:
        """One attempt at the sample's trajectory: (verl's output, the scored rollout), or the
        discarded rollout when a served step did not reproduce (only with the cache)."""
        self._cached = cached
        self._agent_data = None
        try:
            output = await super().run(sampling_params, **kwargs)
            assert self._agent_data is not None
            last = self._agent_data.messages[-1] if self._agent_data.messages else {}
            answered = last.get("role") == "assistant" and not last.get("tool_calls")
            rollout = await self.runtime.end(self._agent_data.request_id,
                                             str(last.get("content") or "") if answered else None)
        except (_Reroll, Rewound):  # Rewound: the verifier's call found it, in end()
            if self._agent_data is None or not cached:
                raise
            key = self._agent_data.request_id
            discarded = self.runtime.get(key)
            if discarded is not None:
                await self.runtime.discard(key)
            else:  # end() had closed it
                discarded = next(r for k, r in reversed(self.runtime.finished) if k == key)
            return discarded
        except BaseException:
            if self._agent_data is not None:
                await self.runtime.discard(self._agent_data.request_id)
            raise
        finally:
            if self._agent_data is not None:
                _REROLLING.discard(self._agent_data.request_id)
        assert rollout is not None
        return output, rollout

    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        assert self._task is not None
        self._agent_data = agent_data
        if not self._cached and self.runtime.get(agent_data.request_id) is not None:
            # A parallel call of the discarded attempt, still unwinding, may have opened the key again.
            await self.runtime.discard(agent_data.request_id)
        await self.runtime.start(agent_data.request_id, self._task, group=self._group, cached=self._cached)
        if self._cached:
            _REROLLING.add(agent_data.request_id)
        return await super()._handle_pending_state(agent_data, sampling_params)


class VLLMServerClient(LLMServerClient):
    """verl's token-level server interface (`generate(request_id, prompt_ids=, sampling_params=)`
    -> TokenOutput) on a vLLM OpenAI-compatible server: its completions route with token ids in
    and out (vLLM's `return_token_ids`), through bunshinrl's openai SDK client. A thin stand-in
    for verl's Ray-managed replicas where the server runs outside verl (here: VLLMServer).

    Every request is seeded from (request id, prompt length): a sample's turns under
    full_determinism (request ids `det-N`) sample the same replies on every run.
    """

    def __init__(self, config: DictConfig, base_url: str, model: str, *, api_key: str = "EMPTY",
                 timeout: float = 120.0) -> None:
        super().__init__(config, load_balancer_handle=None)
        from ..policies.openai_policy import OpenAIClient

        self.model = model
        self.client = OpenAIClient(base_url, api_key=api_key, timeout=timeout)
        self.requests = 0

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       mm_processor_kwargs: Any = None, **kwargs: Any) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise NotImplementedError("VLLMServerClient serves text-only prompts")
        params = dict(sampling_params)
        logprobs = bool(params.pop("logprobs", False))
        top_k = int(params.pop("top_k", -1))
        max_tokens = params.pop("max_tokens", None) or params.pop("max_new_tokens", None) or \
            int(self.config.actor_rollout_ref.rollout.response_length)
        seed = params.pop("seed", None)
        if seed is None:
            seed = int.from_bytes(hashlib.sha256(f"{request_id}/{len(prompt_ids)}".encode()).digest()[:4],
                                  "little") & 0x7FFF_FFFF
        extra = {"top_k": max(top_k, 0), "return_token_ids": True, **params}
        temperature = float(extra.pop("temperature", 1.0))
        top_p = float(extra.pop("top_p", 1.0))
        reply = await self.client().completions.create(
            model=self.model, prompt=list(prompt_ids), max_tokens=int(max_tokens), temperature=temperature,
            top_p=top_p, seed=int(seed), logprobs=0 if logprobs else None, extra_body=extra)
        self.requests += 1
        choice = reply.choices[0]
        ids = list(getattr(choice, "token_ids", None) or [])
        lps = None
        if logprobs and choice.logprobs is not None and choice.logprobs.token_logprobs is not None:
            lps = [float(x) for x in choice.logprobs.token_logprobs]
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason="completed",
                           extra_fields={"finish_reason": choice.finish_reason})

    async def aclose(self) -> None:
        await self.client.aclose()


__all__ = ["BunshinAgentLoop", "BunshinTool", "VLLMServerClient"]
