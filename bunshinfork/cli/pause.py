"""`bunshin pause ID...`: freeze every process of workspaces (Workspace.pause)."""

from __future__ import annotations

import argparse

from ..errors import WorkspaceStateError
from .common import Verb, connect, ids_args


def run(args: argparse.Namespace) -> int:
    for ws_id in args.ids:
        ws = connect(ws_id)
        if ws.info().state == "paused":
            raise WorkspaceStateError(f"workspace {ws_id} is paused already")
        ws.pause()
        print(ws_id)
    return 0


configure = ids_args
VERB = Verb("pause", "freeze every process of workspaces", configure, run)
