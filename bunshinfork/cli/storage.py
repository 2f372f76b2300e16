"""`bunshin storage [show|setup]`: where layers live; setup makes the btrfs layer store (fs.store)."""

from __future__ import annotations

import argparse

from .. import spec
from ..fs import store
from .common import Verb


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=("show", "setup"), default="show",
                   help="show where layers live (default), or set up the btrfs layer store")
    p.add_argument("--size", metavar="SIZE", help="setup: the sparse image's size (default 32G, at most half "
                   "the free space)")


def run(args: argparse.Namespace) -> int:
    if args.action == "setup":
        store.setup(spec.parse_size(args.size, "--size") if args.size else None)
    check = store.check_store()
    print(f"{check.level}  {check.detail}")
    return 0 if check.ok or args.action == "show" else 1


VERB = Verb("storage", "where layers live; 'setup' makes the btrfs layer store", configure, run)
