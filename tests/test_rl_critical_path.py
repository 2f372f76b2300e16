"""The rollout core keeps captures and forks off the critical path, on real workspaces: a capture
that would outlast the next reasoning step is not started, a hit's warm workspace is adopted by a
later miss, persistence runs between epochs (and may still run when the next one starts)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from rl_support import counter_task, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinrl import RolloutEngine, SnapshotBackend, ToolCall, ToolPrefixCache
from bunshinrl.calls.policy import Action, FinalAnswer, SampleContext, Step
from bunshinrl.rollout.reasoning import ReasoningClock
from bunshinrl.rollout.wiring import CoreConfig, build_core

pytestmark = pytest.mark.usefixtures("no_own_leaks")

C = ToolCall


class Scripted:
    """scripts[epoch][sample]; thinks `think` seconds per step, `long` before the step listed in
    long_at (by history length)."""

    def __init__(self, scripts: dict[int, dict[int, list[ToolCall]]], think: float = 0.1, long: float = 0.1,
                 long_at: Sequence[int] = ()) -> None:
        self.scripts, self.think, self.long, self.long_at = scripts, think, long, set(long_at)

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        await asyncio.sleep(self.long if len(history) in self.long_at else self.think)
        script = self.scripts[ctx.epoch][ctx.sample]
        return script[len(history)] if len(history) < len(script) else FinalAnswer("ok")


def _engine(policy: Any, predicted: float, prefetch: bool = True, store: Path | None = None) -> RolloutEngine:
    core = build_core(CoreConfig(cache_bytes=1 << 40, store=store, prefetch=prefetch),
                      reasoning=ReasoningClock(model=lambda: predicted))
    return RolloutEngine(policy, core=core, memory_interval=0.1)


async def _epochs(engine: RolloutEngine, n: int, group: int = 1) -> list[Any]:
    out = []
    try:
        for e in range(n):
            out.append(await engine.run_epoch([counter_task()], group, e))
            await engine.persistence()
    finally:
        await engine.close()
        assert engine.cache is not None
        await asyncio.to_thread(engine.cache.close)
    return out


def test_a_capture_never_lands_on_the_path_when_it_would_outlast_the_next_step() -> None:
    """The slow call's state is worth a capture by cost (its replay takes longer than a capture).
    Predicted reasoning shorter than a capture: the capture is not started, so the next call
    never waits for one. Predicted long while the policy in fact answers at once: the capture is
    started, the prediction was wrong, and the wait is counted as post_wait on the path."""
    # Two samples of one script: the second comes by every state the first makes (a revisit).
    calls = [C("bump", {"n": 1}), C("slow", {"s": 1.0}), C("touch", {"name": "a"}), C("state")]
    script = {0: {0: calls, 1: calls}}

    async def main() -> None:
        short = await _epochs(_engine(Scripted(script, think=0.05), predicted=0.01), 1, group=2)
        # The policy answers at once: a capture (tens of ms) cannot end before the next call.
        wrong = await _epochs(_engine(Scripted(script, think=0.0), predicted=30.0), 1, group=2)
        s, w = short[0], wrong[0]
        assert all(not x.errors for r in (s, w) for x in r.samples), [x.errors for r in (s, w) for x in r.samples]
        assert all(x.count("post_wait") == 0 for x in s.samples)
        assert s.cache["captures_off_path"] >= 1 and s.cache["captured"] == 1  # the root only
        assert w.cache["captured"] >= 2 and w.cache["captures_off_path"] == 0
        assert sum(x.seconds("post_wait") for x in w.samples) > 0  # the misprediction, paid and reported

    asyncio.run(main())


def test_a_hits_warm_workspace_is_adopted_by_a_later_miss_without_a_fork_on_the_path() -> None:
    """Epoch 1 repeats epoch 0's prefix (hits) and then leaves it (a miss). With warm workspaces
    the miss finds its workspace already at the state (replayed or forked while the policy
    reasoned); without, the miss forks (and replays) on its path."""
    prefix = [C("bump", {"n": 1}), C("slow", {"s": 0.8}), C("touch", {"name": "a"})]
    script = {0: {0: [*prefix, C("state")]}, 1: {0: [*prefix, C("bump", {"n": 5}), C("state")]}}

    async def miss_wait(prefetch: bool) -> tuple[float, list[str]]:
        # Long reasoning before the miss: time enough for the warm workspace to be ready.
        policy = Scripted(script, think=0.3, long=3.0, long_at=[3])
        r = await _epochs(_engine(policy, predicted=5.0, prefetch=prefetch), 2)
        tl = r[1].samples[0]
        assert not tl.errors, tl.errors
        assert tl.count("cache_hit") == 3 and tl.count("tool") >= 1
        return tl.seconds("materialize"), [e.detail for e in tl.events if e.kind == "materialize"]

    async def main() -> None:
        warm, warm_how = await miss_wait(True)
        cold, cold_how = await miss_wait(False)
        assert warm < 0.05, warm  # adopted: nothing rebuilt on the path
        assert cold > 0.05 and cold > 3 * warm, (warm, cold)
        # The event says what the path waited for: the warm workspace, or the rebuild's plan.
        assert warm_how == ["warm"], warm_how
        assert len(cold_how) == 1 and cold_how[0].startswith("rebuilt from memory at depth "), cold_how

    asyncio.run(main())


class GatedBackend(SnapshotBackend):
    """The real backend whose persist waits for a gate: persistence that outlasts the gap."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.started = threading.Event()

    def persist(self, payload: Any, parent_ref: str | None) -> Any:
        self.started.set()
        if not self.gate.wait(60):
            raise TimeoutError("gate never opened")
        return super().persist(payload, parent_ref)


def test_persistence_still_running_when_the_next_epoch_starts(tmp_path: Path) -> None:
    """Persistence waits for the epoch's end, and the next epoch does not wait for it: it serves
    its hits from memory while the states are still being written."""
    script = {e: {0: [C("bump", {"n": 1}), C("slow", {"s": 0.6}), C("state")]} for e in range(2)}

    async def main() -> None:
        backend = GatedBackend(tmp_path / "store")
        cache = ToolPrefixCache(backend, 1 << 40, snapshot_policy="cost", persist_between_epochs=True)
        core = build_core(CoreConfig(), cache=cache, reasoning=ReasoningClock(model=lambda: 5.0))
        engine = RolloutEngine(Scripted(script, think=0.2), core=core, memory_interval=0.1)
        try:
            first = await engine.run_epoch([counter_task()], 1, 0)
            assert cache.counters["persisted"] == 0  # nothing written during the epoch
            await asyncio.to_thread(backend.started.wait, 30)
            second = await engine.run_epoch([counter_task()], 1, 1)
            assert engine.persist_running_at_start
            assert cache.counters["persisted"] == 0
            assert second.cache_hits == 3 and not second.samples[0].errors
            assert [s.observation for s in second.samples[0].steps] == [s.observation for s in first.samples[0].steps]
            backend.gate.set()
            took = await engine.persistence()
            assert took > 0 and cache.counters["persisted"] >= 1 and cache.stats()["on_disk"] >= 1
        finally:
            backend.gate.set()
            await engine.close()
            await asyncio.to_thread(cache.close)

    asyncio.run(main())
