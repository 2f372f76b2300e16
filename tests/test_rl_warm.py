"""The warm policy (bunshinrl.rollout.warm_policy): behind a cache hit a warm workspace is kept
only where the next call is predicted to miss. Where it is not kept, no work runs behind the
hit, and the invariant still holds: a later miss, or a finish, rebuilds the sample's state from
the deepest captured state on its path and compares every served call replayed there.

Epoch 0 records each plan with a group of three (so each recorded node has been hit), epoch 1
follows a plan again with one sample."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rl_support import PlanPolicy, no_own_leaks, root_only_cache, setup, tools  # noqa: F401 (fixture, used by name)

from bunshinfork import Workspace
from bunshinrl import (
    RolloutCore,
    RolloutEngine,
    SnapshotBackend,
    Task,
    Tool,
    ToolCall,
)
from bunshinrl import ToolPrefixCache as Cache
from bunshinrl.prefix.tree import Node
from bunshinrl.rollout.warm_policy import check_warm_policy, hit_probability
from bunshinrl.speculation.selector import Trajectory, train_selector

pytestmark = pytest.mark.usefixtures("no_own_leaks")

C = ToolCall
LINE = [C("bump", {"n": 1}), C("bump", {"n": 2}), C("bump", {"n": 3}), C("touch", {"name": "a"}), C("state")]


# `flaky` observes "same" while the epoch-0 recording is made and "changed" afterwards: every
# replay of it in epoch 1 diverges (rl_support's liar diverges in epoch 0 already, among the
# group's replays, and the guard would drop its subtree before epoch 1).
FLIPPED = {"after": False}


def flaky(ws: Workspace, args: dict[str, Any]) -> str:
    return "changed" if FLIPPED["after"] else "same"


def flaky_task() -> Task:
    return Task("task", "Bump the counter.", [*tools(), Tool("flaky", flaky)], setup, fingerprint="rl-test-warm-v1")


def run(plans: Any, warm: str, cache: Cache) -> tuple[list[Any], RolloutCore, dict[str, int]]:
    """Epoch 0 at G=3, epoch 1 at G=1 (`flaky` flipped between them); the core, and the cache's
    forks and replays in epoch 1."""
    core = RolloutCore(cache=cache, warm=check_warm_policy(warm), critical_path_captures=False)
    engine = RolloutEngine(PlanPolicy(plans, think=0.05), core=core)

    async def main() -> tuple[list[Any], dict[str, int]]:
        try:
            first = await engine.run_epoch([flaky_task()], group_size=3, epoch=0)
            await core.drain()
            before = dict(cache.counters)
            FLIPPED["after"] = True
            second = await engine.run_epoch([flaky_task()], group_size=1, epoch=1)
            await core.drain()
            work = {k: cache.counters[k] - before[k] for k in ("forks", "replayed_calls")}
            return [first, second], work
        finally:
            FLIPPED["after"] = False
            await engine.close()
            cache.close()

    results, work = asyncio.run(main())
    return results, core, work


def every_state_cache() -> Cache:
    return Cache(SnapshotBackend(), 1 << 40, snapshot_every=1, background=False)


def test_a_sample_served_to_the_end_runs_nothing_behind_its_hits() -> None:
    """The whole plan is served from the cache. Eager ("always"), each hit brings the warm
    workspace to its state (a fork or a replay per hit); "predicted" keeps one only at the
    frontier (the last state, before the finish), and the sample ends in the same state."""
    work, served = {}, {}
    for warm in ("always", "predicted"):
        (first, second), core, work[warm] = run(lambda e, s: LINE, warm, every_state_cache())
        sample = second.samples[0]
        assert sample.count("cache_hit") == len(LINE) and sample.count("tool") == 0
        assert sample.steps[-1].observation == first.samples[0].steps[-1].observation
        assert sample.divergences == 0
        served[warm] = core.warm_stats
    assert served["always"]["skipped"] == 0
    # Epoch 1's hits: the first four have a child every earlier visitor went on to; the last is
    # the frontier. (Epoch 0's hits are its second and third samples', counted too.)
    assert served["predicted"]["skipped"] >= len(LINE) - 1
    ops = {w: work[w]["forks"] + work[w]["replayed_calls"] for w in work}
    assert ops["predicted"] < ops["always"], work


def test_the_invariant_holds_without_a_warm_workspace_at_a_miss() -> None:
    """No warm workspace behind bump, flaky, bump, bump (each predicted to hit): the miss at
    touch rebuilds the state from the root, replaying flaky, which observes something else: the
    sample is rewound to flaky and its final state holds every bump its history shows. No warm
    workspace was there to diverge first (eager: destroyed_rewound beside the rewind)."""
    def plans(epoch: int, sample: int) -> list[ToolCall]:
        return [C("bump", {"n": 1}), C("flaky"), C("bump", {"n": 2}), C("bump", {"n": 3}),
                C("touch", {"name": f"e{epoch}"}), C("state")]

    (_, second), core, _ = run(plans, "predicted", root_only_cache())
    sample = second.samples[0]
    bumps = [str(s.call.args["n"]) for s in sample.steps[:-1] if s.call.name == "bump"]
    lines = sample.steps[-1].observation.splitlines()
    assert (lines[0], lines[1:1 + len(bumps)]) == (str(sum(int(b) for b in bumps)), bumps)
    assert sample.rewound == 1
    assert {k: v for k, v in second.divergence_outcomes.items() if v} == {"rewound": 1}
    assert core.warm_stats["skipped"] >= 4


def test_a_finish_the_policy_did_not_foresee_is_verified() -> None:
    """At `state` the record says the sample goes on (two of three earlier visitors touched z),
    so no warm workspace is kept; this sample finishes there instead. Nothing is finalised on an
    unverified state: finish() rebuilds it, the replay of flaky diverges, and the sample is
    rewound (without this, it would end on steps no workspace had reproduced)."""
    def plans(epoch: int, sample: int) -> list[ToolCall]:
        line = [C("bump", {"n": 1}), C("flaky"), C("state")]
        return [*line, C("touch", {"name": "z"})] if epoch == 0 and sample < 2 else line

    (_, second), core, _ = run(plans, "predicted", root_only_cache())
    sample = second.samples[0]
    assert sample.rewound == 1, sample.summary()
    assert core.warm_stats["skipped"] >= 3


def test_the_hit_probability_comes_from_the_selector_once_fitted() -> None:
    root = Node("r", None, None, "t", "d", 0)
    assert hit_probability(root, "t", [], None) == 0.0  # the frontier: nothing to hit
    a = Node("a", root, C("bump", {"n": 1}), "t", "d", 1)
    root.children[a.call.key] = a  # type: ignore[union-attr]
    assert hit_probability(root, "t", [], None) == pytest.approx(1 / 3)  # one visitor, who created it
    a.hits = 4
    assert hit_probability(root, "t", [], None) == pytest.approx(5 / 7)
    reward = Node("w", root, C("__reward__"), "t", "d", 1)
    root.children[reward.call.key] = reward  # type: ignore[union-attr]
    reward.hits = 9  # finishing is no hit: the state is verified first
    assert hit_probability(root, "t", [], None) == pytest.approx(5 / 17)
    # Fitted: 3 of 4 recorded trajectories went on to bump(1) from the start.
    trajs = [Trajectory(0, "t", i, (C("bump", {"n": 1 if i < 3 else 2}),)) for i in range(4)]
    selector, _ = train_selector(trajs, held_out_epochs=())
    p = hit_probability(root, "t", [], selector)
    assert 0.5 < p < 1.0
    with pytest.raises(ValueError):
        check_warm_policy("sometimes")
