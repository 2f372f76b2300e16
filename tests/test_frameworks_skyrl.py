"""bunshinrl inside SkyRL, through skyrl-gym's own entry points: `skyrl_gym.make("bunshin-workspace")`,
driven exactly as SkyRL's SkyRLGymGenerator drives an env (init and step on its env executor or
inline, get_metrics at the episode's end, close, the env class's aggregate_metrics), on real
workspaces: a GRPO group forks one snapshot, a repeated trajectory's hits are validated on the
sample's own workspace before they are served (validate, then serve: SkyRL cannot rewind its
conversation), a speculated call is adopted on a match and leaves no trace on a mismatch."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

# As a trainer does: skyrl_gym (with numpy) is imported before bunshinrl (which rl_support
# imports); bunshinrl needs no particular order (tests/test_embed.py).
import skyrl_gym
from omegaconf import DictConfig
from rl_support import counter_task, no_own_leaks  # noqa: F401 (fixture, used by name)
from skyrl_gym.envs.registration import load_env_creator

from bunshinrl import ToolCall, render_call
from bunshinrl.adapters import Runtime, register_task
from bunshinrl.adapters.skyrl import ENV_ID, BunshinEnv
from bunshinrl.grpo import suite
from bunshinrl.policies.chat import render_action

pytestmark = pytest.mark.usefixtures("no_own_leaks")

TASK = {t.id: t for t in suite()}["files-ab"]
PROMPT = [{"role": "user", "content": TASK.prompt}]
SOLUTION = [render_action(a) for a in TASK.solution]  # write a.txt, write b.txt, "Done."
# Writes a.txt, then looks for b.txt, which the solution's next call (and its speculation) writes.
DEVIATE = [SOLUTION[0], render_call(ToolCall("shell", {"cmd": "ls /root/out; cat /root/out/b.txt"})), "Done."]


async def generator_episode(env_config: dict[str, Any], extras: dict[str, Any], replies: Sequence[str],
                            executor: ThreadPoolExecutor | None) -> dict[str, Any]:
    """One trajectory as SkyRLGymGenerator.agent_loop runs it; `replies` stand in for the model's
    outputs. executor=None: max_env_workers=0 (the env runs inline on the generator's loop)."""
    loop = asyncio.get_running_loop()

    async def run(fn: Any, *args: Any) -> Any:
        return await loop.run_in_executor(executor, fn, *args) if executor is not None else fn(*args)

    extras = {**extras, "max_turns": 4}  # the generator sets it from generator.max_turns
    env = skyrl_gym.make(ENV_ID, env_config=DictConfig(env_config), extras=extras)
    chat, _ = await run(env.init, [dict(m) for m in PROMPT])
    observations, rewards, done, i = [], [], False, 0
    while not done:
        out = await run(env.step, replies[i])
        i += 1
        observations += out["observations"]
        rewards.append(out["reward"])
        done = out["done"]
    metrics = env.get_metrics()
    await run(env.close)
    return {"env": env, "chat": chat, "observations": [m["content"] for m in observations],
            "roles": [m["role"] for m in observations], "reward": rewards[-1], "metrics": metrics}


def _episodes(env_config: dict[str, Any], batches: Sequence[Sequence[tuple[dict[str, Any], Sequence[str]]]],
              inline: bool = False, between: Any = None) -> list[list[dict[str, Any]]]:
    """Batches of concurrent trajectories (each (extras, replies)); the process-wide runtime is
    closed at the end."""
    async def main() -> list[list[dict[str, Any]]]:
        out = []
        with ThreadPoolExecutor(max_workers=32, thread_name_prefix="skyrl-gym-env-") as ex:
            for batch in batches:
                out.append(list(await asyncio.gather(*(generator_episode(env_config, e, r, None if inline else ex)
                                                       for e, r in batch))))
                rt = Runtime.shared()
                await loop_run(rt, rt.core.drain())  # lets a selector refit finish between batches
        return out

    async def loop_run(rt: Runtime, coro: Any) -> Any:
        return await asyncio.to_thread(rt.run, coro)

    try:
        return asyncio.run(main())
    finally:
        Runtime.shared().close()


def test_registered_and_made_through_skyrl_gym() -> None:
    assert skyrl_gym.registry[ENV_ID].entry_point == "bunshinrl.adapters.skyrl:BunshinEnv"
    env = skyrl_gym.make(ENV_ID, env_config=DictConfig({"task": "files-ab"}), extras={"max_turns": 2})
    assert isinstance(env, skyrl_gym.Env) and isinstance(env, BunshinEnv) and env.max_turns == 2
    env.close()  # never initialised: nothing to release
    with pytest.raises(KeyError, match="unknown task"):
        skyrl_gym.make(ENV_ID, env_config=DictConfig({"task": "no-such-task"}), extras={})
    Runtime.shared().close()


def test_a_group_of_four_forks_one_snapshot_and_episodes_end_with_the_verifiers_reward() -> None:
    base = {"task": "files-ab", "runtime": {"cache_mib": 0, "speculation_depth": 0}}
    [group] = _episodes(base, [[({"group": "uid-7"}, SOLUTION)] * 3 + [({"group": "uid-7"}, DEVIATE)]])
    parents = {e["env"].rollout.forked_from for e in group}
    assert len(parents) == 1 and None not in parents  # 4 workspaces, forked from one snapshot
    for e in group[:3]:
        assert e["reward"] == 1.0 and e["observations"] == ["wrote 6 bytes to /root/out/a.txt",
                                                            "wrote 5 bytes to /root/out/b.txt"]
        assert e["roles"] == ["tool", "tool"] and e["metrics"]["executed"] == 2
    assert group[3]["reward"] == 0.5 and "No such file" in group[3]["observations"][1]
    # The tools reach the model through the system prompt SkyRL renders.
    system = group[0]["chat"][0]
    assert system["role"] == "system" and '"name": "write_file"' in system["content"]
    agg = load_env_creator(skyrl_gym.registry[ENV_ID].entry_point).aggregate_metrics([e["metrics"] for e in group])
    assert agg["episodes"] == 4 and agg["tool_calls"] == 8 and agg["reward"] == pytest.approx(3.5 / 4)


def test_a_repeated_trajectory_is_validated_then_served_from_the_prefix_cache() -> None:
    fresh = _episodes({"task": "files-ab", "runtime": {"cache_mib": 0, "speculation_depth": 0}},
                      [[({}, SOLUTION), ({}, DEVIATE)]])[0]
    cached = {"task": "files-ab", "runtime": {"cache_mib": 256, "speculation_depth": 0}}
    first, again = _episodes(cached, [[({}, SOLUTION)], [({}, SOLUTION), ({}, DEVIATE)]], inline=True)
    assert first[0]["metrics"]["executed"] == 2 and first[0]["metrics"]["validated"] == 0
    repeat, deviate = again
    # Each hit ran on the sample's own workspace and matched its recording before it was served.
    assert repeat["metrics"]["validated"] == 2 and repeat["metrics"]["cache_hits"] == 0
    assert (repeat["metrics"]["divergences"], repeat["metrics"]["rewound"]) == (0, 0)  # every hit reproduced
    assert repeat["observations"] == fresh[0]["observations"] and repeat["reward"] == fresh[0]["reward"] == 1.0
    # The deviating sample shares the first call's prefix, then leaves the tree; the state it
    # observes is exactly a fresh run's.
    assert deviate["metrics"]["validated"] == 1 and deviate["metrics"]["tool_calls"] == 2
    assert deviate["observations"] == fresh[1]["observations"] and deviate["reward"] == fresh[1]["reward"] == 0.5
    agg = BunshinEnv.aggregate_metrics([repeat["metrics"], deviate["metrics"]])
    assert agg["validated"] == 3 and agg["divergences"] == 0


def test_a_hit_whose_replay_differs_is_never_served() -> None:
    """`liar` claims determinism and observes something new each time. The second episode's
    liar call is a hit recorded by the first; its replay on the episode's own workspace differs,
    so the model gets that fresh observation, never the recorded one (without validate-then-serve
    it got the first episode's 'tick N' while its workspace had observed another), and the
    episode goes on off the tree, its later state exactly the history it was shown."""
    register_task(counter_task("skyrl-liar"))
    plan = [render_call(ToolCall("bump", {"n": 1})), render_call(ToolCall("liar")),
            render_call(ToolCall("bump", {"n": 2})), render_call(ToolCall("state"))]
    cfg = {"task": "skyrl-liar", "runtime": {"cache_mib": 256, "speculation_depth": 0}}
    [[first], [second]] = _episodes(cfg, [[({}, plan)], [({}, plan)]], inline=True)
    assert first["metrics"]["validated"] == 0 and first["metrics"]["divergences"] == 0
    m = second["metrics"]
    assert (m["validated"], m["divergences"], m["rewound"], m["rerolled"]) == (1, 1, 0, 0)
    assert second["observations"][0] == first["observations"][0] == "1"  # bump n=1: validated, then served
    assert second["observations"][1] != first["observations"][1]  # liar: its own observation
    assert second["observations"][1].startswith("tick ")
    assert second["observations"][3].splitlines()[:3] == ["3", "1", "2"]  # the counter and its log: 1 + 2


def test_speculation_is_adopted_on_a_match_and_leaves_no_trace_on_a_mismatch() -> None:
    fresh = _episodes({"task": "files-ab", "runtime": {"cache_mib": 0, "speculation_depth": 0}},
                      [[({}, SOLUTION), ({}, DEVIATE)]])[0]
    spec = {"task": "files-ab", "runtime": {"cache_mib": 0, "speculation_depth": 2, "refit_every": 2}}
    # Two trajectories train the next-call selector (refit after every 2); then one follows the
    # prediction (write b.txt after a.txt) and one deviates from it.
    _train, [match], [mismatch] = _episodes(spec, [[({}, SOLUTION), ({}, SOLUTION)], [({}, SOLUTION)],
                                                   [({}, DEVIATE)]])
    assert match["metrics"]["spec_hits"] >= 1 and match["metrics"]["spec_misses"] == 0
    assert match["observations"] == fresh[0]["observations"] and match["reward"] == 1.0
    # The speculative write of b.txt ran and was rolled back: the real call does not see it.
    assert mismatch["metrics"]["spec_misses"] >= 1
    assert mismatch["observations"] == fresh[1]["observations"] and "No such file" in mismatch["observations"][1]
    assert mismatch["reward"] == fresh[1]["reward"] == 0.5


def test_parallel_tool_calls_in_one_step_run_in_order() -> None:
    # One reply with both writes: two observations, one tool message each, in the reply's order.
    both = SOLUTION[0] + "\n" + SOLUTION[1]
    [[e]] = _episodes({"task": "files-ab", "runtime": {"cache_mib": 0, "speculation_depth": 0}},
                      [[({}, [both, "Done."])]])
    assert e["observations"] == ["wrote 6 bytes to /root/out/a.txt", "wrote 5 bytes to /root/out/b.txt"]
    assert e["roles"] == ["tool", "tool"] and e["metrics"]["tool_calls"] == 2 and e["reward"] == 1.0
