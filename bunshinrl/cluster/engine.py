"""ClusterEngine: RolloutEngine's epoch over a RayWorkspacePool, with prefix-affinity routing.

The policy runs here, in the driver; each sample's Rollout (bunshinrl.core) runs on the host
it was placed on and is stepped remotely, one tool call at a time, exactly as RolloutEngine
steps a local one: the same core serves each call from that host's shard of the prefix cache
or runs it there. So trajectories, observations and rewards are those of a single host.

Placement of a GRPO group (its samples share one host, as they share one initialized
workspace's memory):
  1. affinity: the host whose shard holds the deepest cached prefix of the group's known
     trajectories (the calls its samples made last epoch);
  2. then a host holding the task's root state (the group's snapshot);
  3. then the least loaded host.
routing="random" picks a host at random instead (the benchmark's baseline).
A hot root on a busy host can be replicated (replicate_above): its snapshot is saved there and
loaded on the least loaded host without it (Snapshot.save / load, through Ray's object store
or a shared directory: RayWorkspacePool.replication).

A host that dies mid-epoch loses its workspaces, not its samples: each of them restarts on
another live host from the deepest prefix of its steps that host holds (the others run again
there), and the epoch completes with every sample.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..policy import FinalAnswer, Policy, SampleContext, Step, calls_of
from ..signature import ToolCall
from ..task import Task
from ..timeline import EpochResult, SampleTimeline
from .pool import RayWorkspacePool


@dataclass
class Placement:
    host: str
    reason: str  # "prefix", "snapshot", "least-loaded", "random", "replicated", "restart"


@dataclass
class ClusterStats:
    placements: list[tuple[str, str, str]] = field(default_factory=list)  # (task, host, reason)
    steps: int = 0
    restarts: int = 0
    replicated: int = 0
    bytes_moved: int = 0


class ClusterEngine:
    def __init__(self, policy: Policy, pool: RayWorkspacePool, *, routing: str = "affinity", seed: int = 0,
                 max_steps: int = 32, replicate_above: int | None = None) -> None:
        if routing not in ("affinity", "random"):
            raise ValueError(f"routing must be 'affinity' or 'random', not {routing!r}")
        self.policy = policy
        self.pool = pool
        self.routing = routing
        self.rng = random.Random(seed)
        self.max_steps = max_steps
        self.replicate_above = replicate_above
        self.stats = ClusterStats()
        self._known: dict[tuple[str, int], list[ToolCall]] = {}  # (task, sample) -> last trajectory's calls
        self._registered: set[tuple[str, str]] = set()
        self._load: dict[str, int] = {}

    # ---- placement ----

    async def _register(self, tasks: Sequence[Task]) -> None:
        for h in self.pool.hosts:
            todo = [t for t in tasks if (h, t.id) not in self._registered]
            if todo:
                await self._remote(h, "register", todo)
                self._registered |= {(h, t.id) for t in todo}

    async def _remote(self, host: str, method: str, *args: Any) -> Any:
        return await getattr(self.pool.actor(host), method).remote(*args)

    async def place(self, task: Task, prefixes: Sequence[Sequence[ToolCall]]) -> Placement:
        """Where a group (or a restarting sample) with these known prefixes goes."""
        import ray

        hosts = self.pool.hosts
        if not hosts:
            raise RuntimeError("every host of the pool is dead")
        if self.routing == "random":
            return Placement(self.rng.choice(hosts), "random")
        await self._register([task])
        depths: dict[str, list[int]] = {}
        for h in hosts:
            try:
                depths[h] = list(await asyncio.gather(*(self._remote(h, "lookup", task.id, list(p))
                                                        for p in (prefixes or [()]))))
            except ray.exceptions.RayActorError:
                self.pool.mark_dead(h)
        live = [h for h in hosts if h in depths]
        if not live:
            raise RuntimeError("every host of the pool is dead")

        def key(h: str) -> tuple[int, int, int]:
            d = depths[h]
            return (sum(max(x, 0) for x in d), max(d) >= 0, -self._load.get(h, 0))

        best = max(live, key=key)
        deep, has_root, _ = key(best)
        reason = "prefix" if deep > 0 else "snapshot" if has_root else "least-loaded"
        if has_root and self.replicate_above is not None and self._load.get(best, 0) >= self.replicate_above:
            cold = [h for h in live if max(depths[h]) < 0]
            if cold:
                target = min(cold, key=lambda h: self._load.get(h, 0))
                await self.replicate(task, best, target)
                return Placement(target, "replicated")
        return Placement(best, reason)

    async def replicate(self, task: Task, src: str, dst: str) -> int:
        """Copy the task's root state from host src to host dst; returns the bytes moved."""
        await self._register([task])
        snap_id = await self._remote(src, "root_snapshot", task.id)
        if snap_id is None:
            raise LookupError(f"host {src} holds no resident root state of {task.id}")
        saved = await self._remote(src, "export_snapshot", snap_id, self.pool.replication.shared_dir)
        new_id = await self._remote(dst, "import_snapshot", saved)
        await self._remote(dst, "adopt_root", task.id, new_id)
        moved = len(saved) if isinstance(saved, bytes) else 0
        if not isinstance(saved, bytes):
            from bunshinfork.state import tree_bytes

            moved = tree_bytes(saved)
        self.stats.replicated += 1
        self.stats.bytes_moved += moved
        return moved

    # ---- an epoch ----

    async def run_epoch(self, tasks: Sequence[Task], group_size: int, epoch: int = 0) -> EpochResult:
        t0 = time.monotonic()
        await self._register(tasks)
        groups = await asyncio.gather(*(self._run_group(t, group_size, epoch) for t in tasks))
        samples = [s for g in groups for s in g]
        return EpochResult(epoch, time.monotonic() - t0, samples, [])

    async def _run_group(self, task: Task, group_size: int, epoch: int) -> list[SampleTimeline]:
        import ray

        ctxs = [SampleContext(task.id, i, epoch, task.prompt) for i in range(group_size)]
        known = [self._known[(task.id, i)] for i in range(group_size) if (task.id, i) in self._known]
        while True:
            p = await self.place(task, known)
            self._load[p.host] = self._load.get(p.host, 0) + group_size
            try:
                rids = await self._remote(p.host, "start_group", task.id, ctxs)
                break
            except ray.exceptions.RayActorError:
                self._load[p.host] -= group_size
                self.pool.mark_dead(p.host)
        self.stats.placements.append((task.id, p.host, p.reason))
        return list(await asyncio.gather(*(self._run_sample(task, c, p.host, r) for c, r in zip(ctxs, rids,
                                                                                                 strict=True))))

    async def _run_sample(self, task: Task, ctx: SampleContext, host: str, rid: str) -> SampleTimeline:
        import ray

        history: list[Step] = []
        answer: str | None = None
        done = False
        while True:
            try:
                if not done:
                    answer = await self._steps(ctx, host, rid, history)
                    done = True
                await self._remote(host, "finish", rid, answer)
                timeline, _served = await self._remote(host, "close", rid)
                self._load[host] -= 1
                self._known[(task.id, ctx.sample)] = [s.call for s in timeline.steps]
                return timeline
            except ray.exceptions.RayActorError:
                self.pool.mark_dead(host)
                self._load[host] -= 1
                self.stats.restarts += 1
                host, rid = await self._restart(task, ctx, history)

    async def _steps(self, ctx: SampleContext, host: str, rid: str, history: list[Step]) -> str | None:
        """Ask the policy and run its calls on the host until it answers or a budget is spent;
        `history` grows as steps complete, so a restart knows where the sample was."""
        calls_left = await self._remote(host, "calls_left", rid)
        for _ in range(self.max_steps):
            if calls_left == 0:
                break
            action = await self.policy.act(ctx, list(history))
            if isinstance(action, FinalAnswer):
                return action.text
            decision = len(history)
            for c in calls_of(action)[:calls_left]:
                step, calls_left = await self._remote(host, "call", rid, c, decision)
                history.append(step)
                self.stats.steps += 1
        return None

    async def _restart(self, task: Task, ctx: SampleContext, history: list[Step]) -> tuple[str, str]:
        import ray

        while True:
            p = await self.place(task, [[s.call for s in history]])
            try:
                rid, steps = await self._remote(p.host, "start", task.id, ctx, list(history))
            except ray.exceptions.RayActorError:
                self.pool.mark_dead(p.host)
                continue
            self._load[p.host] = self._load.get(p.host, 0) + 1
            history[:] = steps
            return p.host, rid
