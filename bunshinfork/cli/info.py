"""`bunshin info ID`: a workspace's record (Workspace.info)."""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict

from .common import Verb, connect, human, id_json_args, print_json


def run(args: argparse.Namespace) -> int:
    info = connect(args.id).info()
    if args.json:
        print_json(asdict(info))
        return 0
    created = datetime.datetime.fromtimestamp(info.created_at).astimezone().isoformat(timespec="seconds")
    lines = [
        ("id", info.id),
        ("state", info.state),
        ("hostname", info.hostname),
        ("init pid", str(info.init_pid)),
        ("created", created),
        ("rootfs", f"{info.rootfs} ({info.rootfs_digest})" if info.rootfs_digest else info.rootfs),
        ("storage", info.storage),
        ("network", json.dumps(info.network, sort_keys=True)),
        ("cgroup", info.cgroup_version),
        ("memory limit", human(info.memory_limit) if info.memory_limit else "none"),
        ("pids limit", str(info.pids_limit) if info.pids_limit else "none"),
        ("parent", info.parent or "-"),
    ]
    for k, v in lines:
        print(f"{k + ':':<14}{v}")
    return 0


configure = id_json_args
VERB = Verb("info", "show a workspace's record", configure, run)
