"""Starting samples: a group's forks of one initialized workspace (Base), or every sample on the
prefix cache's root state; the template digest and the initialized snapshots, made once however
many samples ask at the same time."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bunshinfork import AsyncWorkspace, Workspace, rootfs_digest

from .._async import call_sync_or_async, run_blocking
from ..calls.policy import SampleContext
from ..calls.signature import template_digest
from ..calls.task import Task
from ..prefix.tree import Node
from ..speculation.selector import Trajectory
from ..states.backend import SharedSnapshot
from .sample import Rollout
from .sample_state import Live
from .services import SampleServices
from .timeline import SampleTimeline


@dataclass
class _Group:
    """Base (no cache): the samples of a group fork one snapshot of the task's initialized workspace."""

    snapshot: Future[SharedSnapshot] = field(default_factory=Future)
    members: int = 0


class Starts(SampleServices):
    """Starting rollouts (RolloutCore's half that makes them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._initial: dict[tuple[str, str], Future[SharedSnapshot]] = {}
        self._digests: dict[str, Future[str]] = {}
        self._groups: dict[tuple[str, str], _Group] = {}
        self.history: list[Trajectory] = []  # every finished trajectory (the selector's training data)
        self._counters = {"rollouts": 0, "forks": 0}

    async def digest(self, task: Task) -> str:
        """The template digest of the task's initialized workspace (rootfs digest + fingerprint)."""
        rootfs = str(task.spec.get("rootfs", "host"))
        digest = await self._once(self._digests, rootfs, lambda: run_blocking(rootfs_digest, rootfs))
        return template_digest(digest, task.fingerprint)

    async def _once(self, table: dict[Any, Future[Any]], key: Any, make: Callable[[], Awaitable[Any]]) -> Any:
        """table[key]'s value, made by the first caller however many ask at the same time (a
        failure is not kept: the next caller tries again)."""
        with self._lock:
            fut = table.get(key)
            mine = fut is None
            if mine:
                fut = table[key] = Future()
        assert fut is not None
        if mine:
            try:
                fut.set_result(await make())
            except BaseException as e:
                with self._lock:
                    table.pop(key, None)
                fut.set_exception(e)
        return await asyncio.wrap_future(fut)

    async def _initial_snapshot(self, task: Task) -> SharedSnapshot:
        ws = self.workspaces.add((await AsyncWorkspace.create(**task.spec)).workspace)
        try:
            await call_sync_or_async(task.setup, ws)
            return await SharedSnapshot.take_async(ws, self.memory)
        finally:
            await self.destroy(ws)

    async def _group_snapshot(self, task: Task) -> SharedSnapshot:
        """A reference to the snapshot a group forks: the kept one (keep_initial), made once
        however many groups ask at the same time, or a fresh one. The caller releases it."""
        if not self.keep_initial:
            return await self._initial_snapshot(task)
        key = (task.id, await self.digest(task))
        snap: SharedSnapshot = await self._once(self._initial, key, lambda: self._initial_snapshot(task))
        return snap.acquire()

    def kept_snapshots(self) -> list[SharedSnapshot]:
        """The initialized snapshots keep_initial holds now."""
        with self._lock:
            futs = list(self._initial.values())
        return [f.result() for f in futs if f.done() and f.exception() is None]

    async def _fork_group(self, task: Task, n: int) -> list[Workspace]:
        snap = await self._group_snapshot(task)
        try:
            clones = await snap.fork_many_async(n)
        finally:
            await snap.release_async()
        if any(isinstance(c, Exception) for c in clones):
            for c in clones:
                if isinstance(c, Workspace):
                    await AsyncWorkspace(c).destroy()
            raise next(c for c in clones if isinstance(c, Exception))
        return [self.workspaces.add(w) for w in clones]  # type: ignore[arg-type]

    async def root(self, task: Task) -> Node:
        """The cache's root for the task's initialized workspace, made once however many samples
        ask at the same time."""
        assert self.cache is not None
        return await self.cache.ensure_root(task.id, await self.digest(task), lambda: self._initial_snapshot(task))

    def _timeline(self, ctx: SampleContext, origin: float) -> SampleTimeline:
        return SampleTimeline(ctx.task_id, ctx.sample, ctx.epoch, started=time.monotonic() - origin)

    async def start_group(self, task: Task, contexts: Sequence[SampleContext],
                          origin: float | None = None) -> list[Rollout]:
        """The rollouts of one GRPO group, all from one initialized workspace: with a cache they
        stand on its root state and fork only at their first miss; without, they are forked from
        one snapshot of it, all at once."""
        origin = time.monotonic() if origin is None else origin
        timelines = [self._timeline(c, origin) for c in contexts]
        t0 = time.monotonic() - origin
        if self.cache is not None:
            root = await self.root(task)
            out = [Rollout(self, task, c, tl, origin, root, None, on_close=self._closed)
                   for c, tl in zip(contexts, timelines, strict=True)]
        elif self.overlap_fork:
            forking = asyncio.ensure_future(self._fork_group(task, len(contexts)))

            async def clone(i: int) -> Workspace:
                return (await forking)[i]

            out = [Rollout(self, task, c, tl, origin, None, None, forking=clone(i), on_close=self._closed)
                   for i, (c, tl) in enumerate(zip(contexts, timelines, strict=True))]
        else:
            clones = await self._fork_group(task, len(contexts))
            out = [Rollout(self, task, c, tl, origin, None, w, on_close=self._closed)
                   for c, tl, w in zip(contexts, timelines, clones, strict=True)]
        for r in out:
            if isinstance(r.state, Live):
                await r.note_fork(r.state.ws)
            r.timeline.add("setup", t0, r.now())
        return out

    async def start(self, task: Task, ctx: SampleContext, *, group: str | None = None,
                    origin: float | None = None, rewinds: bool = False) -> Rollout:
        """One sample's rollout, for drivers that see samples one by one (verl, SkyRL). Samples
        started with the same `group` key (verl's uid) while another member is still open fork
        one snapshot of the task's initialized workspace; with a cache every sample of the task
        stands on the cache's root state. rewinds: whether the driver acts again on a history cut
        back by Rewound (see Rollout.rewinds)."""
        origin = time.monotonic() if origin is None else origin
        tl = self._timeline(ctx, origin)
        t0 = time.monotonic() - origin
        if self.cache is not None:
            r = Rollout(self, task, ctx, tl, origin, await self.root(task), None, on_close=self._closed)
        else:
            key = (task.id, group if group is not None else f"{ctx.epoch}/{ctx.task_id}/{ctx.sample}")
            with self._lock:
                g = self._groups.get(key)
                mine = g is None
                if g is None:
                    g = self._groups[key] = _Group()
                g.members += 1
            try:
                if mine:
                    try:
                        g.snapshot.set_result(await self._initial_snapshot(task))
                    except BaseException as e:
                        g.snapshot.set_exception(e)
                snap = await asyncio.wrap_future(g.snapshot)
                ws = self.workspaces.add(await snap.fork_async())
            except BaseException:
                self._leave(key)
                raise
            r = Rollout(self, task, ctx, tl, origin, None, ws, on_close=functools.partial(self._closed, group=key))
            await r.note_fork(ws)
        r.timeline.add("setup", t0, r.now())
        r.rewinds = rewinds
        return r

    def _leave(self, key: tuple[str, str]) -> None:
        with self._lock:
            g = self._groups.get(key)
            if g is None:
                return
            g.members -= 1
            if g.members > 0:
                return
            del self._groups[key]
        if g.snapshot.done() and g.snapshot.exception() is None:
            self.background(g.snapshot.result().release_async())

    def _closed(self, r: Rollout, group: tuple[str, str] | None = None) -> None:
        """A rollout closed: it leaves its group, and its trajectory is recorded."""
        if group is not None:
            self._leave(group)
        tl = r.timeline
        with self._lock:
            self.history.append(Trajectory(tl.epoch, tl.task_id, tl.sample, tuple(s.call for s in tl.steps),
                                           tl.answer is not None))
            self._counters["rollouts"] += 1
        self.tail.record_rollout(tl.task_id, tl.sample, tl.finished - tl.started)
