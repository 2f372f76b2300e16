"""RolloutEngine end to end on a tiny batch of real workspaces: Base, Spec and Full configurations
observe exactly the same, and caching/speculation serve calls without running them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from rl_support import counter_task, my_snapshots, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinrl import (
    DeterminismGuard,
    FinalAnswer,
    RolloutEngine,
    SampleContext,
    SnapshotBackend,
    Speculator,
    Step,
    TailPolicy,
    ToolCall,
    ToolPrefixCache,
)
from bunshinrl.calls.policy import Action

# Host-wide leak checks also see other processes' workspaces; this one checks our own.
pytestmark = pytest.mark.usefixtures("no_own_leaks")

C = ToolCall
COMMON = [C("touch", {"name": "a"}), C("bump", {"n": 1}), C("sleeper", {"id": 7}), C("slow", {"s": 0.4})]
SCRIPTS = {
    0: [*COMMON, C("state")],
    1: [*COMMON, C("uuid"), C("state")],
    2: [COMMON[0], COMMON[1], C("touch", {"name": "z"}), C("slow", {"s": 0.4}), C("state")],
}


class ScriptedPolicy:
    """Sample i emits SCRIPTS[i]; it thinks 0.15 s per step (later samples a little longer), and
    0.8 s before the slow call, long enough for a speculative fork to get it going."""

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        before_slow = len(history) == 3
        await asyncio.sleep((0.8 if before_slow else 0.15) + 0.05 * ctx.sample)
        script = SCRIPTS[ctx.sample]
        return script[len(history)] if len(history) < len(script) else FinalAnswer("ok")


def _deterministic_observations(result) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    return {k: [o for o, c in zip(v, SCRIPTS[int(k.split("/")[1])], strict=True) if c.name != "uuid"]
            for k, v in result.observations().items()}


def test_engine_configurations_observe_identically(tmp_path: Path) -> None:
    snaps_before = set(my_snapshots())
    tasks = [counter_task()]

    async def run(engine: RolloutEngine, epochs: int, fit: bool = False) -> list:
        out = []
        for e in range(epochs):
            out.append(await engine.run_epoch(tasks, group_size=3, epoch=e))
            if fit:
                engine.fit_selector()
        return out

    async def main() -> None:
        base = await run(RolloutEngine(ScriptedPolicy(), memory_interval=0.1), 2)
        guard = DeterminismGuard()
        cache = ToolPrefixCache(SnapshotBackend(tmp_path / "store"), 1 << 40, guard=guard,
                                snapshot_every=2, snapshot_slower_than=0.3)
        spec = Speculator(depth=2, tail=TailPolicy(slow_tool_seconds=0.3))
        try:
            full = await run(RolloutEngine(ScriptedPolicy(), cache=cache, speculator=spec, guard=guard,
                                           memory_interval=0.1), 2, fit=True)
        finally:
            await asyncio.to_thread(cache.close)
        spec_only = await run(RolloutEngine(ScriptedPolicy(), speculator=Speculator(
            depth=2, tail=TailPolicy(slow_tool_seconds=0.3)), memory_interval=0.1), 2, fit=True)

        for results in (full, spec_only):
            for b, r in zip(base, results, strict=True):
                assert _deterministic_observations(r) == _deterministic_observations(b)
                assert all(not s.errors for s in r.samples), [s.errors for s in r.samples]
        for r in base + full + spec_only:
            assert r.peak_memory_bytes > 0 and r.memory_byte_seconds > 0 and r.seconds > 0
            assert r.tool_calls == sum(len(s) for s in SCRIPTS.values())
            for s in r.samples:
                assert s.count("reason") == len(SCRIPTS[s.sample]) + 1
                served = ("tool", "cache_hit", "sibling_wait", "spec_hit")
                assert sum(s.count(k) for k in served) == len(SCRIPTS[s.sample])

        # Epoch 0: siblings repeating a prefix wait for (not a hit), or reuse, the first sample's calls.
        assert full[0].cache_hits + full[0].sibling_waits >= 3
        # Epoch 1: every call of the repeated scripts is served from the cache, except the
        # non-deterministic uuid and what follows it (its state is not reproducible).
        assert full[1].cache_hits == full[1].tool_calls - 2
        uuid_sample = next(s for s in full[1].samples if s.sample == 1)
        assert [e.detail for e in uuid_sample.events if e.kind == "tool"] == [C("uuid").key, C("state").key]
        # Speculation, once the selector has seen an epoch, runs the slow call ahead of the policy.
        assert spec_only[1].spec_hits >= 1 and spec_only[0].spec_hits == 0
        assert full[1].cache["hits"] > 0 and full[1].guard["declared_nondeterministic"] == ["uuid"]

    asyncio.run(main())
    assert set(my_snapshots()) == snaps_before


def test_audit_marks_a_lying_tool_and_serves_fresh_observations() -> None:
    tasks = [counter_task()]

    class Liar:
        async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
            await asyncio.sleep(0.05)
            script = [C("touch", {"name": "a"}), C("liar"), C("state")]
            return script[len(history)] if len(history) < len(script) else FinalAnswer("ok")

    async def main() -> None:
        guard = DeterminismGuard(audit_rate=1.0)
        cache = ToolPrefixCache(SnapshotBackend(), 1 << 40, guard=guard)
        engine = RolloutEngine(Liar(), cache=cache, guard=guard)
        try:
            r0 = await engine.run_epoch(tasks, 1, 0)
            r1 = await engine.run_epoch(tasks, 1, 1)
        finally:
            await asyncio.to_thread(cache.close)
        liar0 = r0.samples[0].steps[1].observation
        liar1 = r1.samples[0].steps[1].observation
        assert liar0 != liar1  # the fresh observation, not the recorded one
        report = r1.guard
        assert report["detected_nondeterministic"] == ["liar"] and report["audits"] >= 2
        assert r1.cache_hits == 0  # audited hits are re-executed, not counted as served
        assert all(e.kind != "cache_hit" for e in r1.samples[0].events)

    asyncio.run(main())
