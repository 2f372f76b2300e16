"""Tools: what a policy can call inside a workspace."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from bunshinfork import Workspace

from ._async import run_blocking

Execute = Callable[[Workspace, dict[str, Any]], "str | Awaitable[str]"]


@dataclass(frozen=True)
class Tool:
    """A named operation on a workspace returning an observation string.

    deterministic=False declares that two executions from the same state may observe different
    things (clocks, randomness, remote services); such a tool is never served from the prefix
    cache or from speculation, because its recorded result is not what a fresh call would see.
    """

    name: str
    execute: Execute
    deterministic: bool = True
    description: str = ""

    async def run(self, ws: Workspace, args: Mapping[str, Any]) -> str:
        if inspect.iscoroutinefunction(self.execute):
            out = await self.execute(ws, dict(args))
        else:
            # A sync tool blocks on the workspace (a command, a file read): keep it off the loop.
            out = await run_blocking(self.execute, ws, dict(args))
            if inspect.isawaitable(out):
                out = await out
        if not isinstance(out, str):
            raise TypeError(f"tool {self.name!r} returned {type(out).__name__}, not an observation string")
        return out


class ToolSet(Mapping[str, Tool]):
    """Tools by name; unknown names fail with the list of known ones."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self._tools[t.name] = t

    def __getitem__(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise KeyError(f"unknown tool {name!r}; known: {', '.join(sorted(self._tools))}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)


def command_observation(stdout: str, stderr: str, exit_code: int, limit: int = 4000) -> str:
    """The text a shell tool returns: output, then the exit status when it is not 0."""
    text = stdout + (("\n[stderr]\n" + stderr) if stderr else "")
    if exit_code:
        text += f"\n[exit {exit_code}]"
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def shell_tool(name: str, command: Callable[[dict[str, Any]], str], *, timeout: float = 120,
               deterministic: bool = True, description: str = "") -> Tool:
    """A tool that runs the shell command `command(args)` and observes its output."""

    def execute(ws: Workspace, args: dict[str, Any]) -> str:
        r = ws.commands.run(command(args), timeout=timeout)
        return command_observation(r.stdout, r.stderr, r.exit_code)  # type: ignore[union-attr]

    return Tool(name, execute, deterministic, description)
