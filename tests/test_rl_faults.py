"""Fault injection (bunshinrl.envs.faults, issue 37's proof): tools that now and then observe a
token of the sample running them. The draws are keyed, so a run is reproducible; another
sample's replay of a faulted call diverges and is caught; the audit, each step re-executed as
the execution its mark names, finds every trajectory reproducible; the guard with its
auto-disable off keeps the faulty tool cached."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rl_support import PlanPolicy, counter_task, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinrl import RolloutEngine, Task, ToolCall
from bunshinrl.calls.tools import Tool
from bunshinrl.envs.faults import (
    MARK,
    FaultAuditor,
    FaultGuard,
    KeyedPolicy,
    fault_token,
    inject_faults,
    producer,
    running_as,
)
from bunshinrl.rollout.audit import cache_roots
from bunshinrl.rollout.wiring import CoreConfig, build_core

C = ToolCall


def test_fault_draws_are_keyed_by_the_sample_and_the_call() -> None:
    who = ("task", 0, 1)
    assert fault_token(7, who, C("bump", {"n": 1}), 1.0) == fault_token(7, who, C("bump", {"n": 1}), 1.0)
    assert fault_token(7, who, C("bump", {"n": 1}), 1.0) != fault_token(7, ("task", 0, 2), C("bump", {"n": 1}), 1.0)
    assert fault_token(7, who, C("bump", {"n": 1}), 0.0) is None
    fired = sum(fault_token(3, ("t", e, s), C("bump", {"n": i}), 0.05) is not None
                for e in range(4) for s in range(10) for i in range(100))
    assert 0.04 <= fired / 4000 <= 0.06


def test_a_faulty_tool_injects_only_when_run_as_a_sample() -> None:
    tool = Tool("echo", lambda ws, args: "out")
    faulty = inject_faults(Task("x", "p", [tool], lambda ws: None), 1.0, seed=5).agent_tools["echo"]

    async def run(who: tuple[str, int, int] | None) -> str:
        running_as.set(who)
        return await faulty.run(None, {})  # type: ignore[arg-type]

    assert asyncio.run(run(None)) == "out"  # check_family, a tool run by hand: nothing injected
    mine, again, other = (asyncio.run(run(w)) for w in (("x", 0, 1), ("x", 0, 1), ("x", 0, 2)))
    assert mine.startswith(f"out\n{MARK}x/0/1 ") and mine == again and other != mine
    assert producer(mine) == ("x", 0, 1) and producer(other) == ("x", 0, 2) and producer("out") is None


def test_the_guard_with_auto_disable_off_keeps_the_tool_and_drops_its_subtrees_each_time() -> None:
    guard = FaultGuard()
    dropped: list[str] = []
    guard.on_nondeterministic(dropped.append)
    tool = Tool("bump", lambda ws, args: "")
    assert guard.check(C("bump", {"n": 1}), "1", "1", source="replay")
    for _ in range(2):
        assert not guard.check(C("bump", {"n": 1}), "1", "1 [x]", source="replay")
        assert guard.reusable(tool)
    assert dropped == ["bump", "bump"] and len(guard.findings) == 2
    assert guard.report()["auto_disable"] is False


def plan(epoch: int) -> list[ToolCall]:
    return [C("bump", {"n": 1}), C("bump", {"n": 2}), C("touch", {"name": "a"}), C("bump", {"n": 3}),
            C("touch", {"name": f"e{epoch}"}), C("state")]


@pytest.mark.usefixtures("no_own_leaks")
def test_injected_faults_are_caught_and_every_trajectory_passes_the_audit() -> None:
    """The samples of a group follow one plan at once and epoch 1's are served epoch 0's
    recordings; about half of the calls carry a token of the sample that ran them, so a sample
    placed on a node another sample created (the begin() race) or served its recording observes
    something else: each such divergence is caught and counted. The audit finds 0 mismatches,
    and the state read at the end is exactly the bumps each history shows."""
    task = inject_faults(counter_task("faults"), 0.5, seed=11)
    # Only the root is captured: every state below it is rebuilt by replaying, and compared.
    core = build_core(CoreConfig(cache_bytes=1 << 30, snapshot_every=100, persist_between_epochs=False,
                                 critical_path_captures=False), guard=FaultGuard())
    engine = RolloutEngine(KeyedPolicy(PlanPolicy(lambda epoch, _sample: plan(epoch), think=0.05)), core=core)
    auditor = FaultAuditor([task], mode="all", root=cache_roots(core))

    async def main() -> list[Any]:
        try:
            out = []
            for e in (0, 1):
                r = await engine.run_epoch([task], group_size=3, epoch=e)
                out.append((r, await auditor.audit(r)))
            return out
        finally:
            await auditor.close()
            await engine.close()
            assert core.cache is not None
            core.cache.close()

    epochs = asyncio.run(main())
    print("per epoch:", [r.invariant() for r, _ in epochs])
    assert sum(r.divergences for r, _ in epochs) >= 1
    for r, audit in epochs:
        assert audit.mismatches == 0 and audit.errors == 0 and len(audit.samples) == 3, audit.summary()
        for s in r.samples:
            state = s.steps[-1]
            assert state.call.name == "state", [x.call.key for x in s.steps]
            bumps = [int(x.call.args["n"]) for x in s.steps if x.call.name == "bump"]
            assert state.observation.splitlines()[0] == str(sum(bumps))
