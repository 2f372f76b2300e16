"""`bunshin ps` (and `ls`): list workspaces (Workspace.list), with what each costs."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import asdict

from ..errors import BunshinError
from ..workspace import MemoryStats, Workspace, WorkspaceInfo
from .common import Verb, human, listed, memory_dict, print_json


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-a", "--all", action="store_true", help="also list workspaces whose init has ended")
    p.add_argument("-q", "--quiet", action="store_true", help="print the ids only")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")


def _memory_of(info: WorkspaceInfo) -> MemoryStats | None:
    if info.state == "dead":
        return None
    # The workspace may be destroyed by someone else between listing and measuring.
    with contextlib.suppress(BunshinError, OSError, ValueError):
        return Workspace.connect(info.id).memory()
    return None


def run(args: argparse.Namespace) -> int:
    infos = listed(args.all)
    if args.quiet:
        for info in infos:
            print(info.id)
        return 0
    rows = [(info, _memory_of(info)) for info in infos]
    if args.format == "json":
        print_json([
            {**asdict(info), "memory": None if mem is None else memory_dict(mem, per_process=False)}
            for info, mem in rows
        ])
        return 0
    table = [("ID", "STATE", "HOSTNAME", "ROOTFS", "PID", "MEMORY", "PSS")]
    for info, mem in rows:
        table.append((
            info.id, info.state, info.hostname, info.rootfs, str(info.init_pid),
            human(mem.cgroup_usage if mem else None), human(mem.pss if mem else None),
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


VERB = Verb("ps", "list workspaces", configure, run)
LS = Verb("ls", "list workspaces (same as ps)", configure, run)
