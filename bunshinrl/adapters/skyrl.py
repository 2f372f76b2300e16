"""A SkyRL-Gym text environment (BaseTextEnv's init / step / close) on a bunshinrl workspace.

SkyRL constructs one env per trajectory, `env_cls(env_config=..., extras=...)`, calls
`init(prompt)` once, `step(llm_output)` once per turn until `done`, then `close()`. Here the
env's trajectory owns a fork of its task's initialized workspace (shared TrajectoryWorkspaces),
the LLM output is parsed as a tool call (<tool_call>{"name", "arguments"}</tool_call>, a bare
JSON call, or the action-text form), the tool's observation comes back as a user message, and
the reward, computed by the task's verifier from the final workspace state, is given on the step
that ends the episode: an answer without a tool call, or the task's step budget (max_turns).

skyrl_gym is not imported: BaseTextEnvStepOutput is the same TypedDict shape.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Mapping
from typing import Any, TypedDict

from ..signature import ToolCall
from .openai_tools import is_hidden, tool_schemas, validate_args
from .workspaces import TrajectoryWorkspaces


class BaseTextEnvStepOutput(TypedDict):
    observations: list[dict[str, str]]
    reward: float
    done: bool
    metadata: dict[str, Any]
    postprocessed_action: str | None


def _run_coroutine(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code, even on a thread whose event loop
    is running (SkyRL may call step() from inside one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class BunshinTextEnv:
    """env_config / extras: "task" or "task_id" names the task; "max_turns" overrides its budget;
    "trajectory_id" names the trajectory (default: a fresh id per env)."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None, *,
                 pool: TrajectoryWorkspaces | None = None) -> None:
        cfg = {**dict(env_config or {}), **dict(extras or {})}
        task_id = cfg.get("task_id") or cfg.get("task")
        if not task_id:
            raise ValueError("BunshinTextEnv needs a task id (env_config or extras: 'task_id')")
        self.pool = pool or TrajectoryWorkspaces.shared()
        self.task = self.pool.task(str(task_id))
        self.max_turns = int(cfg.get("max_turns") or self.task.budget)
        self.trajectory_id = str(cfg.get("trajectory_id") or f"skyrl-{uuid.uuid4().hex}")
        self.turns = 0
        self.tools = self.task.agent_tools
        self._open = False
        self.last_reward: float | None = None

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        self.pool.acquire_sync(self.trajectory_id, self.task.id)
        self._open = True
        return prompt, {"task_id": self.task.id, "trajectory_id": self.trajectory_id,
                        "tools": tool_schemas(self.tools), "max_turns": self.max_turns}

    def _reward(self) -> tuple[float, str]:
        ws = self.pool.get(self.trajectory_id)
        if ws is None:
            raise RuntimeError("the environment is not initialised (call init) or already closed")
        score, detail = self.task.verify(ws)
        self.last_reward = score
        return score, detail

    def step(self, action: str) -> BaseTextEnvStepOutput:
        from ..grpo.actions import parse_action

        if not self._open:
            raise RuntimeError("step() before init() or after close()")
        parsed = parse_action(action)
        self.turns += 1
        if not isinstance(parsed, ToolCall):
            score, detail = self._reward()
            return BaseTextEnvStepOutput(observations=[], reward=score, done=True,
                                         metadata={"turn": self.turns, "verdict": detail, "tool": None},
                                         postprocessed_action=action)
        tool = self.tools.get(parsed.name) if not is_hidden(parsed.name) else None
        if tool is None:
            obs = f"[error] unknown tool {parsed.name!r}; available: {', '.join(sorted(self.tools))}"
        elif (problem := validate_args(tool, parsed.args)) is not None:
            obs = f"[error] {problem}"
        else:
            ws = self.pool.get(self.trajectory_id)
            assert ws is not None
            obs = _run_coroutine(tool.run(ws, parsed.args))
        done = self.turns >= self.max_turns
        meta: dict[str, Any] = {"turn": self.turns, "tool": parsed.name}
        reward = 0.0
        if done:
            reward, meta["verdict"] = self._reward()
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": obs}], reward=reward, done=done,
                                     metadata=meta, postprocessed_action=action)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.pool.release_sync(self.trajectory_id)
            self.pool.finish_sync(self.trajectory_id)
