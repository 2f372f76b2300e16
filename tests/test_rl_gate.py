"""Speculation's measured gate (issue 38): a chain runs when its expected saving on the path,
from measured call times and the selector's calibrated probability, exceeds its expected cost
(the rollback of a wrong guess, a snapshot that outlasts the reasoning step)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
from rl_support import counter_task, my_snapshots, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinfork import Workspace
from bunshinrl import EpochResult, FinalAnswer, RolloutEngine, SampleContext, Step, ToolCall, ToolSelector
from bunshinrl.calls import cpu_slots
from bunshinrl.calls.policy import Action
from bunshinrl.calls.tools import Tool
from bunshinrl.rollout.reasoning import ReasoningClock
from bunshinrl.rollout.wiring import CoreConfig, build_core
from bunshinrl.speculation.gate import GateCosts, MeasuredGate
from bunshinrl.speculation.selector import SelectorContext
from bunshinrl.speculation.speculator import Chain, Speculator

TOOLS = counter_task().tools
SLOW, BUMP = ToolCall("slow", {"s": 1}), ToolCall("bump", {"n": 1})


@pytest.fixture
def unlimited_slots() -> Iterator[None]:
    yield
    cpu_slots.configure(None)


def test_the_gate_weighs_saving_against_cost() -> None:
    gate = MeasuredGate()
    times = {SLOW.key: 2.0, BUMP.key: 0.02}

    def seconds(c: ToolCall) -> float | None:
        return times.get(c.key)
    cheap = GateCosts(reasoning=3.0, snapshot=0.1, miss=0.2)
    # Never measured: nothing says it saves anything.
    assert gate.admit([(ToolCall("state"), 0.99)], seconds, cheap) == []
    # A 2 s call, likely, beside a 0.1 s snapshot and a 0.2 s rollback: worth it.
    assert gate.admit([(SLOW, 0.9)], seconds, cheap) == [SLOW]
    # A 20 ms call saves less than a likely rollback costs, however sure the guess.
    assert gate.admit([(BUMP, 0.9)], seconds, cheap) == []
    # The saving is capped by the reasoning step the call hides behind, and a snapshot that
    # outlasts that step is waited for whatever the guess.
    assert gate.admit([(SLOW, 0.9)], seconds, GateCosts(reasoning=0.5, snapshot=1.5, miss=0.2)) == []
    # The chain goes on while what a further call saves beats the rollbacks it risks...
    assert gate.admit([(SLOW, 0.9), (SLOW, 0.9)], seconds, cheap) == [SLOW, SLOW]
    assert gate.admit([(SLOW, 0.9), (BUMP, 0.9)], seconds, cheap) == [SLOW]
    # ...and is weighed whole: a fast observation first, then the slow action the agent takes.
    assert gate.admit([(BUMP, 0.9), (SLOW, 0.9)], seconds, cheap) == [BUMP, SLOW]
    assert gate.stats == {"admitted": 4, "declined_unmeasured": 1, "declined_cost": 2, "declined_slots": 0}
    assert [d["depth"] for d in gate.take_decisions()] == [1, 0, 0, 2, 1, 2]


def test_a_wrong_guess_s_cpu_slot_is_weighed_at_the_slots_load() -> None:
    """A long-shot 20 s test suite hidden behind a long step: worth it on an idle host, not when
    every CPU slot is taken (a wrong guess then holds one a real call waits for)."""
    gate = MeasuredGate()

    def seconds(c: ToolCall) -> float | None:
        return 20.0 if c == SLOW else 0.02

    def slot_seconds(c: ToolCall) -> float:
        return 20.0 if c == SLOW else 0.0
    at = lambda load: GateCosts(reasoning=30.0, snapshot=0.1, miss=0.2, slot_load=load)  # noqa: E731
    assert gate.admit([(SLOW, 0.3)], seconds, at(0.0), slot_seconds) == [SLOW]
    assert gate.admit([(SLOW, 0.3)], seconds, at(0.25), slot_seconds) == [SLOW]
    assert gate.admit([(SLOW, 0.3)], seconds, at(1.0), slot_seconds) == []
    assert gate.admit([(SLOW, 0.3)], seconds, at(None)) == [SLOW]  # no slots: nothing weighed
    # A call that holds no slot costs none, whatever the load.
    assert gate.admit([(BUMP, 0.9), (SLOW, 0.3)], seconds, at(1.0), lambda c: 0.0) == [BUMP, SLOW]
    assert gate.stats["declined_slots"] == 1 and gate.stats["declined_cost"] == 0
    slot_costs = [d["slot_cost"] for d in gate.take_decisions()]
    assert slot_costs[0] == 0 and slot_costs[1] == pytest.approx(0.7 * 20 * 0.25, abs=1e-3)


def test_the_core_weighs_the_slots_it_measures(unlimited_slots: None) -> None:
    """A tool's seconds in a CPU slot are measured as it runs (its execution in the rollouts'
    thread pool), and the gate weighs a guess at the slots' load when the chain is weighed."""
    slots = cpu_slots.configure(1)

    def suite(_ws: Workspace, _args: dict[str, object]) -> str:
        with cpu_slots.cpu_slot():
            sum(range(10_000_000))  # the suite's CPU work, in the slot
        return "passed"
    asyncio.run(Tool("slow", suite).run(None, {}))  # type: ignore[arg-type]
    assert slots.tool_seconds("slow") > 0 and slots.tool_seconds("bump") == 0
    core = build_core(CoreConfig(speculation_depth=1), reasoning=ReasoningClock(model=lambda: 3.0))
    assert core.speculator is not None and core.speculator.gate is not None
    core.speculator.selector = _selector()
    core.tail.record_call(SLOW, 2.0)
    core.note_snapshot("t", 0.05)
    core.speculation_chain("t", 0, [], TOOLS, real_calls=0)
    with slots.hold():  # another sample's suite holds the only slot
        core.speculation_chain("t", 0, [], TOOLS, real_calls=0)
    idle, busy = core.speculator.gate.take_decisions()
    assert idle["slot_load"] == 0 and idle["slot_cost"] == 0
    assert busy["slot_load"] == 1 and 0 < busy["slot_cost"] <= slots.tool_seconds("slow"), busy


def test_guesses_that_fail_lower_the_selector_s_word() -> None:
    gate = MeasuredGate()
    def seconds(c: ToolCall) -> float | None:
        return 1.0 if c == SLOW else None
    costs = GateCosts(reasoning=3.0, snapshot=0.1, miss=1.0)
    assert gate.admit([(SLOW, 0.7)], seconds, costs) == [SLOW]  # 0.7 s saved against 0.3 s
    for _ in range(8):
        gate.record_outcome(0.7, False)  # its confident guesses were all wrong
    assert gate.calibrated(0.7) < 0.5
    assert gate.admit([(SLOW, 0.7)], seconds, costs) == []
    for _ in range(40):
        gate.record_outcome(0.7, True)
    assert gate.admit([(SLOW, 0.7)], seconds, costs) == [SLOW]


def _selector() -> ToolSelector:
    return ToolSelector(n_features=2**8).fit(
        [SelectorContext("t", ()), SelectorContext("t", (SLOW,)), SelectorContext("t", (SLOW, BUMP))] * 4,
        [SLOW.key, BUMP.key, SLOW.key] * 4)


def test_the_core_gates_speculation_by_what_it_measured() -> None:
    """build_core's default: the measured gate, fed by the core's own measurements (the tail's
    call times, the task's snapshot and rollback times, the reasoning clock)."""
    reasoning = [3.0]
    core = build_core(CoreConfig(speculation_depth=2), reasoning=ReasoningClock(model=lambda: reasoning[0]))
    assert core.speculator is not None and core.speculator.gate is not None
    core.speculator.selector = _selector()
    chain = lambda: core.speculation_chain("t", 0, [], TOOLS, real_calls=0)  # noqa: E731
    assert chain() == []  # nothing measured yet
    core.tail.record_call(SLOW, 0.6)  # below the fixed rule's 1 s of the benchmark before
    core.note_snapshot("t", 0.05)
    assert chain() == [SLOW]
    reasoning[0] = 0.2  # a short step caps the saving at 0.2 s; the snapshot now outlasts it...
    core.note_snapshot("t", 1.0)
    core.note_spec_miss("t", 10.0)  # ...and a wrong guess has cost 10 s on the path
    assert chain() == []
    report = core.stats()["speculation"]
    assert report["gate_admitted"] == 1 and report["gate_declined_unmeasured"] == 1
    assert report["gate_declined_cost"] == 1
    # A number keeps the fixed rule, and no gate.
    fixed = build_core(CoreConfig(speculation_depth=2, slow_tool_seconds=1.0))
    assert fixed.speculator is not None and fixed.speculator.gate is None


@pytest.mark.usefixtures("no_own_leaks")
def test_a_branch_reports_its_guess_to_the_gate() -> None:
    """A launched chain carries the selector's probabilities; resolving it wrong lowers the
    calibration the gate weighs the next guesses with."""
    before = set(my_snapshots())

    async def main() -> None:
        ws = await asyncio.to_thread(Workspace.create)
        spec = Speculator(memory="ksm", gate=MeasuredGate())
        try:
            await asyncio.to_thread(counter_task().setup, ws)
            branch = await spec.launch(ws, Chain([BUMP], [0.9]), TOOLS)
            assert await branch.resolve(ToolCall("touch", {"name": "real"})) is None
            back = await branch.close()
            await asyncio.to_thread(back.destroy)
        finally:
            await spec.drain()
            await asyncio.to_thread(ws.destroy)
        assert spec.gate is not None and spec.gate.calibration() == pytest.approx(4 / 4.9)
        assert spec.report()["gate_calibration"] == pytest.approx(4 / 4.9, abs=1e-4)

    asyncio.run(main())
    assert set(my_snapshots()) == before


def test_a_predicted_chain_carries_its_probabilities() -> None:
    core = build_core(CoreConfig(speculation_depth=2), reasoning=ReasoningClock(model=lambda: 3.0))
    assert core.speculator is not None
    core.speculator.selector = _selector()
    core.tail.record_call(SLOW, 2.0)
    core.tail.record_call(BUMP, 2.0)
    chain = core.speculation_chain("t", 0, [], TOOLS, real_calls=0)
    assert isinstance(chain, Chain) and list(chain) == [SLOW, BUMP]
    assert len(chain.probabilities) == 2 and all(0.5 <= p <= 1.0 for p in chain.probabilities)


class _FirstCallSlow:
    """Each sample thinks 1.5 s, then calls the slow tool (1 s), then answers."""

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        await asyncio.sleep(1.5 if not history else 0.05)  # the policy's reasoning
        return SLOW if not history else FinalAnswer("ok")


@pytest.mark.usefixtures("no_own_leaks")
def test_the_first_call_is_speculated_while_the_first_step_is_reasoned() -> None:
    """Spec (no cache): a group forked while its first step is reasoned starts the predicted first
    call on each fork at once, so a slow first call (a test suite) leaves every path."""
    before = set(my_snapshots())
    core = build_core(CoreConfig(speculation_depth=1, keep_initial=True, overlap_fork=True, memory="ksm"),
                      reasoning=ReasoningClock(model=lambda: 1.5))
    engine = RolloutEngine(_FirstCallSlow(), core=core)

    async def main() -> list[EpochResult]:
        out = []
        try:
            for epoch in range(2):
                out.append(await engine.run_epoch([counter_task()], group_size=2, epoch=epoch))
                engine.fit_selector()
        finally:
            await engine.close()
        return out

    first, second = asyncio.run(main())
    assert first.spec_hits == 0 and all(s.count("tool") == 1 for s in first.samples)
    assert second.spec_hits == 2, [[(e.kind, e.detail) for e in s.events] for s in second.samples]
    assert all(s.count("tool") == 0 for s in second.samples)
    assert set(my_snapshots()) == before


def test_a_slow_call_is_worth_a_long_shot() -> None:
    """With the gate, a guess below the speculator's min_probability is weighed: a 5 s call the
    selector gives 0.3-0.4 saves more than its rollback costs (the office export after reading
    the cells back ran on the path: the selector was unsure between it and the final answer)."""
    labels = [SLOW.key, SLOW.key, BUMP.key, ToolCall("touch", {"name": "a"}).key, ToolCall("state").key]
    sel = ToolSelector(n_features=2**8).fit([SelectorContext("t", ())] * len(labels), labels)
    p = sel.top_k(SelectorContext("t", ()), 1)
    assert p[0][0] == SLOW.key and 0.1 < p[0][1] < 0.5
    core = build_core(CoreConfig(speculation_depth=1, min_probability=0.5),
                      reasoning=ReasoningClock(model=lambda: 10.0))
    assert core.speculator is not None
    core.speculator.selector = sel
    core.tail.record_call(SLOW, 5.0)
    core.note_snapshot("t", 0.05)
    assert core.speculation_chain("t", 0, [], TOOLS, real_calls=0) == [SLOW]
    fixed = build_core(CoreConfig(speculation_depth=1, min_probability=0.5, slow_tool_seconds=1.0))
    assert fixed.speculator is not None
    fixed.speculator.selector = sel
    fixed.tail.record_call(SLOW, 5.0)
    assert fixed.speculation_chain("t", 0, [], TOOLS, real_calls=0) == []  # the fixed rule's threshold
