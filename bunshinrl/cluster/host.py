"""One bunshin host of a pool: the body of its Ray actor.

A WorkspaceHost runs in a Ray worker process placed on its node by the node's custom resource
(pool.py), made that host by its environment (bunshinfork.HostConfig.env(), set through
the actor's runtime_env before bunshinfork is imported). It owns the host's workspaces, its
snapshots and its shard of the prefix cache, and serves three kinds of remote calls:

    the SDK's     create, run, write_file, read_file, snapshot, fork, destroy, release
    the cache's   lookup (how deep a prefix it holds), materialise, record, and
                  export_prefix / graft (a held prefix, its snapshot included, to another host)
    the core's    start_group / start / call / finish / close: a Rollout stepped remotely, and
                  learn (the pool's selector and tool timings, for the speculator)

The host's RolloutCore is made here by the pool's `core` factory, so it is whatever a single
host would run: Base (no cache, no speculator), the cache, Spec or Full. Speculation, its forks
and its rollbacks happen in this process, on the host that owns the sample's workspace, while
the driver's policy reasons.

Workspaces and snapshots are named by their ids across the wire; nothing of bunshinfork's
own objects leaves the process. Every method is a coroutine, so the actor is an asyncio actor
and samples interleave as they do in RolloutEngine; blocking SDK work runs in threads.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from bunshinfork import HostConfig, HostInUse, Snapshot, Workspace, current_host, reap_orphans, teardown_host
from bunshinfork.hosts import state_root

from .._async import run_blocking
from ..calls.policy import SampleContext, Step
from ..calls.signature import ToolCall
from ..calls.task import Task
from ..prefix.cache import ToolPrefixCache
from ..prefix.tree import Node
from ..rollout.core import Rewound, Rollout, RolloutCore
from ..rollout.timeline import SampleTimeline
from ..rollout.wiring import CoreConfig, build_core
from ..speculation.selector import ToolSelector
from ..states.backend import SharedSnapshot
from .transfer import load_snapshot, save_snapshot

CoreFactory = Callable[[], RolloutCore]


class NoCache(RuntimeError):
    """A cache operation on a host whose core runs without a prefix cache (Base, Spec)."""


class WorkspaceHost:
    def __init__(self, name: str, cache_bytes: int = 1 << 30, memory: str = "auto",
                 core: CoreFactory | None = None) -> None:
        expected, host = HostConfig.named(name), current_host()
        if expected != host:
            raise RuntimeError(f"host {name}: this process is {host}, not {expected}; start it with "
                               "runtime_env={'env_vars': HostConfig.named(name).env()}")
        self.name = name
        state_root()
        # Made here, after the host's environment: a core's cache and snapshots are this host's.
        # The default host captures as every other driver does (build_core's policy: a state when
        # a second visitor needs it, or behind a reasoning step long enough to hide it), so a
        # capture never lands on a straggler's path here either; replication and routing see the
        # states that policy kept. A pool's `core` factory may choose else (the depth policy keeps
        # every state). Persistence is not used: a host's states live as long as its actor.
        self.core = core() if core is not None else build_core(CoreConfig(
            cache_bytes=cache_bytes, memory=memory, persist_between_epochs=False))
        self.cache = self.core.cache
        self.core.tail.journal = []  # the pool's other hosts learn this one's timings (learn())
        self.tasks: dict[str, Task] = {}
        self.workspaces: dict[str, Workspace] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.rollouts: dict[str, Rollout] = {}
        self.imported: dict[str, SharedSnapshot] = {}  # loaded by import_snapshot, by snapshot id
        self.counters = {"imported_bytes": 0, "exported_bytes": 0}

    async def ping(self) -> dict[str, Any]:
        host = current_host()
        return {"name": self.name, "pid": os.getpid(), "run_root": str(host.run_root),
                "cgroup_parent": host.cgroup_parent, "bridge": host.bridge, "layer_store": str(host.layer_store)}

    # ---- the SDK ----

    async def create(self, **spec: Any) -> str:
        ws = await run_blocking(Workspace.create, **spec)
        self.workspaces[ws.id] = ws
        return ws.id

    async def run(self, ws_id: str, cmd: str, timeout: float = 60) -> tuple[int, str, str]:
        r = await run_blocking(self.workspaces[ws_id].commands.run, cmd, timeout=timeout)
        return r.exit_code, r.stdout, r.stderr  # type: ignore[union-attr]

    async def write_file(self, ws_id: str, path: str, data: str | bytes) -> None:
        await run_blocking(self.workspaces[ws_id].files.write, path, data)

    async def read_file(self, ws_id: str, path: str) -> str:
        return await run_blocking(self.workspaces[ws_id].files.read, path)

    async def snapshot(self, ws_id: str) -> str:
        snap = await run_blocking(self.workspaces[ws_id].snapshot)
        self.snapshots[snap.id] = snap
        return snap.id

    async def fork(self, snap_id: str, count: int = 1) -> list[str]:
        out = await run_blocking(self.snapshots[snap_id].fork, count)
        errors = [c for c in out if isinstance(c, Exception)]
        for c in out:
            if isinstance(c, Workspace):
                if errors:
                    await run_blocking(c.destroy)
                else:
                    self.workspaces[c.id] = c
        if errors:
            raise errors[0]
        return [c.id for c in out]  # type: ignore[union-attr]

    async def destroy(self, ws_id: str) -> None:
        await run_blocking(self.workspaces.pop(ws_id).destroy)

    async def release(self, snap_id: str) -> None:
        await run_blocking(self.snapshots.pop(snap_id).release)

    # ---- snapshots between hosts (replication) ----

    async def export_snapshot(self, snap_id: str, shared_dir: str | None = None) -> bytes | str:
        """A saved copy of a snapshot (Snapshot.save): the bytes of its tar, for Ray's object
        store, or, with shared_dir, a directory there that every host can read."""
        snap = self.snapshots.get(snap_id) or self.imported[snap_id].snap
        return await self._save(snap, shared_dir)

    async def _save(self, snap: Snapshot, shared_dir: str | None) -> bytes | str:
        saved, moved = await save_snapshot(snap, shared_dir)
        self.counters["exported_bytes"] += moved
        return saved

    async def import_snapshot(self, saved: bytes | str) -> str:
        """A snapshot saved by another host's export_snapshot, loaded here; returns its id here."""
        shared = await self._load(saved)
        self.imported[shared.snap.id] = shared
        return shared.snap.id

    async def _load(self, saved: bytes | str) -> SharedSnapshot:
        shared, moved = await load_snapshot(saved)
        self.counters["imported_bytes"] += moved
        return shared

    # ---- the prefix cache's shard ----

    def _cache(self) -> ToolPrefixCache:
        if self.cache is None:
            raise NoCache(f"host {self.name} runs its rollouts without a prefix cache")
        return self.cache

    def _held(self, root: Node, calls: Sequence[ToolCall]) -> list[Node]:
        """The nodes of the completed prefix of `calls` this shard holds below `root`, root first."""
        path = [root]
        for c in calls:
            child = self._cache().tree.child(path[-1], c)
            if child is None or not child.done:
                break
            path.append(child)
        return path

    async def register(self, tasks: Sequence[Task]) -> None:
        for t in tasks:
            self.tasks[t.id] = t

    async def lookup(self, task_id: str, calls: Sequence[ToolCall]) -> int:
        """How many of `calls` this shard holds as a completed prefix of the task's tree: -1
        without the task's root (or without a cache), 0 with only the root. Counts no hit
        (routing asks every host)."""
        if self.cache is None:
            return -1
        root = self.cache.root(task_id, await self.core.digest(self.tasks[task_id]))
        return -1 if root is None else len(self._held(root, calls)) - 1

    async def materialise(self, task_id: str, calls: Sequence[ToolCall]) -> tuple[str, int]:
        """A new workspace in the state of the deepest prefix of `calls` held here, and its depth."""
        task, cache = self.tasks[task_id], self._cache()
        path = self._held(await self.core.root(task), calls)
        ws = await cache.materialize(path[-1], task.engine_tools)
        self.workspaces[ws.id] = ws
        return ws.id, len(path) - 1

    async def record(self, task_id: str, calls: Sequence[ToolCall], observation: str, ws_id: str,
                     exec_seconds: float = 0.0) -> bool:
        """Record that `calls[-1]`, run after the prefix `calls[:-1]` (which must be held here),
        observed `observation`, in the state workspace `ws_id` is in now. False when the shard
        already had it."""
        cache = self._cache()
        path = self._held(await self.core.root(self.tasks[task_id]), calls[:-1])
        if len(path) < len(calls):
            raise KeyError(f"{task_id}: the prefix {list(calls[:-1])} is not held on host {self.name}")
        node, mine = cache.begin(path[-1], calls[-1])
        if not mine:
            return False
        if cache.complete(node, observation, exec_seconds):
            cache.attach(node, await run_blocking(SharedSnapshot.take, self.workspaces[ws_id]))
        return True

    async def export_prefix(self, task_id: str, paths: Sequence[Sequence[ToolCall]], shared_dir: str | None = None,
                            with_root: bool = True) -> dict[str, Any]:
        """What another host needs to serve these prefixes as this shard does (graft()): the
        recorded steps (observation, seconds) of each one's held part, and a saved copy of the
        snapshot of the deepest resident node on the first, the hot one (the root only if
        with_root). {"steps": [[(str, float)]], "at": that node's depth or -1, "saved": ...}"""
        cache = self._cache()
        root = cache.root(task_id, await self.core.digest(self.tasks[task_id]))
        if root is None:
            raise LookupError(f"host {self.name} holds no state of task {task_id}")
        held = [self._held(root, p) for p in paths]

        def take(n: Node) -> tuple[SharedSnapshot, int] | None:
            if isinstance(n.payload, SharedSnapshot) and (with_root or n.parent is not None):
                return n.payload.acquire(), n.depth
            return None

        # The reference is taken under the cache's lock, before eviction could release the state.
        found = cache.first_held(list(reversed(held[0] if held else [root])), take)
        shared, at = found if found is not None else (None, -1)
        saved = None
        if shared is not None:
            try:
                saved = await self._save(shared.snap, shared_dir)
            finally:
                await shared.release_async()
        steps = [[(n.result.result(), n.exec_seconds) for n in path[1:]] for path in held]
        return {"steps": steps, "at": at, "saved": saved}

    async def graft(self, task_id: str, paths: Sequence[Sequence[ToolCall]], exported: dict[str, Any]) -> int:
        """Hold what another host's export_prefix(task_id, paths) gave: its steps become this
        shard's nodes (as if they had run here), its snapshot the state of its node (the root's
        state when that is the root). The task's root must be held here unless that snapshot is
        it. The nodes between keep no state: a miss below them forks the nearest resident
        ancestor and replays. Returns the depth at which a state came (-1: none)."""
        cache = self._cache()
        digest = await self.core.digest(self.tasks[task_id])
        at = exported["at"]
        shared = await self._load(exported["saved"]) if exported["saved"] is not None else None
        try:
            if at == 0 and shared is not None:
                root: Node | None = cache.add_root(task_id, digest, shared)
                shared = None
            else:
                root = cache.root(task_id, digest)
            if root is None:
                raise LookupError(f"host {self.name} holds no root state of task {task_id} to graft below")
            for i, (calls, steps) in enumerate(zip(paths, exported["steps"], strict=True)):
                node = root
                for call, (observation, seconds) in zip(calls, steps, strict=False):
                    node, mine = cache.begin(node, call)
                    payload = None
                    if i == 0 and node.depth == at:
                        payload, shared = shared, None
                    if mine:
                        if cache.complete(node, observation, seconds) or payload is not None:
                            cache.attach(node, payload)
                    elif payload is not None:
                        cache.attach(node, payload)  # a state already resident here keeps its own
        finally:
            if shared is not None:
                await shared.release_async()
        return at

    # ---- speculation across the pool ----

    async def take_timings(self) -> list[tuple[str, str, str, float]]:
        """The tool and rollout timings this host's tail policy recorded since the last take."""
        return self.core.tail.take_journal()

    async def learn(self, selector: ToolSelector | None, timings: Sequence[tuple[str, str, str, float]]) -> None:
        """The pool's next-call selector (fitted by the driver on every host's trajectories, as
        a single host fits its own) and the other hosts' timings: this host then speculates as a
        single host that had run every sample would."""
        if selector is not None and self.core.speculator is not None:
            self.core.speculator.selector = selector
        self.core.tail.replay(timings)

    # ---- rollouts, stepped remotely ----

    async def start_group(self, task_id: str, contexts: Sequence[SampleContext]) -> list[str]:
        rollouts = await self.core.start_group(self.tasks[task_id], contexts)
        return [self._keep(r) for r in rollouts]

    async def start(self, task_id: str, ctx: SampleContext, replay: Sequence[Step] = ()) -> tuple[str, list[Step]]:
        """One sample's rollout; `replay`: the steps it had taken on a host that died, issued
        again here (the cache serves what this shard holds). Returns the steps as observed here."""
        r = await self.core.start(self.tasks[task_id], ctx, rewinds=True)
        rid = self._keep(r)
        for s in replay:
            try:
                await r.call(s.call, s.decision)
            except Rewound:
                break  # a step did not reproduce: the history returned ends at it
        return rid, list(r.history)

    async def call(self, rid: str, call: ToolCall, decision: int) -> tuple[Step | None, int, list[Step] | None]:
        """The step the call made, how many calls the task's budget has left, and None; or, when
        a served step did not reproduce (Rewound), None, the budget and the history cut back to
        it, on which the driver's policy acts again."""
        r = self.rollouts[rid]
        try:
            await r.call(call, decision)
        except Rewound:
            return None, r.calls_left, list(r.history)
        return r.history[-1], r.calls_left, None

    async def calls_left(self, rid: str) -> int:
        return self.rollouts[rid].calls_left

    async def finish(self, rid: str, answer: str | None) -> tuple[float | None, list[Step] | None]:
        """The reward and None; or None and the history cut back when the verifier's state had to
        be rebuilt and a served step did not reproduce (the driver's policy acts again)."""
        r = self.rollouts[rid]
        try:
            await r.finish(answer)
        except Rewound:
            return None, list(r.history)
        return r.reward, None

    async def close(self, rid: str) -> tuple[SampleTimeline, list[str]]:
        r = self.rollouts.pop(rid)
        await r.close()
        return r.timeline, list(r.served)

    def _keep(self, r: Rollout) -> str:
        rid = f"{self.name}/{secrets.token_hex(6)}"
        self.rollouts[rid] = r
        return rid

    async def load(self) -> int:
        """Open rollouts and workspaces: what least-loaded placement compares."""
        return len(self.rollouts) + len(self.workspaces)

    async def stats(self) -> dict[str, Any]:
        core = self.core
        # Which capture policy this host runs (the drivers share build_core's; a test checks it).
        captures = {"policy": core.cache.snapshot_policy if core.cache is not None else None,
                    "critical_path": core.critical_path_captures}
        return {**core.stats(), **self.counters, "captures": captures}

    # ---- teardown ----

    async def gc(self) -> dict[str, list[str]]:
        """The workspaces of this host whose creator died (a host actor before this one), then
        bunshinfork's gc on this host only (bunshinfork.reap_orphans)."""
        return await run_blocking(reap_orphans)

    async def drain(self) -> None:
        await self.core.drain()

    async def shutdown(self) -> dict[str, list[str]]:
        """Release everything this host holds, then gc what remains under its state root."""
        for rid in list(self.rollouts):
            with contextlib.suppress(Exception):
                await self.close(rid)
        await self.core.close()  # drains, and releases the initialized snapshots keep_initial kept
        if self.cache is not None:
            await run_blocking(self.cache.close)
        for ws in self.workspaces.values():
            with contextlib.suppress(Exception):
                await run_blocking(ws.destroy)
        for snap in self.snapshots.values():
            with contextlib.suppress(Exception):
                await run_blocking(snap.release)
        for shared in self.imported.values():
            with contextlib.suppress(Exception):
                await run_blocking(shared.release)
        self.workspaces.clear()
        self.snapshots.clear()
        self.imported.clear()
        return await run_blocking(reap_orphans)

    async def retire(self) -> dict[str, list[str]]:
        """shutdown(), then remove the host itself (its state root's tmpfs, its cgroup parents)
        when nothing of a workspace remains there: a pool's hosts leave the machine as they found it."""
        out = await self.shutdown()
        try:
            out["host"] = await run_blocking(teardown_host)
        except HostInUse:  # a workspace outlived the shutdown: the host stays, for gc to find
            out["host"] = []
        return out


__all__ = ["CoreFactory", "NoCache", "WorkspaceHost"]
