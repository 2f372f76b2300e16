"""ClusterEngine: RolloutEngine's epoch over a RayWorkspacePool, with prefix-affinity routing.

The policy runs here, in the driver; each sample's Rollout (bunshinrl.rollout.core) runs on the host
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
A hot prefix on a busy host can be replicated (replicate_above): the group's known trajectories
as that host holds them are grafted onto the least loaded host holding less of them, with the
snapshot of the deepest state the busy host retains on the group's hot prefix (where its
trajectories branch: what a sample whose next call is new forks), and the task's root state if
the cold host has none: Snapshot.save there, Snapshot.load on the cold host, through Ray's
object store or a shared directory (RayWorkspacePool.replication). The cold host's cache then
serves those calls as the busy host's would.

Whatever each host's core runs (pool.core: Base, the cache, Spec or Full), it runs there as it
would on a single host: speculative branches fork, are adopted and roll back in the host
actor, beside the workspace they branch from. fit_selector() trains the next-call selector on
every trajectory of the pool, as RolloutEngine.fit_selector does on one host's, and gives it,
with every host's tool timings (the tail policy's), to every host.

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

from ..calls.policy import Policy, SampleContext, Step
from ..calls.signature import ToolCall
from ..calls.task import Task
from ..rollout.agent_loop import AgentLoop
from ..rollout.sample_state import Rewound
from ..rollout.timeline import EpochResult, SampleTimeline
from ..speculation.selector import SelectorReport, Trajectory, train_selector
from .pool import RayWorkspacePool
from .session import RemoteSession


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
    # Per replication, the depth of the hot prefix's state that travelled (-1: only steps did):
    # the deepest state the source host held on that prefix when it was asked, so it depends on
    # which captures had finished there.
    moved_depths: list[int] = field(default_factory=list)


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
        self.history: list[Trajectory] = []  # every finished trajectory: the selector's training data
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
            colder = [h for h in live if h != best and key(h)[:2] < key(best)[:2]]
            if colder:
                target = min(colder, key=lambda h: self._load.get(h, 0))
                held = list(dict.fromkeys(tuple(p)[:d] for p, d in zip(prefixes, depths[best], strict=False)
                                          if d > 0))
                try:
                    await self.replicate(task, best, target, [hot_prefix(held), *held])
                    return Placement(target, "replicated")
                except ray.exceptions.RayActorError:
                    pass  # one of the two died: the group goes where it would have (or the next lookup sees)
        return Placement(best, reason)

    async def replicate(self, task: Task, src: str, dst: str, prefixes: Sequence[Sequence[ToolCall]] = ()) -> int:
        """Make host dst hold what host src holds of the task: its root state if dst has none,
        and the given prefixes (the first is the hot one: the snapshot of the deepest state src
        retains on it travels). Returns the bytes moved."""
        await self._register([task])
        shared_dir = self.pool.replication.shared_dir
        paths = [list(p) for p in prefixes]
        moved = 0
        if await self._remote(dst, "lookup", task.id, []) < 0:
            root = await self._remote(src, "export_prefix", task.id, [], shared_dir)
            if root["saved"] is None:
                raise LookupError(f"host {src} holds no resident root state of {task.id}")
            await self._remote(dst, "graft", task.id, [], root)
            moved += _size(root["saved"])
        if any(paths):
            exported = await self._remote(src, "export_prefix", task.id, paths, shared_dir, False)
            await self._remote(dst, "graft", task.id, paths, exported)
            moved += _size(exported["saved"])
            self.stats.moved_depths.append(exported["at"])
        self.stats.replicated += 1
        self.stats.bytes_moved += moved
        return moved

    # ---- an epoch ----

    async def run_epoch(self, tasks: Sequence[Task], group_size: int, epoch: int = 0) -> EpochResult:
        """Every group of the epoch, each on the host placement picks; returns once all have
        finished and every host has drained its background work (captures, speculative
        teardowns). cache and speculation: the hosts' counters, summed."""
        t0 = time.monotonic()
        await self._register(tasks)
        groups = await asyncio.gather(*(self._run_group(t, group_size, epoch) for t in tasks))
        samples = [s for g in groups for s in g]
        seconds = time.monotonic() - t0
        result = EpochResult(epoch, seconds, samples, [])
        self.history += result.trajectories()
        stats = await asyncio.gather(*(self._drained_stats(h) for h in self.pool.hosts))
        for part in ("cache", "speculation"):
            shards = [s[part] for s in stats if s is not None and s.get(part) is not None]
            setattr(result, part, _sum(shards) if shards else None)
        return result

    async def _drained_stats(self, host: str) -> dict[str, Any] | None:
        import ray

        try:
            await self._remote(host, "drain")
            return await self._remote(host, "stats")
        except ray.exceptions.RayActorError:
            self.pool.mark_dead(host)
            return None

    def fit_selector(self, held_out_epochs: Sequence[int] = ()) -> SelectorReport | None:
        """Train the speculator's selector on every trajectory the pool has run (between
        epochs), as RolloutEngine.fit_selector does on one host's, and give it to every host
        with the other hosts' tool timings. None without any trajectory yet."""
        import ray

        timings = {}
        for h in self.pool.hosts:
            try:
                timings[h] = ray.get(self.pool.actor(h).take_timings.remote(), timeout=self.pool.start_timeout)
            except ray.exceptions.RayActorError:
                self.pool.mark_dead(h)
        sel, report = None, None
        if self.history:
            sel, report = train_selector(sorted(self.history, key=lambda t: (t.epoch, t.task_id, t.sample)),
                                         held_out_epochs=held_out_epochs)
        for h in timings:
            others = [e for g, t in timings.items() if g != h for e in t]
            try:
                ray.get(self.pool.actor(h).learn.remote(sel, others), timeout=self.pool.start_timeout)
            except ray.exceptions.RayActorError:
                self.pool.mark_dead(h)
        return report

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
        """The agent loop (the same as RolloutEngine's) over the sample's rollout on `host`."""
        import ray

        def host_died(h: str, e: BaseException) -> bool:
            if not isinstance(e, ray.exceptions.RayActorError):
                return False
            self.pool.mark_dead(h)
            self._load[h] -= 1
            self.stats.restarts += 1
            return True

        s = RemoteSession(ctx, host, rid, self._remote, lambda history: self._restart(task, ctx, history), host_died)
        loop = AgentLoop(self.policy, self.max_steps)
        try:
            await s.open()
            while True:
                await loop.run(s)
                try:
                    timeline, _served = await s.close()
                    break
                except Rewound:
                    continue  # the host died at the close and its restart did not reproduce a step
        finally:
            self.stats.steps += s.steps
        self._load[s.host] -= 1
        self._known[(task.id, ctx.sample)] = [st.call for st in timeline.steps]
        return timeline

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


def hot_prefix(prefixes: Sequence[Sequence[ToolCall]]) -> tuple[ToolCall, ...]:
    """The longest prefix two of `prefixes` share: where the group's trajectories branch, the
    state a sample whose next call is new there forks. With a single prefix, that one."""
    if len(prefixes) == 1:
        return tuple(prefixes[0])
    best: tuple[ToolCall, ...] = ()
    for i, a in enumerate(prefixes):
        for b in prefixes[i + 1:]:
            n = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            if n > len(best):
                best = tuple(a[:n])
    return best


def _size(saved: bytes | str | None) -> int:
    """Bytes of a saved snapshot as it travelled: a tar through the object store, or a directory."""
    if saved is None:
        return 0
    if isinstance(saved, bytes):
        return len(saved)
    from bunshinfork.hosts import tree_bytes

    return tree_bytes(saved)


def _sum(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The hosts' counters as one pool's: numbers summed, lists joined (each item once)."""
    out: dict[str, Any] = {}
    for shard in shards:
        for k, v in shard.items():
            if isinstance(v, bool) or not isinstance(v, int | float | list):
                out.setdefault(k, v)
            elif isinstance(v, list):
                seen = out.setdefault(k, [])
                seen += [x for x in v if x not in seen]
            else:
                out[k] = out.get(k, 0) + v
    return out
