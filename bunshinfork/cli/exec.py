"""`bunshin exec [OPTIONS] ID CMD [ARG...]`: one foreground command in a workspace (foreground.run)."""

from __future__ import annotations

import argparse
import sys

from ..errors import CommandError, CommandTimeout, WorkspaceStateError
from . import foreground
from .common import (
    EXIT_CANNOT_INVOKE,
    EXIT_TIMEOUT,
    PROG,
    UsageError,
    Verb,
    connect,
    key_value,
    positive_float,
    workspace_id,
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=workspace_id)
    p.add_argument("-e", "--env", metavar="K=V", type=key_value, action="append", default=[],
                   help="extra environment variable (repeatable)")
    p.add_argument("-w", "--workdir", "--cwd", dest="cwd", metavar="DIR",
                   help="working directory inside the workspace (default: the user's home)")
    p.add_argument("-u", "--user", metavar="USER", help="run as this user of the workspace (default: root)")
    p.add_argument("-i", "--interactive", action="store_true", help="pass this process's stdin to the command")
    p.add_argument("-t", "--tty", action="store_true", help="run the command on a terminal")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help="kill the command after S seconds (exit status 124; default: no limit)")


def run(args: argparse.Namespace) -> int:
    if not args.command:
        raise UsageError("exec needs a command: bunshin exec [OPTIONS] ID CMD [ARG...]")
    try:
        ws = connect(args.id)
        if ws.info().state == "paused":
            raise WorkspaceStateError(f"workspace {args.id} is paused; 'bunshin unpause {args.id}' resumes it")
        return foreground.run(ws, list(args.command), env=dict(args.env) or None, cwd=args.cwd, user=args.user,
                              interactive=args.interactive, terminal=args.tty, timeout=args.timeout)
    except CommandError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return foreground.failure_code(e)
    except CommandTimeout as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_TIMEOUT
    except WorkspaceStateError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_INVOKE


VERB = Verb("exec", "run a command in a workspace: bunshin exec [OPTIONS] ID CMD [ARG...]", configure, run,
            takes_command=True)
