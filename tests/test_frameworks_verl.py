"""bunshinrl inside verl 0.9, through verl's own entry points: its tool registry builds BunshinTool
from examples/verl/tool_config.yaml, its Hydra config composes examples/verl/bunshin_grpo.yaml
(so the example cannot rot), and its AgentLoopWorker finds "bunshin_agent" in its registry and
runs whole GRPO groups against a real vLLM server (vLLM's own api_server, serving the test
model) with rewards from the task's verifier in `reward_score`. A GRPO group forks one
snapshot; a repeated batch is served from the prefix cache; speculated calls are adopted or
rolled back, and every observation equals a fresh run's.

The server tests are skipped with the reason when the vLLM venv is missing (`bash
scripts/setup.sh --vllm`), except under BUNSHIN_REQUIRE_VLLM=1 (make test)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# As a trainer does: verl (with numpy and torch, their thread pools) is imported before bunshinrl
# (which rl_support imports); bunshinrl needs no particular order (tests/test_embed.py).
import verl  # noqa: F401
from hydra import compose, initialize_config_dir
from rl_support import liar, no_own_leaks, serve_vllm  # noqa: F401 (no_own_leaks: a fixture, used by name)
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry
from verl.experimental.agent_loop.tool_agent_loop import AgentData
from verl.protocol import DataProto
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.tools.tool_registry import initialize_tools_from_config
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import resolve_config_path
from verl.workers.config import RolloutConfig

from bunshinrl import Task, Tool
from bunshinrl.adapters import Runtime, register_task
from bunshinrl.adapters.verl import BunshinAgentLoop, BunshinTool, VLLMServerClient
from bunshinrl.grpo import VLLMServer, suite
from bunshinrl.policies.actions import FINAL, call
from bunshinrl.policies.chat import SYSTEM_PROMPT

pytestmark = pytest.mark.usefixtures("no_own_leaks")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "verl"
TASK = {t.id: t for t in suite()}["fix-both"]  # the task examples/verl/tool_config.yaml names
GROUP = 4


def _agent_data(request_id: str) -> AgentData:
    return AgentData(messages=[], image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                     metrics={}, request_id=request_id, tools_kwargs={})


def test_tools_load_through_verls_registry_and_keep_a_workspace_per_trajectory() -> None:
    tools = {t.name: t for t in initialize_tools_from_config(str(EXAMPLES / "tool_config.yaml"))}
    assert set(tools) == {"shell", "read_file", "write_file"}
    for t in tools.values():
        assert isinstance(t, BaseTool) and isinstance(t, BunshinTool)
        assert isinstance(t.tool_schema, OpenAIFunctionToolSchema)
        assert t.task.spec["memory_limit"] == "1G"  # the tool config's workspace template
    schema = tools["write_file"].tool_schema.model_dump(exclude_unset=True, exclude_none=True)
    assert schema["function"]["parameters"]["required"] == ["path", "content"]
    shell, write = tools["shell"], tools["write_file"]

    async def call(tool: BunshinTool, args: dict[str, Any], request_id: str) -> Any:
        # As verl's ToolAgentLoop calls a tool: a fresh instance per call, released right after;
        # create_kwargs are the dataset's (shared by the whole group), never the trajectory.
        iid, _ = await tool.create(create_kwargs={"ground_truth": "shared by the group"})
        try:
            return await tool.execute(iid, args, agent_data=_agent_data(request_id))
        finally:
            await tool.release(iid)

    async def main() -> None:
        rt = Runtime.shared({"cache_mib": 0, "speculation_depth": 0})
        try:
            fix = "sed -i 's/return a - b/return a + b/' /root/proj/calc.py"
            resp, reward, metrics = await call(shell, {"cmd": fix}, "req-A")
            assert reward == 0.0 and metrics == {"trajectory_id": "req-A", "served": "executed"}
            await call(write, {"path": "/root/proj/calc.py", "content": "broken"}, "req-B")
            resp, _, _ = await call(shell, {"cmd": "head -2 /root/proj/calc.py"}, "req-A")
            assert resp.text == "def add(a, b):\n    return a + b\n"  # req-B's write is not visible here
            resp, _, metrics = await call(write, {"path": "/x"}, "req-A")
            assert resp.text.startswith("[error] missing argument(s) content") and metrics["served"] == "rejected"
            assert rt.live() == ["req-A", "req-B"]
            # The reward is the verifier on the trajectory's own state, and ends it.
            iid, _ = await shell.create()
            assert await shell.calc_reward(iid, agent_data=_agent_data("req-A")) == 0.5
            assert await shell.calc_reward(iid, agent_data=_agent_data("req-B")) == 0.0
            await shell.release(iid)
            assert rt.live() == []
        finally:
            await rt.aclose()

    asyncio.run(main())
    with pytest.raises(ValueError, match="harness's own tool"):
        BunshinTool({"type": "native", "task": "fix-both", "tool": "__reward__"})


def _config(model: str, agent_loop: Path | None = None, **overrides: Any) -> Any:
    """The example trainer config, composed by Hydra the way verl's main_ppo composes it."""
    args = [f"actor_rollout_ref.model.path={model}"]
    args += [f"actor_rollout_ref.rollout.{k}={v}" for k, v in overrides.items()]
    if agent_loop is not None:
        args.append(f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loop}")
    with initialize_config_dir(config_dir=str(EXAMPLES), version_base=None):
        return compose("bunshin_grpo", overrides=args)


def test_the_example_trainer_config_composes_with_verls_own() -> None:
    cfg = _config("Qwen/Qwen2.5-3B-Instruct")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == GROUP
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert isinstance(rollout, RolloutConfig)
    assert rollout.agent.default_agent_loop == "bunshin_agent" and rollout.multi_turn.format == "hermes"
    here = os.getcwd()
    os.chdir(EXAMPLES.parent.parent)  # verl resolves these from the working directory
    try:
        tools = initialize_tools_from_config(resolve_config_path(rollout.multi_turn.tool_config_path))
        entries = __import__("omegaconf").OmegaConf.load(resolve_config_path(rollout.agent.agent_loop_config_path))
    finally:
        os.chdir(here)
    assert all(isinstance(t, BunshinTool) for t in tools)
    assert [e.name for e in entries] == ["bunshin_agent"]
    assert entries[0]["_target_"] == "bunshinrl.adapters.verl.BunshinAgentLoop"
    assert _agent_loop_registry["bunshin_agent"] == {"_target_": "bunshinrl.adapters.verl.BunshinAgentLoop"}


# ---- whole trajectories against a vLLM server ----


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bunshinrl.grpo import testmodel

    return testmodel.make(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    # One sequence at a time: batch composition changes CPU numerics, and the test repeats
    # batches expecting the very same replies.
    yield from serve_vllm(model_dir, tmp_path_factory, max_num_seqs=1)


def _batch(groups: int, task: Task = TASK) -> DataProto:
    """`groups` GRPO groups of GROUP samples of the task's prompt, each under its own uid, as verl's
    trainer hands them to the agent loop workers (AgentLoopManager adds the per-sample priority,
    which names the request under full_determinism: det-<priority>)."""
    n = groups * GROUP
    raw = np.empty(n, dtype=object)
    raw[:] = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]
              for _ in range(n)]
    return DataProto(non_tensor_batch={
        "raw_prompt": raw, "uid": np.array([f"uid-{i // GROUP}" for i in range(n)], dtype=object),
        "index": np.array([i // GROUP for i in range(n)], dtype=np.int64),
        "agent_name": np.array(["bunshin_agent"] * n, dtype=object), "priority": np.arange(n),
        "extra_info": np.array([{"bunshin_task": task.id}] * n, dtype=object)}, meta_info={})


def _run_batches(model_dir: Path, server: VLLMServer, tmp: Path, runtime: dict[str, Any],
                 batches: list[int], task: Task = TASK,
                 tool_config: Path = EXAMPLES / "tool_config.yaml") -> list[tuple[DataProto, dict[str, Any]]]:
    """Batches (of so many GRPO groups each) through AgentLoopWorker.generate_sequences, the
    runtime configured by the agent-loop registry entry; per batch verl's output and each
    request's trajectory (calls, observations, what served them, reward, forked_from)."""
    entry = tmp / f"agent_loop-{len(list(tmp.iterdir()))}.yaml"
    entry.write_text("- name: bunshin_agent\n  _target_: bunshinrl.adapters.verl.BunshinAgentLoop\n"
                     f"  constrain: true\n  runtime: {runtime!r}\n".replace("'", '"'))
    cfg = _config(str(model_dir), entry, full_determinism="true", calculate_log_probs="true", prompt_length=1536,
                  response_length=1536, **{"multi_turn.max_assistant_turns": 5,
                                           "multi_turn.tool_config_path": tool_config})

    async def main() -> list[tuple[DataProto, dict[str, Any]]]:
        client = VLLMServerClient(cfg, server.base_url, server.model)
        worker = AgentLoopWorker(cfg, client)
        out = []
        seen = 0
        try:
            for groups in batches:
                result = await worker.generate_sequences(_batch(groups, task))
                rt = Runtime.shared()  # the agent loop made it, with the registry entry's options
                await rt.core.drain()  # a selector refit, started at the batch's end, finishes
                out.append((result, {key: {"calls": [s.call.key for s in r.history],
                                           "observations": [s.observation for s in r.history],
                                           "served": list(r.served), "reward": r.reward, "forked_from": r.forked_from}
                                     for key, r in list(rt.finished)[seen:]}))
                seen = len(rt.finished)
        finally:
            await client.aclose()
            await Runtime.shared().aclose()
        return out

    return asyncio.run(main())


def _agent_steps(t: dict[str, Any]) -> list[str]:
    return [s for s, c in zip(t["served"], t["calls"], strict=True) if not c.startswith("__reward__")]


def test_the_agent_loop_runs_grpo_groups_with_the_cache_and_speculation(model_dir: Path, server: VLLMServer,
                                                                        tmp_path: Path) -> None:
    assert _agent_loop_registry["bunshin_agent"]["_target_"] == f"{BunshinAgentLoop.__module__}.BunshinAgentLoop"
    # Fresh runs: memory sharing only. Each group's four samples fork one snapshot.
    [(out, fresh)] = _run_batches(model_dir, server, tmp_path, {"cache_mib": 0, "speculation_depth": 0}, [2])
    assert len(fresh) == 2 * GROUP
    for g in range(2):
        parents = {fresh[f"det-{i}"]["forked_from"] for i in range(g * GROUP, (g + 1) * GROUP)}
        assert len(parents) == 1 and None not in parents
    assert fresh["det-0"]["forked_from"] != fresh[f"det-{GROUP}"]["forked_from"]
    rewards = [fresh[f"det-{i}"]["reward"] for i in range(2 * GROUP)]
    assert all(r is not None for r in rewards)
    # reward_score became verl's rm_scores (at each sample's last response token).
    assert out.batch["rm_scores"].sum(-1).tolist() == pytest.approx(rewards)
    assert all(m["tool_calls"] == m["executed"] for m in out.non_tensor_batch["bunshin"])
    assert sum(len(_agent_steps(t)) for t in fresh.values()) >= 2 * GROUP  # the model did call tools

    def same_as_fresh(batch: dict[str, Any]) -> None:
        assert {k: (t["calls"], t["observations"], t["reward"]) for k, t in batch.items()} == \
            {k: (t["calls"], t["observations"], t["reward"]) for k, t in fresh.items() if k in batch}

    # Speculation: the first group trains the selector; then both groups run with predicted calls
    # executing while the server generates: adopted where the prediction holds (group 0 repeats
    # what it learned from), rolled back where it does not (group 1 samples other paths).
    [(_, a), (out_b, b)] = _run_batches(model_dir, server, tmp_path,
                                        {"cache_mib": 0, "speculation_depth": 2, "refit_every": GROUP}, [1, 2])
    same_as_fresh(a)
    same_as_fresh(b)
    metrics = list(out_b.non_tensor_batch["bunshin"])
    print("speculation (hits, misses) per sample:", [(m["spec_hits"], m["spec_misses"]) for m in metrics])
    assert "speculation" in [s for t in b.values() for s in _agent_steps(t)]
    assert sum(m["spec_hits"] for m in metrics) >= 1 and sum(m["spec_misses"] for m in metrics) >= 1

    # The prefix cache: the repeated group is served from it, call for call.
    [(_, c), (out_d, d)] = _run_batches(model_dir, server, tmp_path, {"cache_mib": 256, "speculation_depth": 0},
                                        [1, 1])
    same_as_fresh(c)
    same_as_fresh(d)
    assert all(s == "cache" for t in d.values() for s in _agent_steps(t))
    assert sum(m["cache_hits"] for m in out_d.non_tensor_batch["bunshin"]) == \
        sum(len(_agent_steps(t)) for t in d.values()) > 0


# ---- a served step that does not reproduce: the trajectory is re-rolled ----


def _note(ws: Any, args: dict[str, Any]) -> str:
    r = ws.commands.run("echo n >> /root/notes && wc -l < /root/notes", timeout=30)
    return str(r.stdout).strip()


def _notes_kept(ws: Any) -> float:
    return float(ws.commands.run("test -s /root/notes", timeout=30).exit_code == 0)


def _reroll_task() -> Task:
    """`liar` claims determinism and observes something new on every call (a replay of it never
    reproduces); `note` appends to a file and shows how many lines it holds (the state)."""
    tools = [Tool("liar", liar), Tool("note", _note)]
    return Task("verl-reroll", "Call the tools, then answer.", tools, lambda ws: None, verify=_notes_kept,
                spec={"rootfs": "host", "network": "none", "memory_limit": "1G"}, budget=4,
                actions=(call("liar"), call("note"), FINAL), fingerprint="verl-reroll-v1")


def test_a_trajectory_whose_served_step_does_not_reproduce_is_rerolled(model_dir: Path, server: VLLMServer,
                                                                      tmp_path: Path) -> None:
    """The same batch twice through verl's AgentLoopWorker with the prefix cache (the second
    batch's samples are served the first's liar observations, and their own workspaces would have
    observed other ones). Before, such a trajectory was refused: its later calls failed and it was
    scored None. Now it is re-rolled with the cache off: scored, every observation its own
    workspace's, the notes count what its history shows, and the metrics say so.

    The divergence is found by the replay behind the hit, in the background; a sample whose liar
    is its last call (then the answer, and the verifier's call, a hit too) ends before that replay
    is done. It was then scored on the liar observation it was served and never re-rolled (CI:
    'no trajectory diverged'); the episode's end now waits for the replay, so the re-roll does
    not depend on how fast the model answers."""
    task = register_task(_reroll_task())
    tool_config = tmp_path / "reroll_tools.yaml"
    tool_config.write_text("tools:\n" + "".join(
        f"  - class_name: bunshinrl.adapters.verl.BunshinTool\n    config: {{type: native, task: {task.id}, "
        f"tool: {name}}}\n" for name in ("liar", "note")))
    batches = _run_batches(model_dir, server, tmp_path, {"cache_mib": 256, "speculation_depth": 0}, [1, 1],
                           task=task, tool_config=tool_config)
    trajectories = [t for _, batch in batches for t in batch.values()]
    metrics = [m for out, _ in batches for m in out.non_tensor_batch["bunshin"]]
    rerolled = [m for m in metrics if m["rerolled"]]
    print("per sample (divergences, rerolled, rerolled_seconds):",
          [(m["divergences"], m["rerolled"], m["rerolled_seconds"]) for m in metrics])
    # Whatever is scored ran its liar calls itself (a served one was re-rolled).
    for key, t in [(k, t) for _, batch in batches for k, t in batch.items()]:
        liars = [s for c, s in zip(t["calls"], t["served"], strict=True) if c.startswith("liar")]
        assert t["reward"] is not None and set(liars) <= {"executed"}, \
            f"{key} was scored with a liar observation it did not run: {t['calls']} served {t['served']}"
    assert rerolled, "no trajectory diverged: the batches never served a liar observation"
    for m in rerolled:
        assert m["rerolled"] == 1 and m["divergences"] >= 1 and m["rerolled_seconds"] > 0
        # The discarded attempt's divergences are counted by their outcome: re-rolled.
        assert m["outcome_rerolled"] >= 1 and m["outcome_refused"] == 0 and m["divergences_unaccounted"] == 0, m
        assert m["cache_hits"] == 0 and m["tool_calls"] == m["executed"]  # the re-roll ran every call itself
    for out, batch in batches:
        rewards = [batch[f"det-{i}"]["reward"] for i in range(GROUP)]
        assert None not in rewards  # never refused
        assert out.batch["rm_scores"].sum(-1).tolist() == pytest.approx(rewards)
    for t in trajectories:
        notes = [obs for c, obs in zip(t["calls"], t["observations"], strict=True) if c.startswith("note")]
        assert notes == [str(i + 1) for i in range(len(notes))]  # the state is the history it was shown


def test_a_stock_tool_loop_scores_a_trajectory_whose_last_hit_does_not_reproduce_0() -> None:
    """BunshinTool under another agent loop (no re-roll): a trajectory served liar and note from
    the cache ends with calc_reward, which waits for the replays behind the hits; liar's does not
    reproduce, and the trajectory is refused, scored 0 (before: the verifier's cached 1.0)."""
    task = register_task(_reroll_task())
    tools = {name: BunshinTool({"type": "native", "task": task.id, "tool": name}) for name in ("liar", "note")}

    async def episode(request_id: str) -> float:
        for name in ("liar", "note"):
            iid, _ = await tools[name].create()
            await tools[name].execute(iid, {}, agent_data=_agent_data(request_id))
            await tools[name].release(iid)
        iid, _ = await tools["note"].create()
        return await tools["note"].calc_reward(iid, agent_data=_agent_data(request_id))

    async def main() -> None:
        rt = Runtime.shared({"cache_mib": 256, "speculation_depth": 0})
        try:
            assert await episode("req-A") == 1.0
            assert await episode("req-B") == 0.0
            key, b = rt.finished[-1]
            assert key == "req-B" and b.refused and b.reward is None
            assert b.served == ["executed"]  # cut back to liar, its fresh observation
            assert b.timeline.rewound == 1 and b.timeline.divergences >= 1
        finally:
            await rt.aclose()

    asyncio.run(main())
