"""Speculative execution over real workspaces: adopted when right, traceless when wrong."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from rl_support import counter_task, my_snapshots, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinfork import Workspace
from bunshinrl import SharedSnapshot, SpeculationError, Speculator, TailPolicy, ToolCall, ToolSelector
from bunshinrl.speculation.selector import SelectorContext
from bunshinrl.speculation.speculator import _check_isolated

# Host-wide leak checks also see other processes' workspaces; this one checks our own.
pytestmark = pytest.mark.usefixtures("no_own_leaks")

ENV = counter_task()
TOOLS = ENV.tools


async def _fresh(snap: SharedSnapshot, calls: list[ToolCall]) -> tuple[list[str], str]:
    """Observations and end state of `calls` run for real from `snap`."""
    ws = await asyncio.to_thread(snap.fork, "ksm")
    try:
        obs = [await TOOLS[c.name].run(ws, c.args) for c in calls]
        return obs, await TOOLS["state"].run(ws, {})
    finally:
        await asyncio.to_thread(ws.destroy)


async def _until_completed(branch, n: int) -> None:  # type: ignore[no-untyped-def]
    """Let the policy 'reason' until the chain has finished n speculative calls."""
    for _ in range(400):
        if branch.completed >= n:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"the speculative chain did not finish {n} calls")


def _with_workspace(body, placement: str = "live") -> None:  # type: ignore[no-untyped-def]
    before = set(my_snapshots())

    async def main() -> None:
        ws = await asyncio.to_thread(Workspace.create)
        await asyncio.to_thread(ENV.setup, ws)
        pre = await asyncio.to_thread(SharedSnapshot.take, ws)
        spec = Speculator(memory="ksm", placement=placement)  # type: ignore[arg-type]
        try:
            await body(ws, pre, spec)
        finally:
            await spec.drain()
            pre.release()
            await asyncio.to_thread(ws.destroy)  # idempotent; the branch may have destroyed it
        assert spec.workspaces.snapshot() == []

    asyncio.run(main())
    assert set(my_snapshots()) == before


PLACEMENTS = pytest.mark.parametrize("placement", ["live", "fork_first"])


@PLACEMENTS
def test_mismatched_speculation_leaves_no_trace(placement: str) -> None:
    async def body(ws: Workspace, pre: SharedSnapshot, spec: Speculator) -> None:
        predicted = [ToolCall("sleeper", {"id": 1}), ToolCall("bump", {"n": 100}), ToolCall("touch", {"name": "spec"})]
        branch = await spec.launch(ws, predicted, TOOLS)
        await _until_completed(branch, 2)  # the policy reasons; the speculative chain runs meanwhile
        actual = ToolCall("touch", {"name": "real"})
        assert await branch.resolve(actual) is None
        rollback = await branch.close()
        try:
            # Nothing adopted: the pre-speculation state (a restored copy with "live", the
            # untouched workspace with "fork_first"); the workspace that ran the chain is gone
            # with everything it wrote and started.
            assert (rollback is ws) == (placement == "fork_first")
            obs = await TOOLS["touch"].run(rollback, actual.args)
            after = await TOOLS["state"].run(rollback, {})
            fresh_obs, fresh_after = await _fresh(pre, [actual])
            assert (obs, after) == (fresh_obs[0], fresh_after)
            assert "sleeper" not in after and "spec" not in after and after.startswith("0\n")
            await spec.drain()  # the chain's workspace is torn down; the rollback lives on
            assert rollback.is_running()
        finally:
            await asyncio.to_thread(rollback.destroy)
        await spec.drain()
        assert not ws.is_running()
        assert branch.wasted_seconds > 0  # it really ran before being discarded
        assert spec.stats["mismatches"] == 1 and spec.stats["hits"] == 0

    _with_workspace(body, placement)


@PLACEMENTS
def test_partial_match_rolls_back_to_the_checkpoint_after_the_last_adopted_call(placement: str) -> None:
    async def body(ws: Workspace, pre: SharedSnapshot, spec: Speculator) -> None:
        a, b, c = (ToolCall("touch", {"name": n}) for n in "abc")
        branch = await spec.launch(ws, [ToolCall("bump", {"n": 4}), a, b], TOOLS)
        await _until_completed(branch, 1)
        hit = await branch.resolve(ToolCall("bump", {"n": 4}))
        assert hit is not None and hit.index == 0
        hit2 = await branch.resolve(a)
        assert hit2 is not None and hit2.index == 1
        assert not branch.exhausted
        assert await branch.resolve(c) is None
        ws2 = await branch.close()
        try:
            obs_c = await TOOLS["touch"].run(ws2, c.args)
            after = await TOOLS["state"].run(ws2, {})
            fresh_obs, fresh_after = await _fresh(pre, [ToolCall("bump", {"n": 4}), a, c])
            assert [hit.observation, hit2.observation, obs_c] == fresh_obs
            assert after == fresh_after and "b" not in after.split()
        finally:
            await asyncio.to_thread(ws2.destroy)
        await spec.drain()
        assert not ws.is_running()  # with fork_first too: stale once call 0 was adopted

    _with_workspace(body, placement)


@PLACEMENTS
def test_full_match_adopts_the_speculative_workspace(placement: str) -> None:
    async def body(ws: Workspace, pre: SharedSnapshot, spec: Speculator) -> None:
        calls = [ToolCall("slow", {"s": 1.5}), ToolCall("bump", {"n": 2})]
        branch = await spec.launch(ws, calls, TOOLS)
        for _ in range(400):  # until the fork runs the slow call
            if branch._started[0] is not None:
                break
            await asyncio.sleep(0.025)
        # Arrives well inside the 1.5 s call: what it still waits for is less than the call took.
        # (Arriving at the call's very start, the event loop's latency in handing the result over
        # could make the wait a few ms longer than the call: a rehearsal saw 1.536 vs 1.531 s.)
        await asyncio.sleep(0.3)
        hit = await branch.resolve(calls[0])
        assert hit is not None and hit.waited_seconds < hit.exec_seconds
        await asyncio.sleep(0.3)
        assert await branch.resolve(calls[1]) is not None and branch.exhausted
        adopted = await branch.close()
        try:
            assert (adopted is ws) == (placement == "live")
            await spec.drain()
            assert adopted.is_running() and (placement == "live" or not ws.is_running())
            fresh_obs, fresh_after = await _fresh(pre, calls)
            assert await TOOLS["state"].run(adopted, {}) == fresh_after
            assert hit.observation == fresh_obs[0]
        finally:
            await asyncio.to_thread(adopted.destroy)

    _with_workspace(body, placement)


def test_unknown_placement_is_a_typed_error() -> None:
    with pytest.raises(ValueError, match="placement"):
        Speculator(placement="elsewhere")  # type: ignore[arg-type]


def test_prediction_respects_determinism_and_tail() -> None:
    a, u = ToolCall("slow", {"s": 1}), ToolCall("uuid")
    sel = ToolSelector(n_features=2**8).fit(
        [SelectorContext("t", ()), SelectorContext("t", (a,)), SelectorContext("t", (a, u))], [a.key, u.key, a.key])
    tail = TailPolicy(slow_tool_seconds=0.5)
    spec = Speculator(sel, depth=3, tail=tail, min_probability=0.0)
    # No timings recorded: nothing is known to be slow, so nothing is worth speculating.
    assert spec.predict("t", 0, [], TOOLS) == []
    tail.record_tool("slow", 2.0)
    assert spec.predict("t", 0, [], TOOLS) == [a]  # the chain stops before the non-deterministic uuid
    tail.record_rollout("t", 0, 1.0)
    tail.record_rollout("other", 0, 10.0)
    tail.task_quantile = 1.0
    assert spec.predict("t", 0, [], TOOLS) == []  # a fast sample: not in the tail


def test_tail_filter_with_two_tasks() -> None:
    """task_quantile 0.5 over 2 tasks is the slower one: round(0.5) == 0 once let both through."""
    tail = TailPolicy(slow_tool_seconds=0.5, task_quantile=0.5)
    tail.record_rollout("fast", 0, 10.0)
    tail.record_rollout("slow", 0, 30.0)
    assert tail.is_tail_sample("slow", 0) and not tail.is_tail_sample("fast", 0)
    tail.record_rollout("mid", 0, 20.0)  # 3 tasks: the median and above
    assert tail.is_tail_sample("mid", 0) and tail.is_tail_sample("slow", 0) and not tail.is_tail_sample("fast", 0)


def test_tail_timings_travel_between_policies_once() -> None:
    """The hosts of a pool learn each other's timings: a journal taken from one, replayed into
    another, is known there as if recorded there, and not journalled a second time."""
    slow = ToolCall("slow", {"s": 1})
    a, b = TailPolicy(slow_tool_seconds=0.5), TailPolicy(slow_tool_seconds=0.5)
    assert a.take_journal() == []  # journalling is off until a journal is set
    a.record_call(slow, 0.1)
    a.journal, b.journal = [], []
    a.record_call(slow, 0.9)
    a.record_rollout("t", 0, 3.0)
    entries = a.take_journal()
    assert len(entries) == 2 and a.take_journal() == []
    assert not b.is_slow(slow)
    b.replay(entries)
    assert b.is_slow(slow) and b.call_seconds(slow) == 0.9 and a.call_seconds(slow) == 0.5
    assert b.take_journal() == []


def test_speculation_refuses_networked_workspaces() -> None:
    fake = SimpleNamespace(id="ws-x", info=lambda: SimpleNamespace(network={"mode": "bridge"}))
    with pytest.raises(SpeculationError):
        _check_isolated(fake)  # type: ignore[arg-type]


def test_the_tail_is_the_task_that_holds_the_slowest_rollouts() -> None:
    """A desktop task whose mean rollout is short but whose slowest one ends the epoch is the
    tail, not a coding task slower on average (a filter on the mean would keep speculation off it)."""
    tail = TailPolicy(slow_tool_seconds=0.5, task_quantile=0.5)
    for t in [40.0] * 9 + [110.0]:
        tail.record_rollout("gui", 0, t)
    for t in [80.0] * 10:
        tail.record_rollout("swe", 0, t)
    assert tail.is_tail_sample("gui", 0) and not tail.is_tail_sample("swe", 0)
