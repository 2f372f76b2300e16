"""Rebuilding a cached state: the cheapest recorded plan (fork a resident state, or restore one
from disk, then replay the calls below it), and replays that compare what they observe with
what was recorded (ReplayDiverged). A ToolPrefixCache mixin."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bunshinfork import AsyncWorkspace, Workspace

from .._async import call_sync_or_async, run_blocking
from ..calls.tools import Tool
from .tree import Node


class ReplayDiverged(RuntimeError):
    """Replaying a recorded call observed something else: the tool is not deterministic. The
    workspace is attached, in the state after the fresh call (`node`'s call, which observed
    `fresh` where `node` recorded something else): the caller destroys it, or keeps it for a
    history whose last step is that fresh observation, never for the recorded one."""

    def __init__(self, message: str, workspace: Workspace, node: Node | None = None, fresh: str | None = None,
                 index: int = 0) -> None:
        super().__init__(message)
        self.index = index  # the diverging call's position among the calls replayed (0: the first)
        self.workspace = workspace
        self.node = node
        self.fresh = fresh


@dataclass(frozen=True)
class Plan:
    """How to rebuild a node's state: fork `source` (loading it from disk first if `load`),
    then replay the calls of `replay` in order."""

    source: Node
    load: bool
    replay: tuple[Node, ...]
    seconds: float  # estimated

    def describe(self) -> str:
        """Where it forks from (memory or disk, at which depth) and the calls it replays."""
        calls = ",".join(n.call.name for n in self.replay if n.call is not None) or "nothing"
        return f"rebuilt from {'disk' if self.load else 'memory'} at depth {self.source.depth}, replaying {calls}"


def ewma(old: float, new: float, weight: float = 0.3) -> float:
    """An exponentially weighted moving average's next value."""
    return (1 - weight) * old + weight * new


class Reconstruction:
    """ToolPrefixCache's rebuilding of node states (see the module doc)."""

    def _load_estimate(self, node: Node) -> float:
        return 0.02 + node.load_bytes * self.load_seconds_per_byte

    def rebuild_seconds(self, node: Node) -> float:
        """What a new workspace in `node`'s state is predicted to take: its plan and a fork
        (infinite without a retained ancestor)."""
        try:
            return self.plan(node).seconds + self.fork_seconds
        except LookupError:
            return float("inf")

    def replay_seconds(self, node: Node) -> float:
        """What rebuilding `node` by replay would take were it not captured: its call and those of
        its uncaptured ancestors, back to the nearest captured one."""
        with self._lock:
            total = node.exec_seconds
            a = node.parent
            while a is not None and a.sparse:
                total += a.exec_seconds
                a = a.parent
            return total

    def plan(self, node: Node) -> Plan:
        """The cheapest recorded way to rebuild `node`: fork a resident state, or restore one from
        disk, then replay the calls below it; replay wins over a disk restore when it is faster."""
        with self._lock:
            replay: list[Node] = []
            best: Plan | None = None
            cur: Node | None = node
            replay_s = 0.0
            while cur is not None:
                if cur.resident or (cur.capturing is not None and not cur.capturing.done()):
                    cand = Plan(cur, False, tuple(reversed(replay)), replay_s)
                    return cand if best is None or cand.seconds <= best.seconds else best
                if cur.disk_ref is not None:
                    cand = Plan(cur, True, tuple(reversed(replay)), replay_s + self._load_estimate(cur))
                    if best is None or cand.seconds < best.seconds:
                        best = cand
                replay.append(cur)
                replay_s += cur.exec_seconds
                cur = cur.parent
            if best is None:
                raise LookupError(f"{node} has no retained ancestor to rebuild it from")
            return best

    async def materialize(self, node: Node, tools: Mapping[str, Tool], warm: Workspace | None = None,
                          on_plan: Callable[[Plan], None] | None = None) -> Workspace:
        """A new running workspace in `node`'s state (the caller destroys it): forked by the
        cheapest plan, every replayed call compared with what it recorded (ReplayDiverged).
        warm: a workspace in the parent's state instead, brought to `node`'s by replaying its call
        (replay()); it is returned. on_plan: told the plan taken, before it runs."""
        if warm is not None:
            await self._replay(warm, node, tools)
            return warm
        if not node.done:
            raise ValueError(f"{node} has no recorded observation yet")
        while True:
            plan = self.plan(node)
            cap = plan.source.capturing
            if not plan.source.resident and not plan.load and cap is not None and not cap.done():
                await asyncio.wrap_future(cap)  # its snapshot is being taken right now
                continue
            with self._lock:
                # Pinned before the lock is let go, so eviction cannot release it under the fork.
                ok = plan.source.resident if not plan.load else plan.source.disk_ref is not None
                if ok and not plan.load:
                    plan.source.pins += 1
            if ok:
                break
        if on_plan is not None:
            on_plan(plan)
        ws = await self._fork_source(plan)
        try:
            for i, step in enumerate(plan.replay):
                await self._replay(ws, step, tools, i)
        except ReplayDiverged:
            raise
        except BaseException:
            await AsyncWorkspace(ws).destroy()
            raise
        with self._lock:
            self.lru.touch(node)
        return ws

    async def _fork_source(self, plan: Plan) -> Workspace:
        src = plan.source
        temp = None
        victims: list[tuple[Node, Any]] = []
        if plan.load:
            t0 = time.monotonic()
            loaded = await run_blocking(self.backend.load, src.disk_ref)  # type: ignore[arg-type]
            took = time.monotonic() - t0
            size = self.backend.size(loaded)
            with self._lock:
                self.counters["loads"] += 1
                if src.load_bytes:
                    self.load_seconds_per_byte = ewma(self.load_seconds_per_byte, took / src.load_bytes)
                if not src.resident and not src.removed and self.lru.may_hold(src) and size <= self.lru.capacity:
                    self.lru.add(src, loaded, size)  # promoted back to memory
                    src.pins += 1
                    payload = loaded
                    victims = self._evict_locked()
                else:
                    payload = temp = loaded
            self._release(victims)
        else:
            payload = src.payload
        try:
            t0 = time.monotonic()
            ws = await call_sync_or_async(self.backend.fork, payload)
            with self._lock:
                self.fork_seconds = ewma(self.fork_seconds, time.monotonic() - t0)
                self.counters["forks"] += 1
            return ws
        finally:
            if temp is not None:
                # StateBackend.release is synchronous (the cache's eviction calls it under its lock).
                await run_blocking(self.backend.release, temp)
            else:
                self._unpin(src)

    def _unpin(self, node: Node) -> None:
        with self._lock:
            node.pins -= 1
            victims = self._evict_locked()
        self._release(victims)

    async def replay(self, ws: Workspace, node: Node, tools: Mapping[str, Tool]) -> None:
        """Run `node`'s call on `ws`, which is in its parent's state, and compare what it observes
        with what `node` recorded (ReplayDiverged, with `ws` attached, when they differ)."""
        await self._replay(ws, node, tools)

    async def _replay(self, ws: Workspace, node: Node, tools: Mapping[str, Tool], index: int = 0) -> None:
        assert node.call is not None
        t0 = time.monotonic()
        fresh = await tools[node.call.name].run(ws, node.call.args)
        took = time.monotonic() - t0
        recorded = node.result.result()
        with self._lock:
            self.counters["replayed_calls"] += 1
            node.exec_seconds = ewma(node.exec_seconds, took)
        if not self.guard.check(node.call, recorded, fresh, source="replay"):
            raise ReplayDiverged(f"replaying {node.call.key} observed something else than recorded", ws, node, fresh,
                                 index)
