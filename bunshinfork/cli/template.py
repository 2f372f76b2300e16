"""`bunshin template create|ls|rm`: warm templates (bunshinfork.images.templates); and the
`--image` and `--template` options that `bunshin create` takes from here."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..images import templates, warm
from ..workspace import Workspace
from .common import Verb, positive_float


def _image(text: str) -> str:
    """A bare image name means the local Docker engine's, as `docker run IMAGE` does."""
    return text if text.startswith(("docker:", "oci:", "registry:")) else f"docker:{text}"


def _tls_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-verify", choices=("true", "false"),
                   help="verify a registry:REF's TLS (default: yes, except on loopback, as Docker does)")


def _apply_tls(args: argparse.Namespace) -> None:
    if getattr(args, "tls_verify", None) is not None:
        # skopeo runs in this process's environment (images.registry reads it).
        os.environ["BUNSHIN_REGISTRY_TLS_VERIFY"] = "1" if args.tls_verify == "true" else "0"


def configure(p: argparse.ArgumentParser) -> None:
    subs = p.add_subparsers(dest="template_cmd", metavar="ACTION", required=True)
    c = subs.add_parser("create", help="start a workspace from an image, wait until it is ready, save it as NAME")
    c.add_argument("name")
    c.add_argument("--from", dest="source", required=True, metavar="IMAGE", type=_image,
                   help="docker:IMAGE (or a bare name), oci:DIR[:TAG] or registry:REF")
    c.add_argument("--start", metavar="CMD",
                   help="a command started in the background ('entrypoint': the image's Entrypoint and Cmd)")
    c.add_argument("--ready", metavar="CMD", help="a command run until it exits 0 before the snapshot is taken")
    c.add_argument("--ready-timeout", metavar="S", type=positive_float, default=60.0,
                   help="seconds the ready command has to succeed (default 60)")
    c.add_argument("--network", choices=("none", "bridge"), help="network mode of the template's workspace")
    c.add_argument("--json", action="store_true", help="print the template as JSON")
    _tls_option(c)
    ls = subs.add_parser("ls", help="list templates and saved snapshots (one namespace)")
    ls.add_argument("--json", action="store_true")
    rm = subs.add_parser("rm", help="remove templates or saved snapshots by name or id")
    rm.add_argument("names", nargs="+")


def run(args: argparse.Namespace) -> int:
    if args.template_cmd == "create":
        _apply_tls(args)
        spec: dict[str, Any] = {"network": args.network} if args.network else {}
        info = warm.create(args.name, args.source, start=args.start, ready=args.ready,
                                ready_timeout=args.ready_timeout, **spec)
        print(json.dumps(info.as_dict(), indent=2, sort_keys=True) if args.json else info.name)
        return 0
    if args.template_cmd == "ls":
        rows = templates.ls()
        if args.json:
            print(json.dumps([r.as_dict() for r in rows], indent=2, sort_keys=True))
            return 0
        print(f"{'NAME':<24} {'ID':<18} {'KIND':<9} SOURCE")
        for r in rows:
            print(f"{r.name or '-':<24} {r.snapshot_id:<18} {r.kind:<9} {r.source}")
        return 0
    for name in args.names:
        templates.rm(name)
        print(name)
    return 0


def add_create_args(p: argparse.ArgumentParser) -> None:
    """`bunshin create`'s image and template options."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--image", metavar="IMAGE", type=_image,
                   help="an image as the rootfs, its Entrypoint and Cmd started as the workspace's service")
    g.add_argument("--template", metavar="NAME", help="fork a warm template (bunshin template create)")
    _tls_option(p)


def create(args: argparse.Namespace, overrides: dict[str, Any]) -> Workspace | None:
    """The workspace `bunshin create --image/--template` asks for; None without either."""
    _apply_tls(args)
    if args.template:
        return Workspace.create(template=args.template, timeout=args.timeout, **overrides)
    if args.image:
        return Workspace.create(timeout=args.timeout, **{**overrides, "rootfs": args.image, "start": "entrypoint"})
    return None


VERB = Verb("template", "warm templates: create NAME --from IMAGE [--start CMD] [--ready CMD], ls, rm",
            configure, run)
