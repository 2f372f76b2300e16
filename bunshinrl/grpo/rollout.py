"""The rollout harness between a policy and RolloutEngine: step budgets, the reward call, episodes.

HarnessPolicy wraps the agent's policy for the engine. It enforces each task's step budget and,
once the agent answers (or the budget is spent), makes one last call to the task's hidden
verifier tool, so the reward is read from the final workspace state inside the engine, whatever
served the state (a real execution, the prefix cache, a speculative fork). Episodes are then
rebuilt from the engine's timelines alone: which actions the agent took is fully determined by
the recorded steps and the budget, so no side channel between policy and trainer is needed.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..backend import SnapshotBackend
from ..cache import ToolPrefixCache
from ..engine import RolloutEngine
from ..guard import DeterminismGuard
from ..policy import Action, FinalAnswer, Policy, SampleContext, Step
from ..signature import ToolCall
from ..speculator import Speculator
from ..tail import TailPolicy
from ..timeline import EpochResult, SampleTimeline
from .actions import FINAL, action_text, parse_action
from .tasks import REWARD_TOOL, VerifiableTask, parse_reward

Config = Literal["Base", "Spec", "Full"]
CONFIGS: tuple[Config, ...] = ("Base", "Spec", "Full")


def sample_seed(seed: int, epoch: int, task_id: str, sample: int, step: int) -> int:
    """The sampling seed of one decision. Keyed by what the decision is, never by when it is
    made, so Base, Spec and Full sample identically however the engine interleaves rollouts.
    31 bits: what every backend's seed parameter accepts (OpenAI's API, vLLM, torch), so all
    backends draw with the very same seed."""
    h = hashlib.sha256(f"{seed}/{epoch}/{task_id}/{sample}/{step}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFF_FFFF


class HarnessPolicy:
    """The engine-facing policy: the agent's actions, then the verifier call, then the end.

    think_seconds stands in for an LLM's decoding latency (a tiny CPU model answers in
    milliseconds, which would leave speculation nothing to overlap with); 0 by default.
    """

    def __init__(self, agent: Policy, tasks: Mapping[str, VerifiableTask], think_seconds: float = 0.0) -> None:
        self.agent = agent
        self.tasks = dict(tasks)
        self.think_seconds = think_seconds

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        task = self.tasks[ctx.task_id]
        if history and history[-1].call.name == REWARD_TOOL:
            return FinalAnswer("done")
        if len(history) >= task.budget:
            return ToolCall(REWARD_TOOL)
        if self.think_seconds:
            await asyncio.sleep(self.think_seconds)
        action = await self.agent.act(ctx, history)
        if isinstance(action, FinalAnswer):
            return ToolCall(REWARD_TOOL)
        return action


@dataclass(frozen=True)
class Episode:
    """One rollout as the trainer sees it: the agent's actions (texts, FINAL included when the
    agent chose to stop), the observation after each tool action, and the reward."""

    task_id: str
    sample: int
    epoch: int
    prompt: str
    actions: tuple[str, ...]
    observations: tuple[str, ...]
    reward: float
    errors: tuple[str, ...] = ()  # what the engine noted; fatal only when unverified
    verified: bool = True

    @property
    def ok(self) -> bool:
        """The verifier scored the final state; only such episodes carry a learning signal.
        An engine note such as a failed capture for the cache leaves the rollout itself intact
        (it went on in its own workspace), so it does not void the episode."""
        return self.verified

    def context(self, step: int) -> tuple[str, list[tuple[str, str]]]:
        """What the agent saw before its step-th action: the prompt and the (action, observation)
        pairs so far."""
        return self.prompt, list(zip(self.actions[:step], self.observations[:step], strict=True))

    def key(self) -> tuple[str, int]:
        return self.task_id, self.sample


def episode(tl: SampleTimeline, task: VerifiableTask) -> Episode:
    steps = list(tl.steps)
    errors = list(tl.errors)
    reward, verified = 0.0, False
    if steps and steps[-1].call.name == REWARD_TOOL:
        try:
            reward, verified = parse_reward(steps[-1].observation), True
        except ValueError as e:
            errors.append(str(e))  # the verifier itself failed (its tool raised)
        steps = steps[:-1]
    else:
        errors.append("the rollout ended before its reward was computed")
    actions = [s.call.key for s in steps]
    if len(steps) < task.budget and verified:
        actions.append(FINAL)  # the agent stopped by itself: that was a decision too
    return Episode(tl.task_id, tl.sample, tl.epoch, task.prompt, tuple(actions),
                   tuple(s.observation for s in steps), reward, tuple(errors), verified)


def episodes(result: EpochResult, tasks: Mapping[str, VerifiableTask]) -> list[Episode]:
    """Every sample of an epoch, ordered by (task, sample) so training never depends on timing."""
    out = [episode(tl, tasks[tl.task_id]) for tl in result.samples]
    return sorted(out, key=Episode.key)


def trajectory_digest(eps: Sequence[Episode]) -> str:
    """One hash of everything that must be equal between configurations: actions, observations
    and rewards of every sample."""
    h = hashlib.sha256()
    for e in sorted(eps, key=Episode.key):
        h.update(repr((e.task_id, e.sample, e.actions, e.observations, e.reward)).encode())
    return h.hexdigest()


class RandomPolicy:
    """The baseline: a uniformly random choice among the task's candidate actions, seeded per
    decision like the trained policies."""

    def __init__(self, tasks: Mapping[str, VerifiableTask], seed: int = 0) -> None:
        self.tasks = dict(tasks)
        self.seed = seed

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        rng = random.Random(sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history)))
        return parse_action(rng.choice(self.tasks[ctx.task_id].actions))


# ---- engine configurations (paper section 5.3) ----

@dataclass
class EngineBundle:
    """An engine and what must be closed with it."""

    engine: RolloutEngine
    cache: ToolPrefixCache | None
    store: Path | None

    async def aclose(self) -> None:
        if self.cache is not None:
            await asyncio.to_thread(self.cache.close)
            self.cache = None
        if self.store is not None:
            shutil.rmtree(self.store, ignore_errors=True)
            self.store = None


def max_steps(tasks: Sequence[VerifiableTask]) -> int:
    # The agent's budget, the verifier call, and the final answer after it.
    return max(t.budget for t in tasks) + 2


def make_engine(config: Config, policy: Policy, tasks: Sequence[VerifiableTask], *, store: Path | None = None,
                memory: str = "auto", cache_bytes: int = 1 << 40, spec_depth: int = 2,
                slow_tool_seconds: float = 0.0, snapshot_every: int = 2, snapshot_slower_than: float | None = 0.1,
                memory_interval: float = 0.25) -> EngineBundle:
    """Base: memory sharing only. Spec: + speculative tool execution. Full: + tool-prefix cache.

    slow_tool_seconds=0 lets speculation run for every tool: the suite's tools take tens of
    milliseconds, below any threshold a real workload would use, and the point here is to
    exercise speculation on every call (and show it changes nothing about the rewards).
    The cache snapshots sparsely by default: a capture costs more than replaying one of these
    calls, except for slow ones (starting a service), which are always captured.
    """
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; one of {', '.join(CONFIGS)}")
    guard = DeterminismGuard()
    cache = spec = None
    if config == "Full":
        cache = ToolPrefixCache(SnapshotBackend(store), cache_bytes, guard=guard,
                                snapshot_every=snapshot_every, snapshot_slower_than=snapshot_slower_than)
    if config in ("Spec", "Full"):
        spec = Speculator(depth=spec_depth, tail=TailPolicy(slow_tool_seconds=slow_tool_seconds),
                          min_probability=0.3)
    engine = RolloutEngine(policy, cache=cache, speculator=spec, guard=guard, memory=memory,
                           max_steps=max_steps(tasks), memory_interval=memory_interval)
    return EngineBundle(engine, cache, store if cache is not None else None)


__all__ = ["CONFIGS", "Config", "EngineBundle", "Episode", "HarnessPolicy", "RandomPolicy", "action_text",
           "episode", "episodes", "make_engine", "max_steps", "sample_seed", "trajectory_digest"]
