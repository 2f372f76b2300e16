"""ToolPrefixCache: reuse the observations and workspace states of tool-call prefixes seen before.

A sample walks the tree as its policy emits calls; every matched call is skipped and its recorded
observation returned. On the first miss the state of the deepest hit is reconstructed and forked,
and the sample runs the missed call for real, adding a node. Node states live in memory within a
byte budget (ancestor-aware LRU), on disk as deduplicated deltas, or as metadata only, rebuilt
by forking a retained ancestor and replaying the calls in between, whichever is recorded cheaper.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from ..calls.guard import DeterminismGuard
from ..calls.signature import ToolCall
from ..calls.tools import Tool
from ..states.backend import StateBackend
from .lru import AncestorLRU
from .persistence import Persistence
from .rebuild import Plan, Reconstruction, ReplayDiverged, ewma
from .recording import Recording
from .tree import Node, PrefixTree

SnapshotPolicy = Literal["depth", "cost"]
T = TypeVar("T")


class ToolPrefixCache(Reconstruction, Persistence):
    """A tool-prefix tree whose node states are kept resident, on disk or as metadata.

    capacity_bytes bounds the measured bytes of resident states (snapshot images plus saved
    layers, plus for copy-on-write snapshots the pages their sources wrote since, measured again
    before every eviction). snapshot_every > 1 makes snapshots sparse: only every n-th depth, and calls slower
    than snapshot_slower_than seconds, are captured; the rest are replayed when needed.
    snapshot_policy="cost" chooses by cost instead: a node is captured when replaying the calls it
    would save (its own and those of its uncaptured ancestors up to the nearest captured one)
    takes at least as long as a capture does, measured (capture_seconds, from note_capture). A
    capture freezes the sample's workspace, so it is paid on the sample's path whenever it
    outlasts the next reasoning step, while a replay runs beside reasoning (a prefetch).
    background=False persists states synchronously (deterministic tests).

    The critical path decides when a capture may start (complete(reasoning=, revisit=)): a
    capture freezes the sample's workspace, so it starts only when the predicted reasoning step
    that follows outlasts the predicted capture (capture_seconds, measured); otherwise the state
    stays uncaptured until a second visitor's warm workspace reaches it (claim_capture). A state
    no other sample is expected to revisit (revisit=False: an off-tree straggler) is not captured.
    persist_between_epochs=True queues persistence until flush_persistence(), which the engine
    calls once the epoch's last rollout has finished (the trainer's update phase); the queue is
    flushed at once only when resident states exceed the budget, as eviction needs copies on disk.
    """

    def __init__(self, backend: StateBackend[Any], capacity_bytes: int, *, guard: DeterminismGuard | None = None,
                 snapshot_every: int = 1, snapshot_slower_than: float | None = None,
                 snapshot_policy: SnapshotPolicy = "depth", background: bool = True,
                 persist_between_epochs: bool = False) -> None:
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        if snapshot_policy not in ("depth", "cost"):
            raise ValueError(f"snapshot_policy must be 'depth' or 'cost', not {snapshot_policy!r}")
        self.snapshot_policy = snapshot_policy
        # A first guess until captures are measured: about what one of a small workspace takes here.
        self.capture_seconds = 0.5
        # Per task as well: a desktop with a browser takes seconds to capture, a shell workspace less.
        self._capture_by_task: dict[str, float] = {}
        self.backend = backend
        self.tree = PrefixTree()
        self.lru = AncestorLRU(capacity_bytes)
        self.guard = guard or DeterminismGuard()
        self.guard.on_nondeterministic(self.invalidate_tool)
        self.snapshot_every = snapshot_every
        self.snapshot_slower_than = snapshot_slower_than
        self._lock = threading.RLock()
        # One writer keeps persists in insertion order, so a parent's delta exists before its child's.
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bunshinrl-persist") if background else None
        self._jobs: set[Future[Any]] = set()
        self.persist_between_epochs = persist_between_epochs
        self._deferred: list[tuple[Node, Any, bool]] = []
        self._roots: dict[tuple[str, str], Future[Node]] = {}
        self.fork_seconds = 0.15
        self.load_seconds_per_byte = 1 / 150e6
        self.counters = {"hits": 0, "misses": 0, "forks": 0, "loads": 0, "replayed_calls": 0,
                         "persisted": 0, "evicted": 0, "persist_failures": 0,
                         # captures declined because they would outlast the next reasoning step,
                         # because no second visitor was expected, and taken for a second visitor
                         "captures_off_path": 0, "captures_not_revisited": 0, "captures_on_demand": 0}

    # ---- roots and lookups ----

    def root(self, task_id: str, template_digest: str) -> Node | None:
        with self._lock:
            node = self.tree.root(task_id, template_digest)
            if node is not None and (node.resident or node.disk_ref or node.capturing):
                return node
            return None

    def add_root(self, task_id: str, template_digest: str, payload: Any) -> Node:
        """Register a task's initialized workspace state (the cache takes the payload reference)."""
        with self._lock:
            node = self.tree.root(task_id, template_digest, create=True)
            assert node is not None
            if node.resident:
                self.backend.release(payload)
                return node
        self.attach(node, payload)
        return node

    async def ensure_root(self, task_id: str, template_digest: str, make: Callable[[], Awaitable[Any]]) -> Node:
        """The task's root; without one, make()'s payload (the initialized state) is registered
        as it (add_root), made once however many callers ask at the same time."""
        root = self.root(task_id, template_digest)
        if root is not None:
            return root
        key = (task_id, template_digest)
        with self._lock:
            fut = self._roots.get(key)
            mine = fut is None
            if fut is None:
                fut = self._roots[key] = Future()
        if mine:
            try:
                fut.set_result(self.add_root(task_id, template_digest, await make()))
            except BaseException as e:
                fut.set_exception(e)
            finally:
                with self._lock:
                    self._roots.pop(key, None)
        return await asyncio.wrap_future(fut)

    def lookup(self, node: Node, call: ToolCall, tool: Tool) -> Node | None:
        """The child reached by `call`, completed or still running; None for a miss or a tool whose
        results may not be reused."""
        if not self.guard.reusable(tool):
            return None
        with self._lock:
            # A removed node's subtree was dropped (a tool in it is not deterministic): its
            # descendants keep their children, so both ends are checked.
            child = None if node.removed else self.tree.child(node, call)
            if child is None or child.removed or (child.result.done() and child.result.exception() is not None):
                self.counters["misses"] += 1
                return None
            child.hits += 1
            self.counters["hits"] += 1
            self.lru.touch(child)
            return child

    def walk(self, task_id: str, template_digest: str, calls: list[ToolCall],
             tools: Mapping[str, Tool]) -> tuple[Node | None, list[str]]:
        """Follow `calls` from the task's root: the deepest completed node and the observations
        of the matched calls (fewer than len(calls) at the first miss)."""
        node = self.tree.root(task_id, template_digest)
        obs: list[str] = []
        if node is None:
            return None, obs
        for c in calls:
            child = self.lookup(node, c, tools[c.name])
            if child is None or not child.done:
                break
            node = child
            obs.append(child.result.result())
        return node, obs

    # ---- recording ----

    def begin(self, parent: Node, call: ToolCall) -> Recording:
        """The recording of the node `call` creates, added before the call runs so that concurrent
        samples wait for it rather than run it again; created: this caller made it and must
        complete() or abandon() it (False: another sample's, which it may still be running)."""
        with self._lock:
            existing = self.tree.child(parent, call)
            if existing is not None:
                existing.hits += 1  # a second visitor, though it runs the call itself
                return Recording(self, existing, False)
            node = self.tree.add_child(parent, call)
            # Below a dropped subtree a new node is dropped too: nothing may be served from it.
            node.removed = parent.removed
            self.lru.touch(node)
            return Recording(self, node, True)

    def claim(self, node: Node, reasoning: float | None) -> Recording | None:
        """claim_capture's answer as a handle: a Recording to attach() the capture of `node`'s
        state to, or None when it should not be captured now."""
        return Recording(self, node, False) if self.claim_capture(node, reasoning) else None

    def should_capture(self, node: Node, reasoning: float | None = None, revisit: bool = True) -> bool:
        """Capture `node`'s state after its call? reasoning: the predicted seconds of the reasoning
        step that follows (None: unknown); revisit: whether another sample is expected there."""
        if node.parent is None:
            return True
        if not revisit:
            self.counters["captures_not_revisited"] += 1
            return False
        capture = self.capture_estimate(node.task_id)
        if reasoning is not None and capture > reasoning:
            self.counters["captures_off_path"] += 1
            return False
        if self.snapshot_policy == "cost":
            return self.replay_seconds(node) >= capture
        if self.snapshot_every == 1 or node.depth % self.snapshot_every == 0:
            return True
        return self.snapshot_slower_than is not None and node.exec_seconds >= self.snapshot_slower_than

    def note_capture(self, seconds: float, task_id: str | None = None) -> None:
        """How long a capture of a sample's workspace took (the cost policy weighs it)."""
        with self._lock:
            self.capture_seconds = ewma(self.capture_seconds, seconds)
            if task_id is not None:
                self._capture_by_task[task_id] = ewma(self._capture_by_task.get(task_id, seconds), seconds)

    def capture_estimate(self, task_id: str | None = None) -> float:
        """A capture's predicted seconds: the task's measured history, else every task's."""
        with self._lock:
            return self._capture_by_task.get(task_id, self.capture_seconds) if task_id else self.capture_seconds

    def complete(self, node: Node, observation: str, exec_seconds: float, *, reasoning: float | None = None,
                 revisit: bool = True) -> bool:
        """Record the observation; True when the caller should capture the state and attach() it
        (see should_capture for reasoning and revisit)."""
        with self._lock:
            node.exec_seconds = exec_seconds
            capture = self.should_capture(node, reasoning, revisit)
            if capture:
                node.capturing = Future()
            else:
                node.sparse = True
        node.result.set_result(observation)
        return capture

    def claim_capture(self, node: Node, reasoning: float | None) -> bool:
        """A second visitor holds a live workspace in `node`'s uncaptured state: True when it
        should capture it now (the caller then attach()es the result), which it does only when
        the predicted reasoning step outlasts a capture and the cost policy wants the state."""
        with self._lock:
            if node.removed or node.resident or node.disk_ref is not None or not node.done or \
                    (node.capturing is not None and not node.capturing.done()):
                return False
            capture = self.capture_estimate(node.task_id)
            if reasoning is not None and capture > reasoning:
                return False
            if self.snapshot_policy == "cost" and self.replay_seconds(node) < capture:
                return False
            node.capturing = Future()
            node.sparse = False
            self.counters["captures_on_demand"] += 1
            return True

    def abandon(self, node: Node, error: BaseException) -> None:
        """The call that was to create `node` failed: forget it; waiting samples see `error`."""
        with self._lock:
            if not node.result.done() and not node.children:
                self.tree.remove(node)
        if not node.result.done():
            node.result.set_exception(error)
        if node.capturing is not None and not node.capturing.done():
            node.capturing.set_result(None)

    def attach(self, node: Node, payload: Any | None) -> None:
        """Hand the captured state of `node` to the cache (None: the capture failed)."""
        victims: list[tuple[Node, Any]] = []
        persist_only = False
        size = self.backend.size(payload) if payload is not None else 0
        with self._lock:
            if payload is None or node.removed:
                node.sparse = node.sparse or payload is None
            elif node.resident:
                victims.append((node, payload))  # a second capture of a known state: keep the first
            elif self.lru.may_hold(node) and (size <= self.lru.capacity or node.parent is None):
                # A root is held over budget (until on disk): on disk only it waits for the gap.
                self.lru.add(node, payload, size)
                if self.backend.persists and node.disk_ref is None:
                    node.pins += 1
                    self._queue_persist(node, payload, False)
            elif self.backend.persists and node.disk_ref is None:
                # An ancestor is neither resident nor on disk yet (or it alone exceeds the budget):
                # keep it on disk only.
                persist_only = True
            else:
                victims.append((node, payload))
            victims += self._evict_locked()
        if persist_only:
            self._queue_persist(node, payload, True)
        elif payload is not None and node.removed:
            self.backend.release(payload)
        if node.capturing is not None and not node.capturing.done():
            node.capturing.set_result(None)
        self._release(victims)
        with self._lock:
            # Eviction needs copies on disk: over budget, the deferred persists cannot wait.
            over = bool(self._deferred) and self.lru.resident_bytes > self.lru.capacity
        if over:
            self.flush_persistence()

    # ---- eviction ----

    def _can_drop(self, node: Node) -> bool:
        if node.disk_ref is not None:
            return True
        # Without a copy on disk a state can only be rebuilt by replay from a retained ancestor;
        # a root has none, and a node whose persist is still queued is pinned.
        return node.parent is not None and not self.backend.persists

    def _evict_locked(self) -> list[tuple[Node, Any]]:
        out = self._sweep_removed_locked()
        # Sizes are measured again first: a retained copy-on-write snapshot costs the pages its
        # source has written since, so it grows while it sits in the cache.
        for node in self.lru.resident:
            self.lru.resize(node, self.backend.size(node.payload))
        evicted = self.lru.evict(self._can_drop)
        self.counters["evicted"] += len(evicted)
        return out + evicted

    def _sweep_removed_locked(self) -> list[tuple[Node, Any]]:
        # Invalidated nodes that were pinned (a fork in flight) are dropped once the pin is gone.
        out = []
        while True:
            gone = [n for n in self.lru.resident if n.removed and n.pins == 0 and n.resident_below == 0]
            if not gone:
                return out
            out += [(n, self.lru.drop(n)) for n in gone]

    def first_held(self, nodes: Sequence[Node], take: Callable[[Node], T | None]) -> T | None:
        """The first non-None take(node) over `nodes` in order, each called under the cache's
        lock, so that eviction cannot release a node's state while take() acquires a reference
        to it (a host exporting a resident state)."""
        with self._lock:
            for n in nodes:
                found = take(n)
                if found is not None:
                    return found
        return None

    def touch(self, node: Node) -> None:
        with self._lock:
            self.lru.touch(node)

    # ---- maintenance ----

    def invalidate_tool(self, name: str) -> None:
        """Forget every subtree below a call of `name` (it turned out non-deterministic)."""
        with self._lock:
            doomed = [n for n in self.tree.nodes() if n.call is not None and n.call.name == name]
            for top in doomed:
                if top.removed:
                    continue
                self.tree.remove(top)
            victims = self._sweep_removed_locked()
        self._release(victims)

    def set_capacity(self, capacity_bytes: int) -> int:
        """A new resident budget, evicting at once what no longer fits (states with a copy on
        disk, or rebuildable from a retained ancestor); what cannot go yet goes at the next
        capture. Returns the resident bytes after."""
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        with self._lock:
            self.lru.capacity = capacity_bytes
            victims = self._evict_locked()
        self._release(victims)
        with self._lock:
            return self.lru.resident_bytes

    def close(self) -> None:
        """Release every resident state (states on disk stay in the store)."""
        self.drain()
        with self._lock:
            victims = []
            for n in sorted(self.lru.resident, key=lambda n: -n.depth):
                victims.append((n, self.lru.drop(n)))
        for _n, payload in victims:
            self.backend.release(payload)
        if self._bg is not None:
            self._bg.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            nodes = list(self.tree.nodes())
            return {
                **self.counters,
                "nodes": len(nodes),
                "resident": sum(n.resident for n in nodes),
                "on_disk": sum(n.disk_ref is not None for n in nodes),
                "metadata_only": sum(not n.resident and n.disk_ref is None for n in nodes),
                "resident_bytes": self.lru.resident_bytes,
                "capacity_bytes": self.lru.capacity,
                "disk_stored_bytes": sum(n.disk_bytes for n in nodes),
                "captured": sum(not n.sparse for n in nodes),
                "capture_seconds": round(self.capture_seconds, 3),
                "persist_deferred": len(self._deferred),
            }

    def check(self) -> list[str]:
        with self._lock:
            return self.lru.violations()


__all__ = ["Plan", "Recording", "ReplayDiverged", "SnapshotPolicy", "ToolPrefixCache"]
