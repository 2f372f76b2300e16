"""`bunshin kill [-s SIGNAL] ID...`: send a signal to workspaces (Workspace.signal)."""

from __future__ import annotations

import argparse
import signal

from .common import Verb, connect, ids_args


def _signal(text: str) -> int:
    name = text.upper()
    try:
        return int(name) if name.isdigit() else int(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a signal") from None


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-s", "--signal", type=_signal, default=signal.SIGKILL,
                   help="signal to send (default KILL, which ends the workspace; TERM, INT, HUP, QUIT, USR1 and "
                        "USR2 are forwarded to every process in it)")
    ids_args(p)


def run(args: argparse.Namespace) -> int:
    for ws_id in args.ids:
        connect(ws_id).signal(args.signal)
        print(ws_id)
    return 0


VERB = Verb("kill", "send a signal to workspaces (default KILL: ends them; rm removes them)", configure, run)
