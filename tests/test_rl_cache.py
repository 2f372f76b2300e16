"""ToolPrefixCache over real workspaces: hits served from memory, from disk deltas and by replay
give exactly what a live workspace gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rl_support import counter_task, my_snapshots, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinfork import Workspace
from bunshinrl import DeterminismGuard, SharedSnapshot, SnapshotBackend, ToolCall, ToolPrefixCache

# Host-wide leak checks also see other processes' workspaces; this one checks our own.
pytestmark = pytest.mark.usefixtures("no_own_leaks")


async def _run(cache: ToolPrefixCache, tools, parent, call: ToolCall, ws: Workspace,  # type: ignore[no-untyped-def]
               incremental: bool = True, took: float = 0.5):
    """What the engine does on a miss: run the call on `ws` and record the resulting node, as
    if the call took `took` seconds."""
    node, created = cache.begin(parent, call)
    assert created
    obs = await tools[call.name].run(ws, call.args)
    if cache.complete(node, obs, took):
        cache.attach(node, await asyncio.to_thread(SharedSnapshot.take, ws, "auto", incremental))
    return node, obs


async def _rebuilt_then_matches(cache: ToolPrefixCache, tools, node, then: ToolCall,  # type: ignore[no-untyped-def]
                                ws: Workspace) -> None:
    """Rebuild `node`'s state, run `then` on it, and compare with `ws`, which ran it live."""
    rebuilt = await cache.materialize(node, tools)
    try:
        await tools[then.name].run(rebuilt, then.args)
        assert await tools["state"].run(rebuilt, {}) == await tools["state"].run(ws, {})
    finally:
        await asyncio.to_thread(rebuilt.destroy)


def test_the_same_budget_holds_more_incremental_states() -> None:
    """A resident state costs its delta against the state it was forked from: the budget that
    holds three complete states holds every state of a ten-call chain."""
    env = counter_task()
    tools = env.tools

    async def chain(ws: Workspace, budget: int, incremental: bool) -> tuple[int, int]:
        cache = ToolPrefixCache(SnapshotBackend(None), capacity_bytes=budget, background=False)
        try:
            root = cache.add_root("task", "tmpl", await asyncio.to_thread(SharedSnapshot.take, ws))
            live = await cache.materialize(root, tools)
            try:
                node = root
                for i in range(10):
                    node, _ = await _run(cache, tools, node, ToolCall("bump", {"n": i + 1}), live, incremental)
                assert cache.check() == []
                return cache.stats()["resident"], cache.stats()["resident_bytes"]
            finally:
                await asyncio.to_thread(live.destroy)
        finally:
            cache.close()

    async def main() -> None:
        ws = Workspace.create()
        try:
            env.setup(ws)
            with ws.snapshot(incremental=False) as one:
                budget = 3 * one.retained_bytes()
            full = await chain(ws, budget, incremental=False)
            incremental = await chain(ws, budget, incremental=True)
        finally:
            await asyncio.to_thread(ws.destroy)
        assert full[0] <= 4, full  # the root and the last two or three calls
        assert incremental[0] == 11 and incremental[1] <= budget, incremental
        assert incremental[0] >= 2 * full[0], (full, incremental)

    asyncio.run(main())


def test_hit_served_from_disk_equals_live(tmp_path: Path) -> None:
    snaps_before = set(my_snapshots())
    env = counter_task()
    tools = env.tools

    async def main() -> None:
        ws = Workspace.create()
        env.setup(ws)
        backend = SnapshotBackend(tmp_path / "store")
        cache = ToolPrefixCache(backend, capacity_bytes=1 << 40, background=False)
        try:
            root = cache.add_root("task", "tmpl", await asyncio.to_thread(SharedSnapshot.take, ws))
            await asyncio.to_thread(ws.destroy)
            # Room for the root only: every later state lives on disk as a delta.
            cache.lru.capacity = root.payload_bytes
            live = await cache.materialize(root, tools)
            try:
                n1, o1 = await _run(cache, tools, root, ToolCall("bump", {"n": 5}), live)
                n2, o2 = await _run(cache, tools, n1, ToolCall("touch", {"name": "a"}), live)
                assert (n1.form, n2.form) == ("disk", "disk") and root.form == "resident"
                assert n2.disk_bytes < root.disk_bytes / 2, "a child should store only what its call changed"

                # The policy repeats the prefix: both calls are hits with the recorded observations.
                hit1 = cache.lookup(root, ToolCall("bump", {"n": 5}), tools["bump"])
                hit2 = cache.lookup(hit1, ToolCall("touch", {"name": "a"}), tools["touch"])
                assert (hit1.observation, hit2.observation) == (o1, o2) == ("5", "a\n")
                # Replaying two calls is made to look slower than reading the delta chain back.
                n1.exec_seconds = n2.exec_seconds = 30.0
                plan = cache.plan(hit2)
                assert plan.load and plan.source is n2 and plan.replay == ()
                from_disk = await cache.materialize(hit2, tools)
                try:
                    assert cache.counters["loads"] == 1
                    # Same server memory, same files, same processes; and they stay in step.
                    assert await tools["state"].run(from_disk, {}) == await tools["state"].run(live, {})
                    for w in (from_disk, live):
                        await tools["bump"].run(w, {"n": 2})
                    assert await tools["state"].run(from_disk, {}) == await tools["state"].run(live, {})
                    assert "7" in await tools["state"].run(from_disk, {})
                finally:
                    await asyncio.to_thread(from_disk.destroy)
            finally:
                await asyncio.to_thread(live.destroy)
        finally:
            cache.close()

    asyncio.run(main())
    assert set(my_snapshots()) == snaps_before


def test_sparse_node_is_rebuilt_by_replay(tmp_path: Path) -> None:
    env = counter_task()
    tools = env.tools

    async def main() -> None:
        ws = Workspace.create()
        env.setup(ws)
        cache = ToolPrefixCache(SnapshotBackend(None), capacity_bytes=1 << 40, snapshot_every=2,
                                background=False)
        try:
            root = cache.add_root("task", "tmpl", await asyncio.to_thread(SharedSnapshot.take, ws))
            n1, _ = await _run(cache, tools, root, ToolCall("bump", {"n": 3}), ws)
            n2, _ = await _run(cache, tools, n1, ToolCall("touch", {"name": "b"}), ws)
            # Depth 1 is not captured (sparse); depth 2 is.
            assert n1.form == "metadata" and n1.sparse and n2.form == "resident"
            plan = cache.plan(n1)
            assert plan.source is root and [n.call for n in plan.replay] == [ToolCall("bump", {"n": 3})]
            await _rebuilt_then_matches(cache, tools, n1, ToolCall("touch", {"name": "b"}), ws)
            assert cache.counters["replayed_calls"] == 1
        finally:
            await asyncio.to_thread(ws.destroy)
            cache.close()

    asyncio.run(main())


def test_nondeterministic_tools_are_never_served_and_replay_detects_liars() -> None:
    env = counter_task()
    tools = env.tools
    guard = DeterminismGuard()

    async def main() -> None:
        ws = Workspace.create()
        cache = ToolPrefixCache(SnapshotBackend(), 1 << 40, guard=guard, snapshot_every=3, background=False)
        try:
            root = cache.add_root("task", "tmpl", await asyncio.to_thread(SharedSnapshot.take, ws))
            # A declared non-deterministic tool: recorded, never served.
            node, _ = cache.begin(root, ToolCall("uuid"))
            cache.complete(node, "recorded", 0.1)
            assert cache.lookup(root, ToolCall("uuid"), tools["uuid"]) is None
            assert guard.report()["declared_nondeterministic"] == ["uuid"]
            # A tool claiming determinism that is not: replay notices, the tool is marked and
            # its subtree dropped from the cache.
            liar, _ = cache.begin(root, ToolCall("liar"))
            cache.complete(liar, await tools["liar"].run(ws, {}), 0.1)
            assert liar.sparse and cache.lookup(root, ToolCall("liar"), tools["liar"]) is liar
            try:
                await cache.materialize(liar, tools)
                raise AssertionError("replay should have diverged")
            except Exception as e:
                assert type(e).__name__ == "ReplayDiverged"
                await asyncio.to_thread(e.workspace.destroy)  # type: ignore[attr-defined]
            assert guard.report()["detected_nondeterministic"] == ["liar"]
            assert cache.lookup(root, ToolCall("liar"), tools["liar"]) is None
            assert liar.removed
        finally:
            await asyncio.to_thread(ws.destroy)
            cache.close()

    asyncio.run(main())


def test_cost_policy_captures_where_the_replay_saved_outweighs_a_capture() -> None:
    """snapshot_policy="cost": a state is captured once replaying what it saves (its call and its
    uncaptured ancestors') takes as long as a capture; the rest are rebuilt by replay."""
    env = counter_task()
    tools = env.tools

    async def main() -> None:
        ws = Workspace.create()
        env.setup(ws)
        cache = ToolPrefixCache(SnapshotBackend(None), capacity_bytes=1 << 40, snapshot_policy="cost",
                                background=False)
        try:
            cache.note_capture(3.0)
            assert 0.5 < cache.capture_seconds < 3.0  # a moving average of measured captures
            cache.capture_seconds = 1.0
            root = cache.add_root("task", "tmpl", await asyncio.to_thread(SharedSnapshot.take, ws))
            n1, _ = await _run(cache, tools, root, ToolCall("bump", {"n": 1}), ws, took=0.4)
            n2, _ = await _run(cache, tools, n1, ToolCall("bump", {"n": 2}), ws, took=0.4)
            # n3 saves 1.2 s of replay (its call and two uncaptured ancestors'); n5 is slow on its own.
            n3, _ = await _run(cache, tools, n2, ToolCall("touch", {"name": "a"}), ws, took=0.4)
            n4, _ = await _run(cache, tools, n3, ToolCall("bump", {"n": 3}), ws, took=0.3)
            n5, _ = await _run(cache, tools, n4, ToolCall("touch", {"name": "b"}), ws, took=2.0)
            assert [n.sparse for n in (n1, n2, n3, n4, n5)] == [True, True, False, True, False]
            assert cache.replay_seconds(n2) == pytest.approx(0.8) and cache.replay_seconds(n4) == pytest.approx(0.3)
            assert cache.stats()["captured"] == 3  # the root, n3 and n5
            plan = cache.plan(n4)
            assert plan.source is n3 and [n.call for n in plan.replay] == [ToolCall("bump", {"n": 3})]
            await _rebuilt_then_matches(cache, tools, n4, ToolCall("touch", {"name": "b"}), ws)
        finally:
            await asyncio.to_thread(ws.destroy)
            cache.close()

    asyncio.run(main())
    with pytest.raises(ValueError, match="snapshot_policy"):
        ToolPrefixCache(SnapshotBackend(None), 1 << 20, snapshot_policy="every")  # type: ignore[arg-type]
