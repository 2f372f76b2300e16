"""Between the trainer and RolloutEngine: per-decision seeds, episodes, engine configurations.

The engine itself enforces each task's step budget and, once the agent answers (or the budget is
spent), calls the task's verifier, so the reward is read from the final workspace state
whatever served that state (a real execution, the prefix cache, a speculative fork). Episodes
are then rebuilt from the engine's timelines alone: which actions the agent took is fully
determined by the recorded steps and the budget, so no side channel between policy and trainer
is needed.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..calls.policy import Action, Policy, SampleContext, Step
from ..calls.task import REWARD_TOOL, Task
from ..policies.actions import FINAL, action_text, from_text
from ..policies.seeds import sample_seed
from ..prefix.cache import SnapshotPolicy, ToolPrefixCache
from ..rollout.configs import CONFIGS, Config, caches, check_config, speculates
from ..rollout.engine import RolloutEngine
from ..rollout.timeline import EpochResult, SampleTimeline
from ..rollout.wiring import CoreConfig, build_core


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
    # Per action, the step index at which the agent made the decision behind it (the key of
    # its recorded Turn); the calls of one decision (parallel tool calls) share one.
    decisions: tuple[int, ...] = ()

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


def episode(tl: SampleTimeline, task: Task) -> Episode:
    steps = [s for s in tl.steps if s.call.name != REWARD_TOOL]
    errors = list(tl.errors)
    verified = tl.reward is not None
    if not verified and not any(s.call.name == REWARD_TOOL for s in tl.steps):
        errors.append("the rollout ended before its reward was computed")
    actions = [s.call.key for s in steps]
    decisions = [s.decision for s in steps]
    if verified and tl.answer is not None:
        actions.append(FINAL)  # the agent stopped by itself: that was a decision too
        decisions.append(len(steps))
    return Episode(tl.task_id, tl.sample, tl.epoch, task.prompt, tuple(actions),
                   tuple(s.observation for s in steps), tl.reward or 0.0, tuple(errors), verified,
                   tuple(sorted(set(decisions))))


def episodes(result: EpochResult, tasks: Mapping[str, Task]) -> list[Episode]:
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

    def __init__(self, tasks: Mapping[str, Task], seed: int = 0) -> None:
        self.tasks = dict(tasks)
        self.seed = seed

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        rng = random.Random(sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history)))
        return from_text(rng.choice(self.tasks[ctx.task_id].actions))


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


def make_engine(config: Config, policy: Policy, tasks: Sequence[Task], *, store: Path | None = None,
                memory: str = "auto", cache_bytes: int = 1 << 40, spec_depth: int = 2,
                slow_tool_seconds: float = 0.0, snapshot_every: int = 2, snapshot_slower_than: float | None = 0.1,
                memory_interval: float = 0.25, snapshot_policy: SnapshotPolicy = "cost") -> EngineBundle:
    """Base: memory sharing only. Spec: + speculative tool execution. Full: + tool-prefix cache.

    slow_tool_seconds=0 lets speculation run for every tool: the suite's tools take tens of
    milliseconds, below any threshold a real workload would use, and the point here is to
    exercise speculation on every call (and show it changes nothing about the rewards).
    The cache captures by cost (snapshot_policy="cost"): a state is captured when the replay it
    saves takes as long as a capture, and only beside a reasoning step predicted to outlast it
    (bunshinrl.rollout.wiring.build_core, shared with every other driver); "depth" captures every
    snapshot_every-th depth and calls slower than snapshot_slower_than.
    """
    check_config(config)
    core = build_core(CoreConfig(
        cache_bytes=cache_bytes if caches(config) else 0, store=store, snapshot_policy=snapshot_policy,
        snapshot_every=snapshot_every, snapshot_slower_than=snapshot_slower_than,
        speculation_depth=spec_depth if speculates(config) else 0, slow_tool_seconds=slow_tool_seconds,
        min_probability=0.3, memory=memory))
    engine = RolloutEngine(policy, core=core, max_steps=max(t.budget for t in tasks) + 1,
                           memory_interval=memory_interval)
    return EngineBundle(engine, core.cache, store if core.cache is not None else None)


__all__ = ["CONFIGS", "Config", "EngineBundle", "Episode", "RandomPolicy", "action_text", "episode", "episodes",
           "make_engine", "sample_seed", "trajectory_digest"]
