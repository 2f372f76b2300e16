"""Task environments on the workspace templates: a desktop (GUI) task and a web-shop task.

Each factory returns a TaskEnv: how to build the initial workspace (spec + setup), the tools
an agent may call (`tool(ws, **args) -> str`), and a verifiable `reward(ws) -> float` that
reads the workspace's real state (a file on disk, rows in PostgreSQL), never the transcript.

Typical use with live forks: build one workspace with env.create(), fork it once per rollout,
let each rollout call tools on its clone, score the clone with env.reward(clone).

The modules import only bunshinfork's public API, so they do not depend on the rest of
bunshinrl. Adapting a TaskEnv to bunshinrl.Environment takes one line per tool:
Tool(name, lambda ws, args, fn=fn: fn(ws, **args)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bunshinfork import Workspace

ToolFn = Callable[..., str]


@dataclass(frozen=True)
class TaskEnv:
    name: str
    prompt: str
    setup: Callable[[Workspace], None]
    tools: dict[str, ToolFn]
    reward: Callable[[Workspace], float]
    # Changes whenever setup would build a different initial state (cache key for rollouts).
    fingerprint: str
    spec: dict[str, Any] = field(default_factory=dict)
    tool_descriptions: dict[str, str] = field(default_factory=dict)

    def create(self) -> Workspace:
        """A fresh workspace with the task's initial state; the caller destroys it."""
        ws = Workspace.create(**self.spec)
        try:
            self.setup(ws)
        except BaseException:
            ws.destroy()
            raise
        return ws

    def call(self, ws: Workspace, tool: str, **args: Any) -> str:
        try:
            fn = self.tools[tool]
        except KeyError:
            raise KeyError(f"unknown tool {tool!r}; known: {', '.join(sorted(self.tools))}") from None
        return fn(ws, **args)


__all__ = ["TaskEnv", "ToolFn"]
