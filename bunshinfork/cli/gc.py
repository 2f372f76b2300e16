"""`bunshin gc`: remove what crashed creators left behind (bunshinfork.gc)."""

from __future__ import annotations

import argparse

from .. import pipeline
from .common import Verb, json_args, print_json

# What `gc` prints before each removed item, by kind.
_KINDS = {"workspaces": "workspace", "snapshots": "snapshot"}


def run(args: argparse.Namespace) -> int:
    removed = pipeline.gc()
    if args.json:
        print_json(removed)
        return 0
    for kind, items in removed.items():
        for item in items:
            print(f"{_KINDS.get(kind, kind)} {item}")
    if not any(removed.values()):
        print("nothing to remove")
    return 0


configure = json_args
VERB = Verb("gc", "remove what crashed creators left behind", configure, run)
