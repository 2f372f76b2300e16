"""The contracts bunshinrl's parts hold one another to: a sample's state machine moves along its
edges only (IllegalTransition otherwise), the selector refuses to predict before it is fitted
(NotFittedError), and check_policy / check_backend, for adapter authors, pass the real policy
and backend and name what a broken one breaks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest
from rl_support import counter_task, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinfork import AsyncWorkspace, Workspace
from bunshinrl import (
    ContractError,
    FinalAnswer,
    SampleContext,
    SharedSnapshot,
    SnapshotBackend,
    Speculator,
    Step,
    ToolCall,
    ToolSelector,
    check_backend,
    check_policy,
)
from bunshinrl.calls.policy import Action
from bunshinrl.rollout.sample_state import (
    TRANSITIONS,
    Closed,
    Idle,
    IllegalTransition,
    Live,
    Settling,
    Speculating,
    transition,
)
from bunshinrl.rollout.timeline import EpochResult, SampleTimeline
from bunshinrl.speculation.selector import NotFittedError, SelectorContext, is_fitted

# ---- the sample's state machine ----


def _one_of_each() -> dict[type, Any]:
    loop = asyncio.new_event_loop()
    try:
        fut = loop.create_future()
    finally:
        loop.close()
    ws = object()
    return {Idle: Idle(), Live: Live(ws), Settling: Settling(ws, fut),  # type: ignore[arg-type]
            Speculating: Speculating(object()), Closed: Closed()}  # type: ignore[arg-type]


def test_a_sample_state_moves_along_its_edges_only() -> None:
    states = _one_of_each()
    kinds = [None, *states]
    for before in kinds:
        for after in states:
            b = None if before is None else states[before]
            if (before, after) in TRANSITIONS:
                assert transition(b, states[after]) is states[after]
            else:
                with pytest.raises(IllegalTransition, match="cannot go from"):
                    transition(b, states[after])
    # The edges that must not exist: nothing leaves Closed, a branch is only ever entered by
    # settling, a live workspace is never replaced by another without passing through the tree.
    for edge in [(Closed, Live), (Closed, Idle), (Live, Speculating), (Idle, Speculating), (Live, Live),
                 (None, Closed), (None, Speculating)]:
        assert edge not in TRANSITIONS, edge


# ---- the selector ----


def test_the_selector_refuses_to_predict_before_it_is_fitted() -> None:
    sel = ToolSelector()
    ctx = SelectorContext("t", ())
    assert not is_fitted(sel) and not is_fitted(None)
    with pytest.raises(NotFittedError):
        sel.top_k(ctx, 1)
    with pytest.raises(NotFittedError):
        sel.predict_chain(ctx, 2)
    # The speculator asks first: an unfitted selector predicts no chain, it raises nothing.
    assert Speculator(sel).predict("t", 0, [], {}) == []
    sel.fit([ctx, SelectorContext("t", (ToolCall("a"),))], [ToolCall("a").key, "<final>"])
    assert is_fitted(sel) and sel.top_k(ctx, 1)[0][0] in (ToolCall("a").key, "<final>")


# ---- check_policy ----


class KeyedPolicy:
    """Draws by (sample, step), as the benchmark's agent does: a rewound sample decides again
    what it decided before."""

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        rng = random.Random(f"{ctx.task_id}/{ctx.sample}/{len(history)}")
        return ToolCall("bump", {"n": rng.randint(1, 9)}) if len(history) < 3 else FinalAnswer("done")


class SharedStreamPolicy:
    """One random stream for every call: what it answers depends on how often it was asked."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        return ToolCall("bump", {"n": self.rng.randint(1, 10**6)})


class TextPolicy:
    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        return "bump 1"  # type: ignore[return-value]


class SyncPolicy:
    def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        return FinalAnswer("done")


def test_check_policy_passes_a_keyed_policy_and_names_what_a_broken_one_breaks() -> None:
    check_policy(KeyedPolicy())
    with pytest.raises(ContractError, match="key its randomness by"):
        check_policy(SharedStreamPolicy())
    with pytest.raises(ContractError, match="must return a ToolCall"):
        check_policy(TextPolicy())
    with pytest.raises(ContractError, match="coroutine function"):
        check_policy(SyncPolicy())  # type: ignore[arg-type]


# ---- check_backend ----


class SameWorkspaceBackend(SnapshotBackend):
    """Hands every hit the one workspace it forked first: two samples would share a state."""

    def __init__(self) -> None:
        super().__init__()
        self.first: Workspace | None = None

    async def fork(self, payload: SharedSnapshot) -> Workspace:
        if self.first is None:
            self.first = await payload.fork_async()
        return self.first


class NegativeSizeBackend(SnapshotBackend):
    def size(self, payload: SharedSnapshot) -> int:
        return -1


class StoppedForkBackend(SnapshotBackend):
    async def fork(self, payload: SharedSnapshot) -> Workspace:
        ws = await payload.fork_async()
        await AsyncWorkspace(ws).destroy()
        return ws


@pytest.mark.usefixtures("no_own_leaks")
def test_check_backend_passes_the_snapshot_backend_and_names_what_a_broken_one_breaks() -> None:
    task = counter_task()
    ws = Workspace.create(**task.spec)
    try:
        task.setup(ws)  # type: ignore[misc]
        snap = SharedSnapshot.take(ws)
    finally:
        ws.destroy()
    try:
        check_backend(SnapshotBackend(), snap)
        same = SameWorkspaceBackend()
        with pytest.raises(ContractError, match="returned the same workspace"):
            check_backend(same, snap)
        with pytest.raises(ContractError, match="size"):
            check_backend(NegativeSizeBackend(), snap)
        with pytest.raises(ContractError, match="not running"):
            check_backend(StoppedForkBackend(), snap)
    finally:
        snap.release()


# ---- the divergence kinds in the results ----


def test_divergence_kinds_are_counted_and_reach_the_epochs_json() -> None:
    a, b = SampleTimeline("t", 0, 0), SampleTimeline("t", 1, 0)
    a.diverged(mid_plan=True)
    a.diverged(removed_node=True, mid_plan=True)
    b.diverged(sibling_race=True, speculation=True)
    r = EpochResult(0, 1.0, [a, b], [])
    assert r.divergences == 3
    assert r.divergence_kinds == {"mid_plan": 2, "removed_node": 1, "speculation": 1, "sibling_race": 1}
    summary = r.summary()
    for k, v in r.divergence_kinds.items():
        assert summary[f"divergences_{k}"] == v
    kept = {"divergences", "divergence_seconds", "rewound", "rewound_steps", "rewound_seconds", "rerolled"}
    assert kept <= set(summary)


def test_a_rerolled_trajectory_counts_the_discarded_attempts_divergences_as_rerolled() -> None:
    """verl's re-roll: the scored attempt's metrics gain the discarded one's divergences, each
    with its outcome (what the discarded rollout refused was re-rolled), so none is unaccounted."""
    from types import SimpleNamespace

    from bunshinrl.adapters.runtime import with_discarded_attempt

    first = SampleTimeline("t", 0, 0)
    first.diverged(mid_plan=True, outcome="refused")
    first.diverged(sibling_race=True, outcome="node_refused")
    first.divergence_seconds = 1.5
    scored = SampleTimeline("t", 0, 0).invariant()
    m = with_discarded_attempt(scored, SimpleNamespace(timeline=first))  # type: ignore[arg-type]
    assert (m["divergences"], m["rerolled"], m["divergence_seconds"]) == (2, 1, 1.5)
    assert (m["outcome_rerolled"], m["outcome_node_refused"], m["outcome_refused"]) == (1, 1, 0)
    assert (m["divergences_mid_plan"], m["divergences_sibling_race"], m["divergences_unaccounted"]) == (1, 1, 0)
