"""`bunshin fork ID | --snapshot PATH`: live-fork into N clones (Workspace.fork, Snapshot.fork)."""

from __future__ import annotations

import argparse
import sys

from .. import memory
from ..workspace import Snapshot, Workspace
from .common import PROG, UsageError, Verb, connect, print_json, workspace_id


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", type=workspace_id, help="the running workspace to fork")
    p.add_argument("-n", "--count", type=int, default=1, help="number of clones (default 1)")
    p.add_argument("--memory", default="auto", choices=("auto", *memory.ENGINES),
                   help="memory engine (default auto: cow with /dev/bunshin, else ksm on Linux >= 6.4, else copy)")
    p.add_argument("--snapshot", metavar="PATH", help="fork a snapshot saved by 'bunshin snapshot' instead")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    if bool(args.id) == bool(args.snapshot):
        raise UsageError("fork takes either a workspace id or --snapshot PATH")
    if args.count < 1:
        raise UsageError("--count must be at least 1")
    if args.snapshot:
        snap = Snapshot.load(args.snapshot)
        try:
            results = snap.fork(args.count, memory=args.memory)
        finally:
            snap.release()
    else:
        results = connect(args.id).fork(args.count, memory=args.memory)
    clones = [r for r in results if isinstance(r, Workspace)]
    errors = [r for r in results if not isinstance(r, Workspace)]
    if args.json:
        print_json({"clones": [c.id for c in clones], "errors": [str(e) for e in errors]})
    else:
        for c in clones:
            print(c.id)
        for e in errors:
            print(f"{PROG}: error: a clone failed: {e}", file=sys.stderr)
    return 1 if errors else 0


VERB = Verb("fork", "live-fork a running workspace (or a saved snapshot) into N clones", configure, run)
