"""`bunshin create`: create and start a workspace (Workspace.create); prints its id."""

from __future__ import annotations

import argparse
from typing import Any

from .. import spec
from ..errors import SpecError
from ..workspace import Workspace
from . import template
from .common import Verb, key_value, positive_float


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rootfs", help="'host' (default), 'debian', 'docker:IMAGE', 'oci:DIR[:TAG]', 'registry:REF' "
                   "or an absolute directory")
    p.add_argument("--hostname", help="host name inside the workspace (default: its id)")
    p.add_argument("--memory", metavar="SIZE", help="memory limit, e.g. 512M or 2G")
    p.add_argument("--disk", metavar="SIZE", help="what the workspace may write (its layer, /tmp, /dev/shm), e.g. 1G")
    p.add_argument("--pids", metavar="N", type=int, help="maximum number of processes")
    p.add_argument("--network", choices=spec.NETWORK_MODES, help="network mode (default: none)")
    p.add_argument("--nat", action="store_true", help="masquerade a bridge network to the host's uplink")
    p.add_argument("--userns", action="store_true",
                   help="a user namespace of its own: root inside is host uid 100000 (not with --rootfs host)")
    p.add_argument("--storage-dir", metavar="DIR", help="where the writable layer lives (btrfs: subvolumes)")
    p.add_argument("-e", "--env", metavar="K=V", type=key_value, action="append", default=[],
                   help="environment of every command (repeatable)")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help="the workspace's lifetime: its init ends it after S seconds (default: none)")
    template.add_create_args(p)


def run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.memory is not None:
        # Parsed here so the error names the flag the user typed, not the spec field.
        overrides["memory_limit"] = spec.parse_size(args.memory, "--memory")
    if args.disk is not None:
        overrides["disk_limit"] = spec.parse_size(args.disk, "--disk")
    for flag, field_name in (("rootfs", "rootfs"), ("hostname", "hostname"), ("pids", "pids_limit"),
                             ("network", "network"), ("storage_dir", "storage_dir")):
        value = getattr(args, flag)
        if value is not None:
            overrides[field_name] = value
    if args.nat:
        if args.network != "bridge":
            raise SpecError("--nat needs --network bridge")
        overrides["nat"] = True
    if args.userns:
        overrides["userns"] = True
    if args.env:
        overrides["env"] = dict(args.env)
    ws = template.create(args, overrides) or Workspace.create(timeout=args.timeout, **overrides)
    print(ws.id)
    return 0


VERB = Verb("create", "create and start a workspace; prints its id", configure, run)
