"""RolloutEngine: an asyncio rollout of N tasks x G samples over forked workspaces.

The driver of our own GRPO loop over the rollout core (core.py): every group starts from one
initialized workspace, every sample asks its policy for the next decision and runs its calls
on its Rollout until the policy answers or the task's budget is spent, then the task's verifier
scores the final state. Background work (capturing states for the cache, speculative chains,
rebuilding cached states) runs while the policy reasons, so it stays off the critical path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Future

from ..calls.guard import DeterminismGuard
from ..calls.policy import Policy, SampleContext
from ..calls.task import Task
from ..prefix.cache import ToolPrefixCache
from ..speculation.selector import SelectorReport, Trajectory
from ..speculation.speculator import Speculator
from ..speculation.tail import TailPolicy
from ..states.metrics import MemorySampler
from .agent_loop import AgentLoop
from .core import Rollout, RolloutCore
from .timeline import EpochResult
from .wiring import CoreConfig, build_core


class RolloutEngine:
    """Runs GRPO groups with any combination of prefix caching and speculation.

    cache=None and speculator=None is plain memory sharing (Base). The core records every
    trajectory (`history`) and tool timing (`tail`), which train the speculator's selector.
    max_steps bounds a sample's decisions; the task's budget bounds its tool calls.
    """

    def __init__(self, policy: Policy, *, cache: ToolPrefixCache | None = None,
                 speculator: Speculator | None = None, guard: DeterminismGuard | None = None,
                 tail: TailPolicy | None = None, memory: str = "auto", max_steps: int = 32,
                 memory_interval: float = 0.25, prefetch: bool = True, keep_initial: bool = False,
                 overlap_fork: bool = False, core: RolloutCore | None = None) -> None:
        self.policy = policy
        self.core = core or build_core(CoreConfig(memory=memory, prefetch=prefetch, keep_initial=keep_initial,
                                                  overlap_fork=overlap_fork),
                                       cache=cache, speculator=speculator, guard=guard, tail=tail)
        self.max_steps = max_steps
        self.memory_interval = memory_interval
        self._persisting: Future[float] | None = None
        # Whether the last run_epoch started while the previous epoch's persistence still ran
        # (the cache serves from memory meanwhile; a state not yet on disk is pinned there).
        self.persist_running_at_start = False

    @property
    def cache(self) -> ToolPrefixCache | None:
        return self.core.cache

    @property
    def speculator(self) -> Speculator | None:
        return self.core.speculator

    @property
    def guard(self) -> DeterminismGuard:
        return self.core.guard

    @property
    def tail(self) -> TailPolicy:
        return self.core.tail

    @property
    def history(self) -> list[Trajectory]:
        return self.core.history

    async def run_epoch(self, tasks: Sequence[Task], group_size: int, epoch: int = 0) -> EpochResult:
        """Roll out `group_size` samples of every task; returns once all have finished and their
        workspaces are torn down (teardown_seconds). The epoch (EpochResult.seconds) ends when
        the last rollout finishes, as in the paper. The cache's persistence starts then and runs
        in the gap between epochs (the trainer's update): persistence() reports it."""
        self.persist_running_at_start = self.persisting
        t0 = time.monotonic()
        cache = self.core.cache
        extra = (lambda: cache.lru.resident_bytes) if cache is not None else (lambda: 0)
        budget = self.core.budget
        sampler = MemorySampler(self.core.all_workspaces, extra, self.memory_interval,
                                observe=budget.observe if budget is not None else None)
        sampler.start(t0)
        try:
            groups = await asyncio.gather(*(self._run_group(t, group_size, epoch, t0) for t in tasks))
        finally:
            t_last = time.monotonic()
            await self.core.drain_rollouts()
            teardown = time.monotonic() - t_last
            memory = await sampler.stop()
            self._persisting = self.core.start_persistence()
        samples = [r for g in groups for r in g]
        for r in samples:
            r.timeline.wasted_seconds = r.wasted_seconds
        stats = self.core.stats()
        return EpochResult(epoch, max((r.timeline.finished for r in samples), default=0.0),
                           [r.timeline for r in samples], memory, **stats, teardown_seconds=teardown)

    @property
    def persisting(self) -> bool:
        """Whether the persistence the last epoch started is still running."""
        return self._persisting is not None and not self._persisting.done()

    async def persistence(self) -> float:
        """Wait for the persistence the last epoch started; the seconds it took (0 without one)."""
        fut = self._persisting
        if fut is None:
            return 0.0
        return await asyncio.wrap_future(fut)

    async def close(self) -> None:
        """Release what the engine keeps between epochs (keep_initial's snapshots)."""
        await self.persistence()
        await self.core.close()

    def fit_selector(self, held_out_epochs: Sequence[int] = ()) -> SelectorReport | None:
        """Train the speculator's selector on every recorded trajectory (between epochs)."""
        return self.core.fit_selector(held_out_epochs)

    async def _run_group(self, task: Task, group_size: int, epoch: int, t0: float) -> list[Rollout]:
        ctxs = [SampleContext(task.id, i, epoch, task.prompt) for i in range(group_size)]
        rollouts = await self.core.start_group(task, ctxs, origin=t0)
        await asyncio.gather(*(self._run_sample(r) for r in rollouts))
        return rollouts

    async def _run_sample(self, r: Rollout) -> None:
        try:
            await AgentLoop(self.policy, self.max_steps).run(r)
        except Exception as e:
            r.timeline.errors.append(f"{type(e).__name__}: {e}")
        finally:
            await r.close()
