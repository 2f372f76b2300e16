"""`bunshin memory ID`: what a workspace costs the host (Workspace.memory)."""

from __future__ import annotations

import argparse

from .common import Verb, connect, human, id_json_args, memory_dict, print_json


def run(args: argparse.Namespace) -> int:
    mem = connect(args.id).memory()
    if args.json:
        print_json(memory_dict(mem))
        return 0
    host = mem.host
    print(f"{'host cost:':<14}{human(host.total)} (anon {human(host.anon)}, shmem/tmpfs {human(host.shmem)}, "
          f"page cache {human(host.page_cache)}, kernel {human(host.kernel)})")
    for k in ("rss", "pss", "uss", "shared", "cgroup_usage"):
        print(f"{k + ':':<14}{human(getattr(mem, k))}")
    print(f"{'processes:':<14}{mem.processes}")
    return 0


configure = id_json_args
VERB = Verb("memory", "show what a workspace costs the host (anon, tmpfs, page cache, kernel), and its "
            "rss, pss, uss", configure, run)
