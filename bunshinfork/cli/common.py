"""What the verbs of `bunshin` share: the Verb record, argument types, output helpers and exit statuses."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .. import state
from ..errors import BunshinError, WorkspaceStateError
from ..workspace import MemoryStats, Workspace, WorkspaceInfo
from . import foreground

PROG = "bunshin"
# podman's exit statuses
EXIT_RUNTIME = 125
EXIT_CANNOT_INVOKE = foreground.NOT_INVOKABLE
EXIT_TIMEOUT = 124  # exec --timeout ran out (coreutils timeout's status)
Handler = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Verb:
    """One `bunshin NAME ...` subcommand: a module of this package gives its configure and run.

    takes_command: the verb's options end at its first positional argument after the
    workspace id (or at `--`); everything from there is handed over verbatim as `args.command`,
    as podman's exec does (bunshin exec -e K=V ID ls -la).
    """

    name: str
    help: str
    configure: Configure
    run: Handler
    needs_root: bool = True
    takes_command: bool = False


class UsageError(Exception):
    """A usage mistake argparse cannot express; reported like argparse's own errors."""


# ---- argument types ----


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def workspace_id(text: str) -> str:
    # Ids name directories under the state root; a path must not reach outside it.
    if not text or "/" in text or "\0" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"{text!r} is not a workspace id (see 'bunshin ls')")
    return text


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"timeout must be positive, got {text!r}")
    return v


def json_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def id_json_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=workspace_id)
    json_args(p)


def ids_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="+", metavar="ID", type=workspace_id)


# ---- output ----


def human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(size) < 1024 or unit == "T":
            return f"{int(size)}B" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{n}B"  # unreachable: the loop returns at "T"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def memory_dict(mem: MemoryStats, per_process: bool = True) -> dict[str, Any]:
    d = asdict(mem)
    d["host"] = mem.host.as_dict()
    if per_process:
        d["per_process"] = {str(pid): row for pid, row in mem.per_process.items()}
    else:
        del d["per_process"]
    return d


# ---- workspaces ----


def connect(ws_id: str) -> Workspace:
    try:
        return Workspace.connect(ws_id)
    except BunshinError:
        raise
    except (OSError, ValueError, TypeError) as e:
        # A half-written or foreign state directory: the library only maps a missing one.
        raise WorkspaceStateError(
            f"workspace {ws_id}: unreadable state ({e}); 'bunshin gc' removes it"
        ) from e


def listed(include_dead: bool) -> list[WorkspaceInfo]:
    """What ps lists: the live workspaces, or with include_dead also those whose init has ended."""
    if not include_dead:
        return [info for info in Workspace.list() if info.state != "dead"]
    out = []
    for rec in state.records():
        if rec.status in ("running", "creating"):
            with contextlib.suppress(BunshinError):
                out.append(Workspace(rec).info())
    return out
