"""What the project families (coding, swe) share: the project's directory in the workspace, a
shell command run there, paths kept inside it, and the tools that read and edit its files."""

from __future__ import annotations

import shlex

from bunshinfork import Workspace

from ..calls.tools import command_observation
from ._common import agent_tool

PROJ = "/root/proj"


def sh(ws: Workspace, cmd: str, timeout: float = 120) -> str:
    """`cmd` run in the project's directory, as the agent sees a command's result."""
    r = ws.commands.run(cmd, timeout=timeout, cwd=PROJ)
    return command_observation(r.stdout, r.stderr, r.exit_code)  # type: ignore[union-attr]


def rel(path: str) -> str:
    """A path the agent gave, refused unless it stays inside the project."""
    if path.startswith("/") or ".." in path.split("/"):
        raise ValueError(f"path must stay inside the project: {path!r}")
    return path


@agent_tool
def cat(ws: Workspace, path: str) -> str:
    """Read a file (fast; the first 3000 characters)."""
    return sh(ws, f"head -c 3000 {shlex.quote(rel(path))}")


@agent_tool
def edit(ws: Workspace, path: str, find: str, replace: str) -> str:
    """Replace every occurrence of `find` in a file by `replace` (fast)."""
    full = f"{PROJ}/{rel(path)}"
    text = str(ws.files.read(full))
    n = text.count(find)
    if n:
        ws.files.write(full, text.replace(find, replace))
    return f"edited {path}: {n} replacement(s)"
