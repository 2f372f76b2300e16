"""The `bunshin` command line: create, exec in, list, inspect, fork and remove workspaces.

It follows runc and podman: `bunshin [--root DIR] exec [OPTIONS] ID CMD [ARG...]` (options
end at the command; `--` is optional), -e/-w/-u/-i/-t, `ps`/`ls` with -q, -a and
--format json, pause/unpause/kill, `rm -f`, and podman's exit statuses: 125 for an error of
bunshin itself (usage included), 126 when the command cannot be invoked or the workspace is
in the wrong state, 127 when the command is not found, otherwise the command's own.

As crun has one file per verb, each verb is a module of this package with `configure(parser)`
and `run(args)`, and VERBS below is the one list that wires them. Errors the user can act on
(BunshinError) are printed as one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import __version__, state
from ..errors import BunshinError, WorkspaceNotFound, WorkspaceStateError
from . import create, doctor, fork, gc, info, kill, memory, pause, ps, rm, serve, snapshot, storage, template, unpause
from . import exec as exec_
from .common import EXIT_CANNOT_INVOKE, EXIT_RUNTIME, PROG, UsageError, Verb

__all__ = ["SUBCOMMANDS", "VERBS", "Verb", "build_parser", "main"]

# Help lists them in this order.
VERBS: tuple[Verb, ...] = (
    create.VERB, exec_.VERB, ps.VERB, ps.LS, info.VERB, memory.VERB, pause.VERB, unpause.VERB, kill.VERB,
    rm.VERB, gc.VERB, doctor.VERB, fork.VERB, snapshot.VERB, template.VERB, storage.VERB, serve.VERB,
)
SUBCOMMANDS: dict[str, Verb] = {v.name: v for v in VERBS}
assert len(SUBCOMMANDS) == len(VERBS), "two verbs share a name"


class Parser(argparse.ArgumentParser):
    """argparse with podman's status for a usage error (125) instead of 2, which also records
    which of its options take a value (for splitting off an exec's command)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.takes_value: dict[str, bool] = {}
        self.verbs: dict[str, Parser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        for option in action.option_strings:
            self.takes_value[option] = action.nargs != 0
        return action

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_RUNTIME)


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="Create, run commands in and live-fork container workspaces.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--root", metavar="DIR", help=f"state directory (default {state.RUN_ROOT})")
    subs = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True, parser_class=Parser)
    for verb in VERBS:
        p = subs.add_parser(verb.name, help=verb.help, description=verb.help)
        verb.configure(p)
        p.set_defaults(verb=verb, verb_parser=p)
        parser.verbs[verb.name] = p
    return parser


def _split_command(parser: Parser, argv: list[str]) -> tuple[list[str], list[str] | None]:
    """For a verb that runs a command: (its options and id, the command); (argv, None) else.

    The command starts at `--` or at the first bare word after the workspace id, so that
    `exec ID ls -la` hands `-la` to ls, as podman does.
    """
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # global options, --root DIR among them
        i += 2 if parser.takes_value.get(argv[i], False) else 1
    verb = SUBCOMMANDS.get(argv[i]) if i < len(argv) else None
    if verb is None or not verb.takes_command:
        return argv, None
    takes_value = parser.verbs[verb.name].takes_value
    positionals = 0
    i += 1
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if word.startswith("-") and len(word) > 1:
            # -eK=V and --env=K=V carry their value; -it is two flags.
            opt = word.split("=", 1)[0] if word.startswith("--") else word[:2]
            value = takes_value.get(opt, False)
            attached = "=" in word if word.startswith("--") else len(word) > 2 and value
            i += 2 if value and not attached else 1
            continue
        if positionals == 1:
            return argv[:i], argv[i:]
        positionals += 1
        i += 1
    return argv, []


def _parse(parser: Parser, argv: list[str]) -> argparse.Namespace:
    head, tail = _split_command(parser, argv)
    args = parser.parse_args(head)
    if tail is not None:
        args.command = tail
    return args


def _exit_status(e: BunshinError) -> int:
    return EXIT_CANNOT_INVOKE if isinstance(e, WorkspaceStateError) and not isinstance(e, WorkspaceNotFound) \
        else EXIT_RUNTIME


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: --help, --version and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_RUNTIME)
    verb: Verb = args.verb
    saved_root = state.RUN_ROOT
    try:
        if args.root:
            state.RUN_ROOT = Path(args.root).absolute()
        if verb.needs_root:
            state.require_root()
        return verb.run(args)
    except UsageError as e:
        # The same shape and exit status as argparse's own usage errors.
        verb_parser: argparse.ArgumentParser = args.verb_parser
        print(verb_parser.format_usage(), end="", file=sys.stderr)
        print(f"{verb_parser.prog}: error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except BunshinError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return _exit_status(e)
    except KeyboardInterrupt:
        # The foreground command's connection is closed on the way out, which kills it inside.
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `bunshin exec ... | head`: the reader left; stop quietly as other tools do.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        state.RUN_ROOT = saved_root
