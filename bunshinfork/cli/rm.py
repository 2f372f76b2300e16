"""`bunshin rm [-f] ID... | --all`: remove workspaces (Workspace.destroy)."""

from __future__ import annotations

import argparse
import sys

from .. import state
from ..errors import BunshinError
from ..workspace import Workspace
from .common import EXIT_RUNTIME, PROG, UsageError, Verb, listed, workspace_id


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="*", metavar="ID", type=workspace_id)
    p.add_argument("-a", "--all", action="store_true", help="remove every workspace")
    p.add_argument("-f", "--force", action="store_true", help="kill running and paused workspaces first")


def run(args: argparse.Namespace) -> int:
    """podman's rm: a running or paused workspace needs -f (status 2 without), an unknown id is
    status 1; what the others hold is removed either way."""
    if args.all == bool(args.ids):
        raise UsageError("rm takes either workspace ids or --all")
    status = 0
    ids = [info.id for info in listed(True)] if args.all else args.ids
    for ws_id in ids:
        try:
            rec = state.Record.load(ws_id)
        except (FileNotFoundError, ValueError, TypeError):
            print(f"{PROG}: error: no workspace {ws_id!r}", file=sys.stderr)
            status = max(status, 1)
            continue
        ws = Workspace(rec)
        if ws.is_running() and not args.force:
            print(f"{PROG}: error: workspace {ws_id} is {ws.info().state}; rm -f kills it first", file=sys.stderr)
            status = 2
            continue
        try:
            ws.destroy()
        except BunshinError as e:
            # Keep going: one stuck workspace must not shield the others from removal.
            print(f"{PROG}: error: {e}", file=sys.stderr)
            status = EXIT_RUNTIME
            continue
        print(ws_id)
    return status


VERB = Verb("rm", "remove workspaces (-f: running ones too)", configure, run)
