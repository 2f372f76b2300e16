"""`bunshin unpause ID...`: resume paused workspaces (Workspace.resume)."""

from __future__ import annotations

import argparse

from ..errors import WorkspaceStateError
from .common import Verb, connect, ids_args


def run(args: argparse.Namespace) -> int:
    for ws_id in args.ids:
        ws = connect(ws_id)
        if ws.info().state != "paused":
            raise WorkspaceStateError(f"workspace {ws_id} is not paused")
        ws.resume()
        print(ws_id)
    return 0


configure = ids_args
VERB = Verb("unpause", "resume paused workspaces", configure, run)
