"""Adapters on real workspaces: verl's BaseTool contract keyed by trajectory, a SkyRL-Gym text
env, and OpenAI function-calling schemas."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from bunshinrl.adapters import BunshinTextEnv, BunshinVerlTool, TrajectoryWorkspaces, tool_schemas, validate_args
from bunshinrl.grpo import REWARD_TOOL, suite
from bunshinrl.grpo.actions import call

TASKS = {t.id: t for t in suite()}


def test_openai_tool_schemas_from_a_tool_set() -> None:
    task = TASKS["service-pong"]
    schemas = tool_schemas(task.environment.tools)
    by_name = {s["function"]["name"]: s for s in schemas}
    assert set(by_name) == {"shell", "read_file", "write_file", "http_get"}  # the verifier stays hidden
    assert REWARD_TOOL in {s["function"]["name"] for s in tool_schemas(task.environment.tools, include_hidden=True)}
    w = by_name["write_file"]
    assert w["type"] == "function" and w["function"]["description"]
    assert w["function"]["parameters"]["required"] == ["path", "content"]
    assert w["function"]["parameters"]["properties"]["path"]["type"] == "string"
    json.dumps(schemas)  # what a request body carries
    tool = task.agent_tools["write_file"]
    assert validate_args(tool, {"path": "/x", "content": "y"}) is None
    assert "missing" in (validate_args(tool, {"path": "/x"}) or "")
    assert "unknown" in (validate_args(tool, {"path": "/x", "content": "y", "mode": "a"}) or "")
    assert "string" in (validate_args(tool, {"path": "/x", "content": 3}) or "")


def test_verl_tool_keeps_one_workspace_per_trajectory_across_per_call_create_release() -> None:
    # Between two calls of a trajectory nobody holds it; lingering is what keeps it alive.
    pool = TrajectoryWorkspaces(linger_seconds=30.0)
    write = BunshinVerlTool({"task": "files-ab", "tool": "write_file"}, pool=pool)
    shell = BunshinVerlTool({"task": "files-ab"}, {"type": "function", "function": {"name": "shell"}}, pool=pool)
    assert write.get_openai_tool_schema()["function"]["name"] == "write_file"

    async def one_call(tool: BunshinVerlTool, args: dict, request_id: str) -> str:
        # verl's ToolAgentLoop: a fresh instance per call, released right after it.
        iid, _ = await tool.create(create_kwargs={"ground_truth": "dataset-level, shared by the group"})
        try:
            resp, reward, metrics = await tool.execute(iid, args, agent_data=SimpleNamespace(request_id=request_id))
            assert reward == 0.0 and metrics["trajectory_id"] == request_id
            return resp.text or ""
        finally:
            await tool.release(iid)

    async def main() -> None:
        try:
            await one_call(write, {"path": "/root/out/a.txt", "content": "alpha\n"}, "traj-A")
            await one_call(write, {"path": "/root/out/a.txt", "content": "beta\n"}, "traj-B")
            await one_call(write, {"path": "/root/out/b.txt", "content": "beta\n"}, "traj-A")
            assert (await one_call(shell, {"cmd": "cat /root/out/a.txt"}, "traj-A")).strip() == "alpha"
            assert (await one_call(shell, {"cmd": "cat /root/out/a.txt"}, "traj-B")).strip() == "beta"
            bad = await one_call(write, {"path": "/root/out/c.txt"}, "traj-B")
            assert bad.startswith("[error] missing argument")
            assert pool.forks == 2 and pool.live() == ["traj-A", "traj-B"]

            # The reward is read from each trajectory's own workspace.
            iid, _ = await write.create()
            assert await write.calc_reward(iid, trajectory_id="traj-A") == 1.0
            await write.release(iid)
            iid, _ = await write.create()
            assert await write.calc_reward(iid, trajectory_id="traj-B", finish=True) == 0.0
            await write.release(iid)
            assert pool.live() == ["traj-A"]

            # Unheld for linger_seconds: reaped.
            assert pool.reap_sync() == [] and pool.live() == ["traj-A"]
            assert pool.reap_sync(now=time.monotonic() + 31) == ["traj-A"] and pool.live() == []

            # SGLang-style rollouts name the trajectory in create() and release at the end.
            await write.create("req-7")
            await write.execute("req-7", {"path": "/root/out/a.txt", "content": "alpha\n"})
            sid, _ = await shell.create("req-7")
            assert (await shell.execute(sid, {"cmd": "ls /root/out"}))[0].text == "README\na.txt\n"
            await shell.release(sid)
            await write.release("req-7")
            assert pool.live() == ["req-7"]

            # No trajectory id anywhere: the workspace lives for one call only.
            iid, _ = await shell.create()
            await shell.execute(iid, {"cmd": "true"})
            assert iid in pool.live()
            await shell.release(iid)
            assert iid not in pool.live()
        finally:
            await pool.aclose()
        assert pool.live() == []

    asyncio.run(main())
    with pytest.raises(ValueError, match="harness's own tool"):
        BunshinVerlTool({"task": "files-ab", "tool": REWARD_TOOL}, pool=pool)


def test_skyrl_env_runs_an_episode_to_a_verified_reward() -> None:
    pool = TrajectoryWorkspaces()
    task = TASKS["fix-both"]
    try:
        env = BunshinTextEnv({"task": "fix-both"}, {"trajectory_id": "sky-1"}, pool=pool)
        prompt = [{"role": "user", "content": task.prompt}]
        out_prompt, meta = env.init(prompt)
        assert out_prompt == prompt and meta["max_turns"] == task.budget
        assert {t["function"]["name"] for t in meta["tools"]} == {"shell", "read_file", "write_file"}

        fix_add = json.loads(task.solution[0][len("shell"):])
        step = env.step(f'I will fix add first.\n<tool_call>{{"name": "shell", "arguments": {json.dumps(fix_add)}}}'
                        "</tool_call>")
        assert not step["done"] and step["reward"] == 0.0 and step["observations"][0]["role"] == "user"
        step = env.step(json.dumps({"name": "nope", "arguments": {}}))
        assert step["observations"][0]["content"].startswith("[error] unknown tool 'nope'")
        step = env.step(task.solution[1])  # the action-text form
        assert not step["done"]
        step = env.step("Both functions are fixed.")
        assert step["done"] and step["reward"] == 1.0 and step["observations"] == []
        env.close()
        assert pool.live() == []

        # The step budget ends the episode with the verifier's reward for whatever state is left.
        env = BunshinTextEnv({"task_id": "files-ab", "max_turns": 1}, pool=pool)
        env.init([])
        step = env.step(call("write_file", path="/root/out/a.txt", content="alpha\n"))
        assert step["done"] and step["reward"] == 0.5 and "ok /root/out/a.txt" in step["metadata"]["verdict"]
        env.close()
    finally:
        pool.close_sync()
    assert pool.live() == []
