"""The real ToolPrefixCache over a lightweight in-memory state backend: ancestor-aware LRU
eviction, restore-vs-replay, and reconstruction correctness under random access sequences."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bunshinrl import DeterminismGuard, Tool, ToolCall, ToolPrefixCache
from bunshinrl.prefix.tree import Node
from bunshinrl.rollout.core import RolloutCore
from bunshinrl.states.backend import Persisted


@dataclass(eq=False)
class FakeState:
    """A resident state: the calls that led to it, and a size in bytes."""

    calls: tuple[str, ...]
    size: int


@dataclass
class FakeWorkspace:
    calls: list[str]
    destroyed: bool = False

    def destroy(self) -> None:
        self.destroyed = True


@dataclass
class FakeBackend:
    persists: bool = True
    live: set[int] = field(default_factory=set)  # ids of unreleased payloads
    disk: dict[str, FakeState] = field(default_factory=dict)
    loads: int = 0
    _ids: Any = field(default_factory=itertools.count)

    def new(self, calls: tuple[str, ...], size: int) -> FakeState:
        s = FakeState(calls, size)
        self.live.add(id(s))
        return s

    def size(self, p: FakeState) -> int:
        return p.size

    def fork(self, p: FakeState) -> FakeWorkspace:
        assert id(p) in self.live, "forked a released state"
        return FakeWorkspace(list(p.calls))

    def release(self, p: FakeState) -> None:
        assert id(p) in self.live, "released twice"
        self.live.remove(id(p))

    def persist(self, p: FakeState, parent_ref: str | None) -> Persisted:
        assert id(p) in self.live
        ref = f"d{next(self._ids)}"
        self.disk[ref] = FakeState(p.calls, p.size)
        return Persisted(ref, p.size // 4, p.size)

    def load(self, ref: str) -> FakeState:
        self.loads += 1
        d = self.disk[ref]
        return self.new(d.calls, d.size)


def _tool(name: str) -> Tool:
    def execute(ws: FakeWorkspace, args: dict) -> str:
        ws.calls.append(ToolCall(name, args).key)
        return f"obs:{ToolCall(name, args).key}"
    return Tool(name, execute)  # type: ignore[arg-type]


TOOLS = {n: _tool(n) for n in ("a", "b", "c")}

ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 10**6), st.sampled_from("abc"), st.integers(0, 2),
                  st.integers(10, 120), st.sampled_from([0.0, 0.01, 0.5, 2.0]), st.booleans()),
        st.tuples(st.just("insert"), st.integers(0, 10**6), st.sampled_from("abc"), st.integers(0, 2),
                  st.integers(10, 120), st.sampled_from([0.0, 0.01, 0.5, 2.0]), st.booleans()),
        st.tuples(st.just("touch"), st.integers(0, 10**6)),
        st.tuples(st.just("materialize"), st.integers(0, 10**6)),
        st.tuples(st.just("budget"), st.integers(0, 250)),  # set_capacity (a budget relative to a peak)
    ),
    min_size=1, max_size=60,
)


def _check(cache: ToolPrefixCache, backend: FakeBackend) -> None:
    assert cache.check() == []
    resident = cache.lru.resident
    # Every resident state is one unreleased payload, and nothing else is held.
    assert {id(n.payload) for n in resident} == backend.live
    # Over the budget only when nothing may go: everything left is an ancestor of another
    # resident node, or a root without a copy on disk.
    if cache.lru.resident_bytes > cache.lru.capacity:
        for n in resident:
            assert n.resident_below > 0 or n.pins > 0 or not cache._can_drop(n)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, capacity=st.integers(30, 250), persists=st.booleans(), every=st.integers(1, 3))
def test_resident_set_stays_ancestor_closed(ops: list[tuple], capacity: int, persists: bool, every: int) -> None:
    backend = FakeBackend(persists=persists)
    cache = ToolPrefixCache(backend, capacity, guard=DeterminismGuard(), snapshot_every=every,
                            snapshot_slower_than=1.5, background=False)
    root = cache.add_root("task", "tmpl", backend.new((), 30))
    nodes: list[Node] = [root]
    for op in ops:
        if op[0] == "insert":
            _, pi, name, arg, size, took, _ = op
            parent = nodes[pi % len(nodes)]
            call = ToolCall(name, {"x": arg})
            node, created = cache.begin(parent, call)
            if created:
                if cache.complete(node, f"obs:{call.key}", took):
                    cache.attach(node, backend.new(tuple(c.key for c in node.calls()), size))
                nodes.append(node)
        elif op[0] == "touch":
            node = nodes[op[1] % len(nodes)]
            if node.parent is not None:
                assert cache.lookup(node.parent, node.call, TOOLS[node.call.name]) is node
                # Touching refreshes the node and all its ancestors.
                assert all(a.last_used == node.last_used for a in node.ancestors())
        elif op[0] == "budget":
            assert cache.set_capacity(op[1]) == cache.lru.resident_bytes
            assert cache.lru.capacity == op[1]
        else:
            node = nodes[op[1] % len(nodes)]
            plan = cache.plan(node)
            # Restore from disk only when that is estimated cheaper than replay from memory.
            if plan.load:
                assert plan.source.disk_ref is not None
            event(f"materialize from {'disk' if plan.load else 'memory'}, replaying {min(len(plan.replay), 2)}+")
            ws = asyncio.run(cache.materialize(node, TOOLS))
            assert ws.calls == [c.key for c in node.calls()], "rebuilt the wrong state"
        _check(cache, backend)
    event(f"evicted {min(cache.counters['evicted'], 5)}+")
    cache.close()
    assert backend.live == set()


def captured(cache: ToolPrefixCache, backend: FakeBackend, parent: Node, name: str, size: int) -> Node:
    """Run call `name` after `parent` and attach a state of `size` bytes for it."""
    node, _ = cache.begin(parent, ToolCall(name))
    cache.complete(node, "o", 0.1)
    cache.attach(node, backend.new(tuple(c.key for c in node.calls()), size))
    return node


def test_touch_protects_ancestors_and_evicts_lru_leaf() -> None:
    backend = FakeBackend(persists=True)
    cache = ToolPrefixCache(backend, 100, background=False)
    root = cache.add_root("t", "d", backend.new((), 10))

    a = captured(cache, backend, root, "a", 30)
    ab = captured(cache, backend, a, "b", 30)
    c = captured(cache, backend, root, "c", 20)
    cache.lookup(a, ToolCall("b"), TOOLS["b"])  # a and root are now newer than c
    d = captured(cache, backend, c, "a", 30)  # 120 > 100: the least recently used leaf goes, never an ancestor of d
    assert d.resident and c.resident and root.resident
    assert not ab.resident and ab.disk_ref is not None
    assert cache.check() == []
    assert cache.plan(ab).load or cache.plan(ab).source is a
    cache.close()


def test_states_below_one_on_disk_only_are_held_when_the_budget_has_room() -> None:
    """A state captured when the budget had no room is kept on disk only; the states captured or
    restored below it later are held in memory once there is room (before: on disk only for
    good, their ancestor being neither resident nor sparse, so every hit below it restored from
    disk or replayed from the root)."""
    backend = FakeBackend(persists=True)
    cache = ToolPrefixCache(backend, 20, background=False)
    root = cache.add_root("t", "d", backend.new((), 10))
    a = captured(cache, backend, root, "a", 30)  # 40 > 20: on disk only
    assert not a.resident and a.disk_ref is not None
    cache.set_capacity(1000)
    ab = captured(cache, backend, a, "b", 30)
    assert ab.resident and ab.disk_ref is not None
    backend.release(cache.lru.drop(ab))  # as if evicted
    a.exec_seconds = ab.exec_seconds = 50.0  # a restore of ab beats replaying from root or a
    abc = captured(cache, backend, ab, "c", 30)  # below two states on disk only
    assert abc.resident
    backend.release(cache.lru.drop(abc))
    plan = cache.plan(ab)
    assert plan.source is ab and plan.load
    ws = asyncio.run(cache.materialize(ab, TOOLS))
    assert ws.calls == ["a{}", "b{}"] and backend.loads == 1
    assert ab.resident, "the restored state was not promoted back to memory"
    assert asyncio.run(cache.materialize(ab, TOOLS)).calls == ["a{}", "b{}"] and backend.loads == 1
    assert cache.check() == []
    cache.close()
    assert backend.live == set()


def test_replay_is_preferred_when_faster_than_disk() -> None:
    backend = FakeBackend(persists=True)
    cache = ToolPrefixCache(backend, 10**6, background=False)
    root = cache.add_root("t", "d", backend.new((), 10))
    n1, _ = cache.begin(root, ToolCall("a"))
    cache.complete(n1, "o", 0.001)
    cache.attach(n1, backend.new(("a{}",), 10))
    backend.release(cache.lru.drop(n1))  # as if evicted: only on disk now
    n1.load_bytes = 10**9  # a big restore ...
    plan = cache.plan(n1)
    assert plan.source is root and not plan.load and [n.call for n in plan.replay] == [ToolCall("a")]
    n1.exec_seconds, n1.load_bytes = 50.0, 10  # ... or a slow call with a small restore
    plan = cache.plan(n1)
    assert plan.source is n1 and plan.load
    ws = asyncio.run(cache.materialize(n1, TOOLS))
    assert ws.calls == ["a{}"] and backend.loads == 1
    cache.close()
    assert backend.live == set()


def test_growing_states_are_measured_again_before_eviction() -> None:
    """A retained copy-on-write snapshot costs more as its source writes: the budget must see it."""
    backend = FakeBackend(persists=True)
    cache = ToolPrefixCache(backend, 100, background=False)
    root = cache.add_root("t", "d", backend.new((), 10))

    a = captured(cache, backend, root, "a", 20)
    b = captured(cache, backend, root, "b", 20)
    assert cache.lru.resident_bytes == 50 and a.resident and b.resident
    a.payload.size = 75  # its source wrote 55 bytes of pages it used to share
    c = captured(cache, backend, root, "c", 10)  # 10 + 75 + 20 + 10 > 100: a, the least recently used leaf, goes
    assert not a.resident and b.resident and c.resident
    assert cache.lru.resident_bytes == 40
    assert cache.check() == []
    cache.close()


def test_capture_decision_weighs_the_next_reasoning_step_and_revisits() -> None:
    """The cost policy wants a slow call's state; it is captured only beside a reasoning step
    predicted to outlast a capture and where a revisit is expected; a second visitor may claim
    it later, when its own step is long enough."""
    backend = FakeBackend(persists=False)
    cache = ToolPrefixCache(backend, 10**6, snapshot_policy="cost", background=False)
    cache.capture_seconds = 1.0
    root = cache.add_root("t", "d", backend.new((), 10))
    slow, _ = cache.begin(root, ToolCall("a"))
    assert not cache.complete(slow, "o", 3.0, reasoning=0.5)  # the capture would outlast the step
    assert slow.sparse and cache.counters["captures_off_path"] == 1
    other, _ = cache.begin(root, ToolCall("b"))
    assert not cache.complete(other, "o", 3.0, reasoning=10.0, revisit=False)  # an off-tree straggler
    assert cache.counters["captures_not_revisited"] == 1
    third, _ = cache.begin(root, ToolCall("c"))
    assert cache.complete(third, "o", 3.0, reasoning=10.0)
    cache.attach(third, backend.new(("c{}",), 10))
    fast, _ = cache.begin(root, ToolCall("f"))
    assert not cache.complete(fast, "o", 0.01, reasoning=10.0)  # replaying it is cheaper than a capture
    # A second visitor holding `slow`'s state: not with a short step left, yes with a long one, once.
    assert not cache.claim_capture(slow, 0.5)
    assert cache.claim_capture(slow, 5.0) and not cache.claim_capture(slow, 5.0)
    cache.attach(slow, backend.new(("a{}",), 10))
    assert slow.resident and not cache.claim_capture(fast, 5.0)
    assert cache.counters["captures_on_demand"] == 1
    cache.close()
    assert backend.live == set()


def test_persistence_waits_for_the_gap_between_epochs_unless_over_budget() -> None:
    backend = FakeBackend(persists=True)
    cache = ToolPrefixCache(backend, 100, persist_between_epochs=True)
    root = cache.add_root("t", "d", backend.new((), 10))
    a = captured(cache, backend, root, "a", 30)
    assert cache.persistence_pending == 2 and cache.counters["persisted"] == 0 and not backend.disk
    assert cache.flush_persistence() == 2
    cache.drain()
    assert cache.counters["persisted"] == 2 and a.disk_ref is not None and cache.persistence_pending == 0
    captured(cache, backend, a, "b", 30)
    assert cache.counters["persisted"] == 2  # deferred again
    captured(cache, backend, root, "c", 50)  # 120 > 100: eviction needs copies on disk, now
    cache.drain()
    assert cache.counters["persisted"] == 4 and cache.lru.resident_bytes <= 100
    cache.close()
    assert backend.live == set()


def test_the_budget_follows_the_workspaces_level_under_share_x_their_peak() -> None:
    """RolloutCore(cache_share=): at each memory sample the cache may hold what the workspaces
    leave under share x their highest level (never above its own budget); what has a copy on
    disk goes at once. Little while they peak, more as they shrink, the ceiling in the gap."""
    backend = FakeBackend(persists=True)
    cache = ToolPrefixCache(backend, 1000, persist_between_epochs=True)
    root = cache.add_root("t", "d", backend.new((), 10))
    a = captured(cache, backend, root, "a", 300)
    captured(cache, backend, a, "b", 300)
    cache.drain()  # the gap's persists: both have a copy on disk
    core = RolloutCore(cache=cache, cache_share=1.05)
    budget = core.budget
    assert budget is not None
    budget.observe(800)  # the workspaces at their highest: the root (10) and 1.05 x 800 - 800
    assert cache.lru.capacity == 50 and cache.lru.resident_bytes <= 50 and cache.counters["evicted"] >= 2
    assert root.resident  # roots go last
    budget.observe(810)  # a change under 1/64 of the ceiling is noise, not applied
    assert cache.lru.capacity == 50
    budget.observe(300)  # they shrank: the cache may grow into what they left
    assert cache.lru.capacity == 10 + int(1.05 * 810) - 300
    budget.observe(0)  # the gap: they are gone
    assert cache.lru.capacity == 10 + int(1.05 * 810)
    budget.observe(5000)
    assert cache.lru.capacity == 260
    budget.observe(0)
    assert cache.lru.capacity == 1000  # never above the budget it was made with
    stats = core.stats()["cache"]["budget"]
    assert stats == {"share": 1.05, "workspace_peak_bytes": 5000, "budget_bytes": 1000, "lowest_budget_bytes": 50}
    plain = RolloutCore(cache=ToolPrefixCache(FakeBackend(), 1000))
    assert plain.budget is None and "budget" not in plain.stats()["cache"]
    plain.cache.close()  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        RolloutCore(cache_share=-1.0)
    cache.close()
    assert backend.live == set()
    # A root over the budget is held until its copy is on disk, then may go: every sample of its
    # task starts from it (kept on disk only with its persist deferred to the gap, it was
    # unavailable for the whole epoch).
    small = ToolPrefixCache(backend, 5, persist_between_epochs=True)
    first = small.add_root("t", "d", backend.new((), 10))
    assert small.root("t", "d") is first and small.lru.root_bytes in (0, 10)
    small.drain()
    assert small.root("t", "d") is first and (first.resident or first.disk_ref is not None)
    small.close()
    assert backend.live == set()


def test_the_engines_memory_sampler_tells_the_budget_each_sample() -> None:
    """The engine's MemorySampler hands each sample's workspace bytes to `observe` (the core's
    ResidentBudget), so the budget follows the epoch as it runs, not only between epochs."""
    from bunshinrl.states.metrics import MemorySampler

    seen: list[int] = []

    async def run() -> list[tuple[float, int, int]]:
        sampler = MemorySampler(lambda: [], interval=0.01, observe=seen.append)
        sampler.start(0.0)
        await asyncio.sleep(0.1)
        return await sampler.stop()

    samples = asyncio.run(run())
    assert len(seen) == len(samples) >= 2 and set(seen) == {0}
