"""What a sample's rollout uses of its driver's core: the prefix cache, the speculator, the
determinism guard, the tail policy, the reasoning clock, the memory engine, the workspaces alive
right now and background work (RolloutCore adds starting samples and the finished record)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from bunshinfork import AsyncWorkspace, Workspace

from ..calls.guard import DeterminismGuard
from ..calls.signature import ToolCall
from ..calls.tools import Tool
from ..prefix.cache import ToolPrefixCache
from ..prefix.tree import Node
from ..speculation.gate import GateCosts
from ..speculation.speculator import Speculator
from ..speculation.tail import TailPolicy
from ..states.metrics import WorkspaceRegistry
from .reasoning import ReasoningClock
from .warm_policy import WarmPolicy, check_warm_policy, keep_warm


class SampleServices:
    """The services every Rollout is given (see RolloutCore for the arguments)."""

    def __init__(self, *, cache: ToolPrefixCache | None = None, speculator: Speculator | None = None,
                 guard: DeterminismGuard | None = None, tail: TailPolicy | None = None, memory: str = "auto",
                 prefetch: bool = True, keep_initial: bool = False, overlap_fork: bool = False,
                 reasoning: ReasoningClock | None = None, critical_path_captures: bool = True,
                 verify_seconds: float | None = 300.0, warm: WarmPolicy = "predicted") -> None:
        self.cache = cache
        # Behind which hits a warm workspace is kept (bunshinrl.rollout.warm_policy), and how often
        # it was and was not (warm_stats: kept, skipped).
        self.warm = check_warm_policy(warm)
        self.warm_stats = {"kept": 0, "skipped": 0}
        # How long a finishing sample waits for the replay behind its last cache hit (None: no
        # limit) before its state is rebuilt and verified from the cache instead.
        self.verify_seconds = verify_seconds
        self.reasoning = reasoning or ReasoningClock()
        # False: the cache's policy alone decides a capture, whatever the reasoning step or the
        # revisits expected (the Ray hosts: replication ships the states captured).
        self.critical_path_captures = critical_path_captures
        self.speculator = speculator
        self.guard = guard or (cache.guard if cache is not None else None) or DeterminismGuard()
        if cache is not None and cache.guard is not self.guard:
            raise ValueError("the cache and the core must share one DeterminismGuard")
        if speculator is not None:
            speculator.guard = self.guard
            if tail is None:
                tail = speculator.tail
            speculator.tail = tail
        self.tail = tail or TailPolicy()
        self.memory = memory
        self.prefetch = prefetch
        # Without a cache: keep_initial keeps each task's initialized snapshot from one group to
        # the next (as the cache keeps its root) until close(); overlap_fork starts a group's fork
        # and returns its rollouts at once, so the fork runs while the first step is reasoned (as
        # the cache's prefetch of a fresh root does).
        self.keep_initial = keep_initial
        self.overlap_fork = overlap_fork
        self.workspaces = WorkspaceRegistry()
        self._lock = threading.Lock()
        self._bg: set[asyncio.Future[Any]] = set()
        self._snapshot_s: dict[str, float] = {}  # per task: a snapshot's measured seconds (EWMA)
        self._miss_s: dict[str, float] = {}  # per task: a spec_miss span's measured seconds (EWMA)

    def all_workspaces(self) -> list[Workspace]:
        """Every workspace the core holds now, speculative forks included (memory sampling)."""
        return self.workspaces.snapshot() + (self.speculator.workspaces.snapshot() if self.speculator else [])

    def note_snapshot(self, task_id: str, seconds: float) -> None:
        """How long a snapshot of one of the task's workspaces took (a capture or speculation's)."""
        with self._lock:
            old = self._snapshot_s.get(task_id, seconds)
            self._snapshot_s[task_id] = 0.7 * old + 0.3 * seconds

    def snapshot_estimate(self, task_id: str) -> float | None:
        with self._lock:
            return self._snapshot_s.get(task_id)

    def worth_a_snapshot(self, task_id: str) -> bool:
        """Whether a snapshot started now is predicted to finish within the reasoning step: a
        speculative chain that needs one is not started otherwise (it would be waited for).
        Only with a model of the server (ReasoningClock(model=...)): the steps seen are a low
        quantile, meant for captures, and would stop most speculation on short steps."""
        if self.reasoning.model is None:
            return True
        predicted, snap = self.reasoning.predict(), self.snapshot_estimate(task_id)
        ok = predicted is None or snap is None or snap <= predicted
        if not ok and self.speculator is not None:
            self.speculator.stats["declined_off_path"] = self.speculator.stats.get("declined_off_path", 0) + 1
        return ok

    def note_spec_miss(self, task_id: str, seconds: float) -> None:
        """How long a wrong guess held a sample of the task (its spec_miss span: the rollback)."""
        with self._lock:
            old = self._miss_s.get(task_id, seconds)
            self._miss_s[task_id] = 0.7 * old + 0.3 * seconds

    def speculation_chain(self, task_id: str, sample: int, calls: Sequence[ToolCall], tools: Mapping[str, Tool],
                          real_calls: int) -> list[ToolCall]:
        """The chain to speculate after `calls` (empty: none). With the speculator's measured gate
        the snapshot is one of the costs it weighs; without, a chain whose snapshot is predicted
        to outlast the reasoning step is not started (worth_a_snapshot)."""
        spec = self.speculator
        if spec is None:
            return []
        with self._lock:
            miss = self._miss_s.get(task_id)
        costs = GateCosts(reasoning=self.reasoning.predict(), snapshot=self.snapshot_estimate(task_id), miss=miss)
        chain = spec.predict(task_id, sample, calls, tools, real_calls=real_calls, costs=costs)
        if chain and spec.gate is None and not self.worth_a_snapshot(task_id):
            return []
        return chain

    def keep_warm(self, node: Node, task_id: str, calls: Sequence[ToolCall]) -> bool:
        """Whether the sample a hit moved to `node` keeps a warm workspace (warm_policy)."""
        selector = self.speculator.selector if self.speculator is not None else None
        keep = keep_warm(self.warm, node, task_id, calls, selector)
        with self._lock:
            self.warm_stats["kept" if keep else "skipped"] += 1
        return keep

    # ---- background work ----

    def background(self, aw: Any) -> asyncio.Future[Any]:
        """Run `aw` beside the rollouts; drain_rollouts() waits for it."""
        fut = asyncio.ensure_future(aw)
        self._bg.add(fut)
        fut.add_done_callback(self._bg.discard)
        return fut

    async def destroy(self, ws: Workspace) -> None:
        """Destroy a workspace the core holds (and forget it in the memory sampling)."""
        self.workspaces.discard(ws)
        await AsyncWorkspace(ws).destroy()

    async def drain_rollouts(self) -> None:
        """Wait for the rollouts' background work (captures, teardowns, discarded branches), not
        for the cache's persistence."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)
        if self.speculator is not None:
            await self.speculator.drain()

