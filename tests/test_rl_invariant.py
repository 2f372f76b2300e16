"""The invariant of bunshinrl: a sample's workspace is exactly the history it was shown. It is
reached only by executing the history's calls, each observing what the sample was shown, or by
forking a state captured by such an execution; when a served step does not reproduce, the sample
is rewound to it, never continued on a state the history does not describe.

`liar` (tests/rl_support.py) claims determinism and observes something new on every call: every
replay of it diverges."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from rl_support import PlanPolicy, counter_task, no_own_leaks, root_only_cache, two_epochs  # noqa: F401 (fixture, used by name)

from bunshinrl import (
    RolloutCore,
    SampleContext,
    SnapshotBackend,
    Speculator,
    Step,
    ToolCall,
    ToolPrefixCache,
)
from bunshinrl.rollout.timeline import EpochResult, SampleTimeline

pytestmark = pytest.mark.usefixtures("no_own_leaks")

C = ToolCall


def plan(epoch: int) -> list[ToolCall]:
    """Bumps around liar, then a call new in each epoch (a miss), then the state."""
    return [C("bump", {"n": 1}), C("liar"), C("bump", {"n": 2}), C("bump", {"n": 3}),
            C("touch", {"name": f"e{epoch}"}), C("state")]


def _assert_state_is_the_history(steps: Sequence[Step]) -> None:
    """The last step is `state`, read on the sample's own workspace: the counter server's value
    and the log of bumps are those of exactly the bumps its history shows."""
    assert steps[-1].call.name == "state"
    bumps = [str(s.call.args["n"]) for s in steps[:-1] if s.call.name == "bump"]
    lines = steps[-1].observation.splitlines()
    assert (lines[0], lines[1:1 + len(bumps)]) == (str(sum(int(b) for b in bumps)), bumps), \
        f"the workspace is not the history it was shown: {[s.call.key for s in steps]} -> {lines}"



@pytest.mark.parametrize("prefetch", [False, True], ids=["on-miss", "warm-shadow"])
def test_a_replay_diverging_mid_plan_rewinds_the_sample(prefetch: bool) -> None:
    """Epoch 0 records the plan; in epoch 1 the sample is served bump, liar, bump, bump from the
    cache and misses at touch. Rebuilding its state replays liar, which observes something else: the
    sample is rewound to that step (its fresh observation), the policy decides again from there,
    and its final state holds every bump its history shows. (Before: the rebuild stopped at the
    divergence and the sample went on in a state without the two later bumps, as gui-2/1 did.)
    warm-shadow: the divergence is found in the background, on the warm workspace kept behind
    the hits, and every later hit's replay passed it on."""
    policy = PlanPolicy(lambda epoch, _sample: plan(epoch), think=0.05)
    first, second = two_epochs(policy, counter_task(), prefetch=prefetch)
    recorded, served = first.samples[0], second.samples[0]
    _assert_state_is_the_history(served.steps)
    assert [s.call for s in served.steps] == plan(1)
    assert served.steps[1].observation != recorded.steps[1].observation  # liar's fresh observation
    assert served.rewound == 1 and served.divergences >= 1 and served.rewound_steps >= 1
    # liar is the plan's second replayed call (on-miss: the rebuild's plan from the root; warm:
    # the shadow had replayed bump already): a mid-plan divergence, in the epoch's JSON too.
    assert served.divergences_mid_plan >= 1 and second.summary()["divergences_mid_plan"] >= 1
    assert policy.asked.count((1, 2)) == 2  # the policy decided step 2 again, after the rewind
    assert second.rewound == 1 and second.summary()["rewound"] == 1
    assert first.summary()["divergences"] == 0
    # Every divergence has an outcome: the rebuild's rewound the sample; warm-shadow: the warm
    # workspace's divergence before it was destroyed, and that rewind answers it.
    outcomes = {k: v for k, v in second.divergence_outcomes.items() if v}
    assert outcomes == ({"rewound": 1, "destroyed_rewound": 1} if prefetch else {"rewound": 1}), outcomes
    assert second.summary()["divergences_unaccounted"] == 0


def test_hits_under_a_removed_node_are_refused() -> None:
    """A tool found non-deterministic drops its subtrees; a sample standing inside one must get
    no hit for its other tools (the tree keeps the removed nodes' children)."""

    class Payloads:
        persists = False

        def size(self, payload: object) -> int:
            return 1

        def release(self, payload: object) -> None:
            pass

    tools = counter_task().tools
    cache = ToolPrefixCache(Payloads(), 1 << 40, background=False)  # type: ignore[arg-type]
    root = cache.add_root("task", "tmpl", object())
    path = [root]
    for call, obs in [(C("liar"), "tick 1"), (C("bump", {"n": 1}), "1"), (C("touch", {"name": "a"}), "a")]:
        node, created = cache.begin(path[-1], call)
        assert created
        cache.complete(node, obs, 0.1)
        path.append(node)
    _root, liar, bump, touch = path
    assert cache.lookup(bump, C("touch", {"name": "a"}), tools["touch"]) is touch
    assert not cache.guard.check(C("liar"), "tick 1", "tick 2", source="replay")  # drops liar's subtree
    assert liar.removed and bump.removed and touch.removed
    assert cache.lookup(bump, C("touch", {"name": "a"}), tools["touch"]) is None
    assert cache.lookup(liar, C("bump", {"n": 1}), tools["bump"]) is None
    below, created = cache.begin(bump, C("state"))  # recorded below a dropped subtree: dropped too
    assert created and below.removed
    cache.complete(below, "x", 0.1)
    assert cache.lookup(bump, C("state"), tools["state"]) is None
    cache.close()


def test_a_sample_standing_on_a_removed_node_is_revalidated_at_its_next_call() -> None:
    """A sample served bump and liar stands on liar's node when liar's subtree is dropped (another
    replay of it diverged). Its next call gets no hit there: its state is rebuilt and every served
    call replayed, liar does not reproduce, and the sample is rewound to it: a divergence under a
    removed node, counted as such."""
    cache = root_only_cache()
    core = RolloutCore(cache=cache, prefetch=False, critical_path_captures=False)
    task = counter_task()

    async def main() -> None:
        a = await core.start(task, SampleContext(task.id, 0, 0))
        try:
            for c in (C("bump", {"n": 1}), C("liar"), C("state")):
                await a.call(c)
        finally:
            await a.close()
        b = await core.start(task, SampleContext(task.id, 1, 0), rewinds=True)
        try:
            await b.call(C("bump", {"n": 1}))
            await b.call(C("liar"))
            assert b.served == ["cache", "cache"] and b.node is not None
            assert not core.guard.check(C("liar"), "tick", "tock", source="replay")  # drops liar's subtree
            assert b.node.removed
            with pytest.raises(Exception) as raised:
                await b.call(C("state"))
            assert type(raised.value).__name__ == "Rewound" and raised.value.step == 1  # type: ignore[attr-defined]
            assert b.timeline.divergences_removed_node == 1 and b.timeline.divergences_mid_plan == 1
            assert b.timeline.divergence_outcomes == ["rewound"]
            await b.call(C("state"))
            _assert_state_is_the_history(b.history)
        finally:
            await b.close()
            await core.close()
            cache.close()

    asyncio.run(main())


def test_the_sibling_race_compares_observations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample misses, and while it gets its workspace a sibling begins the same call and
    records another observation: the sample runs the call itself and may stand on the sibling's
    node only if it observed what the node recorded. It did not: it leaves the tree and the tool
    is marked non-deterministic."""
    cache = ToolPrefixCache(SnapshotBackend(), 1 << 40, background=False)
    core = RolloutCore(cache=cache, prefetch=False, critical_path_captures=False)
    task = counter_task()
    call = C("touch", {"name": "a"})
    planted = []
    lookup = cache.lookup

    def lookup_then_a_sibling_begins(node: Any, c: ToolCall, tool: Any) -> Any:
        hit = lookup(node, c, tool)
        if c == call and not planted:
            sibling, created = cache.begin(node, c)
            assert created and hit is None
            cache.complete(sibling, "what a sibling saw", 0.1)
            planted.append(sibling)
        return hit

    monkeypatch.setattr(cache, "lookup", lookup_then_a_sibling_begins)

    async def main() -> None:
        r = await core.start(task, SampleContext(task.id, 0, 0))
        try:
            assert await r.call(call) == "a\n"
            assert r.node is not planted[0], "placed on a node whose observation it was not shown"
            assert r.node is None and planted[0].removed
            assert core.guard.report()["detected_nondeterministic"] == ["touch"]
            assert r.timeline.divergences == 1 and r.timeline.divergences_sibling_race == 1
            assert r.timeline.divergence_outcomes == ["node_refused"] and r.timeline.sibling_checks == 1
        finally:
            await r.close()
            await core.close()
            cache.close()

    asyncio.run(main())


def test_nothing_speculates_on_a_diverged_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the tree's frontier a predicted chain is speculated on the warm workspace behind the
    hits. When that workspace's replay diverged it is destroyed, not speculated on: the next call
    rebuilds the sample's state, verified, and rewinds it to the step that did not reproduce."""
    cache = root_only_cache()
    spec = Speculator(depth=2)
    core = RolloutCore(cache=cache, speculator=spec, prefetch=True, critical_path_captures=False)
    task = counter_task()
    chain: list[ToolCall] = []
    launched: list[Any] = []

    async def launch(ws: Any, calls: Any, tools: Any, snapshot: Any = None) -> Any:
        launched.append(ws)
        raise RuntimeError("this test launches no branch")

    monkeypatch.setattr(spec, "predict", lambda *a, **k: list(chain))
    monkeypatch.setattr(spec, "launch", launch)

    async def main() -> None:
        a = await core.start(task, SampleContext(task.id, 0, 0))
        try:
            await a.call(C("bump", {"n": 1}))
            recorded = await a.call(C("liar"))
        finally:
            await a.close()
        b = await core.start(task, SampleContext(task.id, 1, 0), rewinds=True)
        try:
            assert await b.call(C("bump", {"n": 1})) == "1"
            chain.append(C("state"))  # from now on the selector predicts a chain
            assert await b.call(C("liar")) == recorded  # served; the frontier: speculate on the warm one
            error = None
            try:
                await b.call(C("state"))
            except Exception as e:
                error = e
            assert launched == [], "a chain was launched on a workspace whose replay diverged"
            assert b.timeline.divergences_speculation == 1 and b.timeline.speculation_checks == 1
            assert type(error).__name__ == "Rewound" and error.step == 1  # type: ignore[union-attr]
            # The warm workspace's divergence (destroyed, the speculation's kind), then the
            # verified rebuild's, which rewound the sample and so answers the first.
            assert b.timeline.divergence_outcomes == ["destroyed_rewound", "rewound"]
            assert b.timeline.invariant()["divergences_unaccounted"] == 0
            assert [s.call for s in b.history] == [C("bump", {"n": 1}), C("liar")]
            assert b.history[1].observation != recorded
            await b.call(C("state"))
            _assert_state_is_the_history(b.history)
        finally:
            await b.close()
            await core.close()
            cache.close()

    asyncio.run(main())


def test_adopting_a_speculative_call_a_sibling_recorded_otherwise_leaves_the_tree(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A speculative branch ran the sample's next call; by the time the sample issues it, a
    sibling has recorded that call under the same node with another observation. The sample
    adopts its own branch's observation and may not stand on the sibling's node."""
    cache = ToolPrefixCache(SnapshotBackend(), 1 << 40, background=False)
    spec = Speculator(depth=1)
    core = RolloutCore(cache=cache, speculator=spec, prefetch=False, critical_path_captures=False)
    task = counter_task()
    nxt = C("touch", {"name": "a"})
    monkeypatch.setattr(spec, "predict", lambda *a, **k: [nxt] if len(a[2]) == 1 else [])

    async def main() -> None:
        r = await core.start(task, SampleContext(task.id, 0, 0), rewinds=True)
        try:
            await r.call(C("bump", {"n": 1}))  # runs for real; the branch then runs touch
            parent = r.node
            assert parent is not None
            sibling, created = cache.begin(parent, nxt)
            assert created
            cache.complete(sibling, "what a sibling saw", 0.1)
            assert await r.call(nxt) == "a\n" and r.served[-1] == "speculation"
            assert r.node is not sibling, "placed on a node whose observation it was not shown"
            assert r.node is None and r.timeline.divergences == 1
            assert r.timeline.divergences_sibling_race == 1 and r.timeline.divergences_speculation == 1
            assert r.timeline.divergence_outcomes == ["node_refused"]
            assert (r.timeline.sibling_checks, r.timeline.speculation_checks) == (1, 1)
        finally:
            await r.close()
            await core.close()
            cache.close()

    asyncio.run(main())


def test_a_driver_that_cannot_rewind_gets_the_trajectory_refused() -> None:
    """verl's and SkyRL's conversations cannot be cut back: their rollouts (rewinds=False) are
    refused at a step that does not reproduce, never continued on a state their history does
    not describe: the call fails, every later call fails, and nothing is scored."""
    cache = root_only_cache()
    core = RolloutCore(cache=cache, prefetch=False, critical_path_captures=False)
    task = counter_task()

    async def main() -> None:
        a = await core.start(task, SampleContext(task.id, 0, 0))
        try:
            await a.call(C("bump", {"n": 1}))
            await a.call(C("liar"))
        finally:
            await a.close()
        b = await core.start(task, SampleContext(task.id, 1, 0))
        try:
            await b.call(C("bump", {"n": 1}))
            await b.call(C("liar"))  # served
            with pytest.raises(Exception, match="did not reproduce"):
                await b.call(C("bump", {"n": 2}))  # a miss: the rebuild replays liar
            with pytest.raises(RuntimeError, match="refused"):
                await b.call(C("state"))
            assert b.refused and await b.finish("done") is None
            assert b.timeline.rewound == 1 and b.timeline.divergence_outcomes == ["refused"]
        finally:
            await b.close()
            await core.close()
            cache.close()

    asyncio.run(main())


def test_the_cluster_driver_acts_again_on_a_rewound_history() -> None:
    """The Ray driver steps a sample on a host; when the host's rollout rewinds (a served step
    did not reproduce), the host answers with the history cut back and the driver's policy acts
    again from there, the call that was cut off never recorded as a step."""
    from bunshinrl.cluster import ClusterEngine
    from bunshinrl.rollout.timeline import SampleTimeline

    fresh = [Step(C("bump", {"n": 1}), "1", 0), Step(C("liar"), "tick fresh", 1)]

    class Host:
        def __init__(self) -> None:
            self.steps: list[Step] = []
            self.rewound = False

        async def calls_left(self, rid: str) -> int:
            return 10

        async def call(self, rid: str, call: ToolCall, decision: int) -> tuple[Step | None, int, list[Step] | None]:
            if len(self.steps) == 4 and not self.rewound:  # the miss at touch: step 1 did not reproduce
                self.rewound, self.steps = True, list(fresh)
                return None, 10, list(self.steps)
            self.steps.append(Step(call, f"obs {call.key}", decision))
            return self.steps[-1], 10, None

        async def finish(self, rid: str, answer: str | None) -> tuple[float | None, list[Step] | None]:
            return 1.0, None

        async def close(self, rid: str) -> tuple[SampleTimeline, list[str]]:
            return SampleTimeline("task", 0, 1, steps=list(self.steps)), []

    class Remote:
        def __init__(self, fn: Any) -> None:
            self.remote = fn

    class Actor:
        def __init__(self, host: Host) -> None:
            self.host = host

        def __getattr__(self, name: str) -> Remote:
            return Remote(getattr(self.host, name))

    host = Host()

    class Pool:
        hosts = ["a"]

        def actor(self, name: str) -> Actor:
            return Actor(host)

    policy = PlanPolicy(lambda epoch, _sample: plan(epoch), think=0.05)
    engine = ClusterEngine(policy, Pool(), max_steps=16)  # type: ignore[arg-type]
    engine._load["a"] = 1
    timeline = asyncio.run(engine._run_sample(counter_task(), SampleContext("task", 0, 1), "a", "r0"))
    assert [s.call for s in timeline.steps] == plan(1)
    assert timeline.steps[:2] == fresh
    assert policy.asked.count((1, 2)) == 2  # asked again at the rewound step


def test_every_divergence_gets_one_outcome_and_the_kinds_are_flagged_once() -> None:
    """The timeline's accounting: a destroyed warm workspace's divergence waits for the sample's
    next verified state (reproduced or rewound), a speculation flag met twice for one divergence
    counts once, and a sample closed with one unverified says so (unresolved)."""
    t = SampleTimeline("t", 0, 0)
    warm = t.diverged(mid_plan=True)
    t.flag_speculation(warm)
    t.flag_speculation(warm)  # a second chain met the same diverged shadow
    assert (t.divergences, t.divergences_speculation) == (1, 1)
    assert t.invariant()["divergences_unaccounted"] == 1
    t.settle_divergences("destroyed_reproduced")
    t.diverged(sibling_race=True, outcome="node_refused")
    t.diverged()
    t.diverged(outcome="rewound")
    t.settle_divergences("destroyed_rewound")
    t.diverged()
    t.settle_divergences("unresolved")
    assert t.divergence_outcomes == ["destroyed_reproduced", "node_refused", "destroyed_rewound", "rewound",
                                     "unresolved"]
    inv = t.invariant()
    assert inv["divergences_unaccounted"] == 0 and inv["outcome_unresolved"] == 1
    r = EpochResult(0, 1.0, [t, SampleTimeline("t", 1, 0)], [])
    assert sum(r.divergence_outcomes.values()) == r.divergences == 5
    assert r.summary()["outcome_node_refused"] == 1
    with pytest.raises(ValueError):
        t.diverged(outcome="ignored")
