"""`bunshin snapshot ID`: snapshot a running workspace and save it durably (Snapshot.save)."""

from __future__ import annotations

import argparse

from .common import Verb, connect, workspace_id


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=workspace_id)
    p.add_argument("--out", metavar="PATH",
                   help="where to save it (a new directory; default /var/lib/bunshin/snapshots/<id>)")


def run(args: argparse.Namespace) -> int:
    ws = connect(args.id)
    # A snapshot outlives this command only as a durable save; the retained one is released.
    with ws.snapshot() as snap:
        out = args.out or f"/var/lib/bunshin/snapshots/{snap.id}"
        path = snap.save(out).result()
    print(path)
    return 0


VERB = Verb("snapshot", "snapshot a running workspace and save it durably; prints the path", configure, run)
