"""What the project families (coding, swe) share: the project's directory in the workspace, a
shell command run there, paths kept inside it, the tools that read and edit its files, and the
verifier's verdict from the last test log and the fixed source."""

from __future__ import annotations

import shlex
from collections.abc import Callable

from bunshinfork import BunshinError, Workspace

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


def _read(ws: Workspace, path: str) -> str | None:
    try:
        return str(ws.files.read(path))
    except BunshinError:
        return None


def verdict(ws: Workspace, log: str, passed: Callable[[str], bool], source: str, fix: str,
            passing: str) -> tuple[float, str]:
    """1.0 (`passing`) when the last test run's log says the tests `passed`; else 0.5 when the
    source holds the fix (not tested since), 0.0 when it does not or is gone."""
    if passed(_read(ws, log) or ""):
        return 1.0, passing
    src = _read(ws, source)
    if src is None:
        return 0.0, "no sources"
    return (0.5, "fixed, not tested") if fix in src else (0.0, "tests fail")
