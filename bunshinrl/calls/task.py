"""Task: the one contract every rollout driver (RolloutEngine, verl's agent loop, SkyRL's env)
and every task family (the GRPO suite, the benchmark workload, the desktop and web-shop
templates) shares.

A task says how its initial workspace is made (`spec`, the WorkspaceSpec fields, then `setup`
on the fresh workspace), which tools an agent may call, and, when it has one, how its reward is
read from the final workspace state (`verify`, never the transcript). The engine runs two
hidden tools of its own beside the agent's: the verifier (REWARD_TOOL, called once the agent
has finished, through the same cache and speculation as every other call, so it scores
exactly the state the trajectory built however that state was served) and the answer to a
malformed call (INVALID_TOOL, which touches nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bunshinfork import Workspace

from .signature import ToolCall
from .tools import Tool, ToolSet

REWARD_TOOL = "__reward__"
INVALID_TOOL = "__invalid__"
_REWARD_LINE = re.compile(r"^reward=(-?[0-9.]+)$", re.M)

Verdict = tuple[float, str]
Verifier = Callable[[Workspace], "Verdict | float"]


def parse_reward(observation: str) -> float:
    """The score in the verifier tool's observation."""
    m = _REWARD_LINE.search(observation)
    if m is None:
        raise ValueError(f"not a reward observation: {observation[:200]!r}")
    return float(m.group(1))


def invalid_call(reason: str, text: str) -> ToolCall:
    """The call a reply stands for when it tried to call a tool and failed."""
    return ToolCall(INVALID_TOOL, {"error": reason, "text": text})


def _verdict(out: Verdict | float) -> Verdict:
    if isinstance(out, tuple):
        return float(out[0]), str(out[1])
    return float(out), ""


@dataclass(eq=False)
class Task:
    """id: names the task (cached prefixes are keyed by it); prompt: what the agent is asked;
    tools: what it may call; setup: run once on a fresh workspace created from `spec` (a sync
    function, or a coroutine function awaited on the event loop);
    verify: the reward, (score, detail) or a bare score, from a workspace's state.

    fingerprint must change whenever setup would build a different state; together with the
    root file system's digest it forms the template digest every cached prefix is keyed by. By
    default it hashes the id, the prompt and `setup_files` (what setup writes, when it says).
    budget: tool calls the agent may make before the episode is ended for it.
    actions / solution: candidate action texts (ToolCall keys, or actions.FINAL) a constrained
    decoder chooses from, and a known-good sequence of them (tests, baselines).
    """

    id: str
    prompt: str
    tools: Sequence[Tool] | ToolSet
    setup: Callable[[Workspace], Awaitable[None] | None]
    verify: Verifier | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    budget: int = 32
    family: str = ""
    actions: tuple[str, ...] = ()
    solution: tuple[str, ...] = ()
    setup_files: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tools = self.tools if isinstance(self.tools, ToolSet) else ToolSet(self.tools)
        hidden = [n for n, t in self.tools.items() if t.hidden]
        if hidden:
            raise ValueError(f"task {self.id}: {hidden} are the engine's own tool names (names starting with __)")
        if not self.fingerprint:
            blob = json.dumps([self.id, self.prompt, sorted(self.setup_files.items())], sort_keys=True)
            self.fingerprint = f"{self.id}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
        hidden_tools = [_invalid_tool()]
        if self.verify is not None:
            hidden_tools.insert(0, _reward_tool(self.verify))
        self.engine_tools = ToolSet([*self.tools.values(), *hidden_tools])

    @property
    def agent_tools(self) -> ToolSet:
        """The tools a model is offered."""
        assert isinstance(self.tools, ToolSet)
        return self.tools

    def with_spec(self, **spec: Any) -> Task:
        """The same task on workspaces created with these WorkspaceSpec fields as well."""
        if not spec:
            return self
        return dataclasses.replace(self, spec={**self.spec, **spec})

    # ---- synchronous helpers (scripts, tests; async tools and setups run on a loop of their own) ----

    def create(self) -> Workspace:
        """A fresh workspace in the task's initial state; the caller destroys it."""
        ws = Workspace.create(**self.spec)
        try:
            _finish(self.setup(ws))
        except BaseException:
            ws.destroy()
            raise
        return ws

    def call(self, ws: Workspace, tool: str, **args: Any) -> str:
        """Run one of the agent's tools on `ws`, from synchronous code."""
        out = _finish(self.engine_tools[tool].execute(ws, args))
        if not isinstance(out, str):
            raise TypeError(f"tool {tool!r} returned {type(out).__name__}, not an observation string")
        return out

    def score(self, ws: Workspace) -> Verdict:
        """(score, detail) of `ws`'s state."""
        if self.verify is None:
            raise ValueError(f"task {self.id} has no verifier")
        return _verdict(self.verify(ws))

    def reward(self, ws: Workspace) -> float:
        return self.score(ws)[0]


def _reward_tool(verify: Verifier) -> Tool:
    def execute(ws: Workspace, args: dict[str, Any]) -> str:
        score, detail = _verdict(verify(ws))
        return f"reward={score:.4f}\n{detail}"

    return Tool(REWARD_TOOL, execute, description="the task's verifier (hidden from the agent)")


def _invalid_tool() -> Tool:
    def execute(_ws: Any, args: dict[str, Any]) -> str:
        return f"invalid tool call: {args.get('error', '')}"

    return Tool(INVALID_TOOL, execute, description="the harness's answer to a malformed tool call")


def by_id(tasks: Sequence[Task]) -> dict[str, Task]:
    return {t.id: t for t in tasks}


__all__ = ["INVALID_TOOL", "REWARD_TOOL", "Task", "Verdict", "Verifier", "by_id", "invalid_call", "parse_reward"]


def _finish(out: Any) -> Any:
    """The result of a sync callable, or of an async one run to completion from sync code."""
    if not inspect.isawaitable(out):
        return out

    async def wait() -> Any:
        return await out

    return asyncio.run(wait())
