"""Nothing is finalised on an unverified state (issue 37): a sample served from the prefix cache
keeps a warm workspace behind it, on which the calls it skipped are replayed and compared in the
background. When the sample finishes before that replay is done (its last agent call, then the
verifier's, both hits), finish() waits for it: a served step that does not reproduce rewinds the
sample (Rewound) before anything is scored, so caching never changes a reward.

`liar` (tests/rl_support.py) claims determinism and observes something new on every call: every
replay of it diverges. Before this, the verifier's own hit was served at once and the sample was
scored with liar's recorded observation in its history; the divergence was found afterwards, in
the background, and counted on a trajectory already scored."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rl_support import PlanPolicy, bump, liar, no_own_leaks, root_only_cache, setup, state, two_epochs  # noqa: F401 (no_own_leaks: a fixture, used by name)

from bunshinrl import (
    RolloutCore,
    SampleContext,
    Task,
    Tool,
    ToolCall,
)
from bunshinrl.adapters import Runtime, RuntimeConfig
from bunshinrl.rollout.core import Rewound

pytestmark = pytest.mark.usefixtures("no_own_leaks")

C = ToolCall
PLAN = [C("bump", {"n": 1}), C("liar")]  # then the answer: liar is the last agent call


def _bumps(ws: Any) -> float:
    """1.0 when the workspace holds exactly the one bump of PLAN."""
    return float(state(ws).splitlines()[0] == "1")


def scored_task() -> Task:
    return Task("finish", "Bump, ask the liar, answer.", [Tool("bump", bump), Tool("liar", liar), Tool("state", state)],
                setup, verify=_bumps, fingerprint="rl-test-finish-v1")



def test_the_own_loop_rewinds_a_sample_whose_last_hit_does_not_reproduce() -> None:
    """Epoch 1 is served bump, liar and the verifier from epoch 0's recording. The replay behind
    liar's hit diverges: the sample is rewound to liar (its fresh observation) before it is
    scored, the policy answers again, and the reward is its own workspace's verifier."""
    policy = PlanPolicy(lambda _epoch, _sample: PLAN)
    first, second = two_epochs(policy, scored_task(), prefetch=True)
    recorded, served = first.samples[0], second.samples[0]
    assert recorded.reward == 1.0 and recorded.divergences == 0
    assert served.rewound == 1 and served.divergences >= 1, f"scored on an unverified state: {served.errors}"
    assert [s.call for s in served.steps if s.call.name != "__reward__"] == PLAN
    assert served.steps[1].observation != recorded.steps[1].observation  # liar's fresh observation
    assert policy.asked.count((1, 2)) == 2  # the policy answered again after the rewind
    assert served.reward == 1.0


def _rollouts(core: RolloutCore, task: Task, rewinds: bool) -> Any:
    """Sample 0 records PLAN and is scored; sample 1 is served PLAN from the cache; its finish()."""

    async def main() -> tuple[Any, BaseException | None]:
        a = await core.start(task, SampleContext(task.id, 0, 0))
        try:
            for c in PLAN:
                await a.call(c)
            assert await a.finish("done") == 1.0
        finally:
            await a.close()
        b = await core.start(task, SampleContext(task.id, 1, 0), rewinds=rewinds)
        try:
            for c in PLAN:
                await b.call(c)
            assert b.served == ["cache", "cache"]
            try:
                await b.finish("done")
                return b, None
            except Rewound as e:
                return b, e
        finally:
            await b.close()

    return main()


@pytest.mark.parametrize("verify_seconds", [300.0, 0.0], ids=["awaited", "deadline"])
def test_finish_waits_for_the_replay_behind_the_last_hit(verify_seconds: float) -> None:
    """A driver that cannot rewind (verl's, SkyRL's: rewinds=False) gets Rewound from finish()
    and the trajectory refused, unscored (verl's agent loop then re-rolls it); before, it was
    scored 1.0 on liar's recorded observation. deadline: the warm workspace is not waited for;
    the state is rebuilt from the cache and verified instead, with the same outcome."""
    cache = root_only_cache()
    core = RolloutCore(cache=cache, prefetch=True, critical_path_captures=False, verify_seconds=verify_seconds)

    async def main() -> tuple[Any, BaseException | None]:
        try:
            return await _rollouts(core, scored_task(), rewinds=False)
        finally:
            await core.close()
            cache.close()

    b, raised = asyncio.run(main())
    assert isinstance(raised, Rewound) and raised.step == 1, f"scored {b.reward} on an unverified state"
    assert b.reward is None and b.refused and b.timeline.rewound == 1 and b.timeline.divergences >= 1
    assert b.served == ["cache", "executed"] and b.history[1].observation == raised.observation
    if verify_seconds == 0.0:
        assert any("not verified within 0 s" in e for e in b.timeline.errors)


def test_the_runtime_ends_a_trajectory_whose_last_hit_does_not_reproduce_with_rewound() -> None:
    """The adapters' Runtime: end() raises the Rewound the verifier's call met (verl's agent
    loop re-rolls on it), and the closed rollout is kept unscored in `finished`."""
    task = scored_task()

    async def main() -> None:
        rt = Runtime(RuntimeConfig(cache_mib=256, speculation_depth=0))
        try:
            a = await rt.start("a", task)
            for c in PLAN:
                await a.call(c)
            assert (await rt.end("a", "done")).reward == 1.0  # type: ignore[union-attr]
            b = await rt.start("b", task)
            for c in PLAN:
                await b.call(c)
            assert b.served == ["cache", "cache"]
            with pytest.raises(Rewound):
                await rt.end("b", "done")
            assert rt.finished[-1] == ("b", b) and b.reward is None and b.closed and rt.live() == []
        finally:
            await rt.aclose()

    asyncio.run(main())
