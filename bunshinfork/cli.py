"""The `bunshin` command line: create, exec in, list, inspect and remove workspaces.

It follows runc and podman: `bunshin [--root DIR] exec [OPTIONS] ID CMD [ARG...]` (options
end at the command; `--` is optional), -e/-w/-u/-i/-t, `ps`/`ls` with -q, -a and
--format json, pause/unpause/kill, `rm -f`, and podman's exit statuses: 125 for an error of
bunshin itself (usage included), 126 when the command cannot be invoked or the workspace is
in the wrong state, 127 when the command is not found, otherwise the command's own.

Every subcommand is an entry in SUBCOMMANDS (registered at the end of this module). Errors
the user can act on (BunshinError) are printed as one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import __version__, cli_exec, cli_serve, doctor, memory, pipeline, spec, state
from .errors import (
    BunshinError,
    CommandError,
    CommandTimeout,
    SpecError,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from .fs import store
from .workspace import MemoryStats, Snapshot, Workspace, WorkspaceInfo

PROG = "bunshin"
# podman's exit statuses
EXIT_RUNTIME = 125
EXIT_CANNOT_INVOKE = cli_exec.NOT_INVOKABLE
EXIT_TIMEOUT = 124  # exec --timeout ran out (coreutils timeout's status)
Handler = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Subcommand:
    """One `bunshin NAME ...` subcommand.

    takes_command: the subcommand's options end at its first positional argument after the
    workspace id (or at `--`); everything from there is handed over verbatim as `args.command`,
    as podman's exec does (bunshin exec -e K=V ID ls -la).
    """

    name: str
    help: str
    configure: Configure
    run: Handler
    needs_root: bool = True
    takes_command: bool = False


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(sub: Subcommand) -> Subcommand:
    """Add a subcommand; help lists them in registration order."""
    if sub.name in SUBCOMMANDS:
        raise ValueError(f"subcommand {sub.name!r} is already registered")
    SUBCOMMANDS[sub.name] = sub
    return sub


# ---- argument types and output helpers ----


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _workspace_id(text: str) -> str:
    # Ids name directories under the state root; a path must not reach outside it.
    if not text or "/" in text or "\0" in text or text.startswith("."):
        raise argparse.ArgumentTypeError(f"{text!r} is not a workspace id (see 'bunshin ls')")
    return text


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"timeout must be positive, got {text!r}")
    return v


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if abs(size) < 1024 or unit == "T":
            return f"{int(size)}B" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{n}B"  # unreachable: the loop returns at "T"


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))




def _connect(ws_id: str) -> Workspace:
    try:
        return Workspace.connect(ws_id)
    except BunshinError:
        raise
    except (OSError, ValueError, TypeError) as e:
        # A half-written or foreign state directory: the library only maps a missing one.
        raise WorkspaceStateError(
            f"workspace {ws_id}: unreadable state ({e}); 'bunshin gc' removes it"
        ) from e


def _memory_dict(mem: MemoryStats, per_process: bool = True) -> dict[str, Any]:
    d = asdict(mem)
    d["host"] = mem.host.as_dict()
    if per_process:
        d["per_process"] = {str(pid): row for pid, row in mem.per_process.items()}
    else:
        del d["per_process"]
    return d


# ---- create ----


def _create_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rootfs", help="'host' (default), 'debian', 'docker:IMAGE' or an absolute directory")
    p.add_argument("--hostname", help="host name inside the workspace (default: its id)")
    p.add_argument("--memory", metavar="SIZE", help="memory limit, e.g. 512M or 2G")
    p.add_argument("--disk", metavar="SIZE", help="what the workspace may write (its layer, /tmp, /dev/shm), e.g. 1G")
    p.add_argument("--pids", metavar="N", type=int, help="maximum number of processes")
    p.add_argument("--network", choices=spec.NETWORK_MODES, help="network mode (default: none)")
    p.add_argument("--nat", action="store_true", help="masquerade a bridge network to the host's uplink")
    p.add_argument("--userns", action="store_true",
                   help="a user namespace of its own: root inside is host uid 100000 (not with --rootfs host)")
    p.add_argument("--storage-dir", metavar="DIR", help="where the writable layer lives (btrfs: subvolumes)")
    p.add_argument("-e", "--env", metavar="K=V", type=_key_value, action="append", default=[],
                   help="environment of every command (repeatable)")
    p.add_argument("--timeout", type=_positive_float, metavar="S",
                   help="the workspace's lifetime: its init ends it after S seconds (default: none)")


def _create(args: argparse.Namespace) -> int:
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
    ws = Workspace.create(timeout=args.timeout, **overrides)
    print(ws.id)
    return 0


# ---- exec ----


def _exec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=_workspace_id)
    p.add_argument("-e", "--env", metavar="K=V", type=_key_value, action="append", default=[],
                   help="extra environment variable (repeatable)")
    p.add_argument("-w", "--workdir", "--cwd", dest="cwd", metavar="DIR",
                   help="working directory inside the workspace (default: the user's home)")
    p.add_argument("-u", "--user", metavar="USER", help="run as this user of the workspace (default: root)")
    p.add_argument("-i", "--interactive", action="store_true", help="pass this process's stdin to the command")
    p.add_argument("-t", "--tty", action="store_true", help="run the command on a terminal")
    p.add_argument("--timeout", type=_positive_float, metavar="S",
                   help="kill the command after S seconds (exit status 124; default: no limit)")


def _exec(args: argparse.Namespace) -> int:
    if not args.command:
        raise _UsageError("exec needs a command: bunshin exec [OPTIONS] ID CMD [ARG...]")
    try:
        ws = _connect(args.id)
        if ws.info().state == "paused":
            raise WorkspaceStateError(f"workspace {args.id} is paused; 'bunshin unpause {args.id}' resumes it")
        return cli_exec.run(ws, list(args.command), env=dict(args.env) or None, cwd=args.cwd, user=args.user,
                            interactive=args.interactive, terminal=args.tty, timeout=args.timeout)
    except CommandError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return cli_exec.failure_code(e)
    except CommandTimeout as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_TIMEOUT
    except WorkspaceStateError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_CANNOT_INVOKE


# ---- ls / info / memory ----


def _json_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _ps_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-a", "--all", action="store_true", help="also list workspaces whose init has ended")
    p.add_argument("-q", "--quiet", action="store_true", help="print the ids only")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")


def _memory_of(info: WorkspaceInfo) -> MemoryStats | None:
    if info.state == "dead":
        return None
    # The workspace may be destroyed by someone else between listing and measuring.
    with contextlib.suppress(BunshinError, OSError, ValueError):
        return Workspace.connect(info.id).memory()
    return None


def _listed(include_dead: bool) -> list[WorkspaceInfo]:
    if not include_dead:
        return [info for info in Workspace.list() if info.state != "dead"]
    out = []
    for rec in state.records():
        if rec.status in ("running", "creating"):
            with contextlib.suppress(BunshinError):
                out.append(Workspace(rec).info())
    return out


def _ls(args: argparse.Namespace) -> int:
    infos = _listed(args.all)
    if args.quiet:
        for info in infos:
            print(info.id)
        return 0
    rows = [(info, _memory_of(info)) for info in infos]
    if args.format == "json":
        _print_json([
            {**asdict(info), "memory": None if mem is None else _memory_dict(mem, per_process=False)}
            for info, mem in rows
        ])
        return 0
    table = [("ID", "STATE", "HOSTNAME", "ROOTFS", "PID", "MEMORY", "PSS")]
    for info, mem in rows:
        table.append((
            info.id, info.state, info.hostname, info.rootfs, str(info.init_pid),
            _human(mem.cgroup_usage if mem else None), _human(mem.pss if mem else None),
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _id_json_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=_workspace_id)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _info(args: argparse.Namespace) -> int:
    info = _connect(args.id).info()
    if args.json:
        _print_json(asdict(info))
        return 0
    created = datetime.datetime.fromtimestamp(info.created_at).astimezone().isoformat(timespec="seconds")
    lines = [
        ("id", info.id),
        ("state", info.state),
        ("hostname", info.hostname),
        ("init pid", str(info.init_pid)),
        ("created", created),
        ("rootfs", f"{info.rootfs} ({info.rootfs_digest})" if info.rootfs_digest else info.rootfs),
        ("storage", info.storage),
        ("network", json.dumps(info.network, sort_keys=True)),
        ("cgroup", info.cgroup_version),
        ("memory limit", _human(info.memory_limit) if info.memory_limit else "none"),
        ("pids limit", str(info.pids_limit) if info.pids_limit else "none"),
        ("parent", info.parent or "-"),
    ]
    for k, v in lines:
        print(f"{k + ':':<14}{v}")
    return 0


def _memory(args: argparse.Namespace) -> int:
    mem = _connect(args.id).memory()
    if args.json:
        _print_json(_memory_dict(mem))
        return 0
    host = mem.host
    print(f"{'host cost:':<14}{_human(host.total)} (anon {_human(host.anon)}, shmem/tmpfs {_human(host.shmem)}, "
          f"page cache {_human(host.page_cache)}, kernel {_human(host.kernel)})")
    for k in ("rss", "pss", "uss", "shared", "cgroup_usage"):
        print(f"{k + ':':<14}{_human(getattr(mem, k))}")
    print(f"{'processes:':<14}{mem.processes}")
    return 0


# ---- rm / gc ----


def _rm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="*", metavar="ID", type=_workspace_id)
    p.add_argument("-a", "--all", action="store_true", help="remove every workspace")
    p.add_argument("-f", "--force", action="store_true", help="kill running and paused workspaces first")


def _rm(args: argparse.Namespace) -> int:
    """podman's rm: a running or paused workspace needs -f (status 2 without), an unknown id is
    status 1; what the others hold is removed either way."""
    if args.all == bool(args.ids):
        raise _UsageError("rm takes either workspace ids or --all")
    status = 0
    ids = [info.id for info in _listed(True)] if args.all else args.ids
    for ws_id in ids:
        try:
            rec = state.Record.load(ws_id)
        except (FileNotFoundError, ValueError, TypeError):
            print(f"{PROG}: error: no workspace {ws_id!r}", file=sys.stderr)
            status = max(status, 1)
            continue
        ws = Workspace(rec)
        if ws.is_running() and not args.force:
            print(f"{PROG}: error: workspace {ws_id} is {ws.info().state}; rm -f kills it first", file=sys.stderr)
            status = 2
            continue
        try:
            ws.destroy()
        except BunshinError as e:
            # Keep going: one stuck workspace must not shield the others from removal.
            print(f"{PROG}: error: {e}", file=sys.stderr)
            status = EXIT_RUNTIME
            continue
        print(ws_id)
    return status


# ---- pause / unpause / kill ----


def _ids_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="+", metavar="ID", type=_workspace_id)


def _pause(args: argparse.Namespace) -> int:
    for ws_id in args.ids:
        ws = _connect(ws_id)
        if ws.info().state == "paused":
            raise WorkspaceStateError(f"workspace {ws_id} is paused already")
        ws.pause()
        print(ws_id)
    return 0


def _unpause(args: argparse.Namespace) -> int:
    for ws_id in args.ids:
        ws = _connect(ws_id)
        if ws.info().state != "paused":
            raise WorkspaceStateError(f"workspace {ws_id} is not paused")
        ws.resume()
        print(ws_id)
    return 0


def _signal(text: str) -> int:
    name = text.upper()
    try:
        return int(name) if name.isdigit() else int(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a signal") from None


def _kill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-s", "--signal", type=_signal, default=signal.SIGKILL,
                   help="signal to send (default KILL, which ends the workspace; TERM, INT, HUP, QUIT, USR1 and "
                        "USR2 are forwarded to every process in it)")
    _ids_args(p)


def _kill(args: argparse.Namespace) -> int:
    for ws_id in args.ids:
        ws = _connect(ws_id)
        if args.signal == signal.SIGKILL:
            ws._cgroup().thaw()  # a frozen task cannot act on SIGKILL
        os.kill(ws._live_init_pid(), args.signal)
        print(ws_id)
    return 0


def _gc_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


# What `gc` prints before each removed item, by kind.
_GC_KINDS = {"workspaces": "workspace", "snapshots": "snapshot"}


def _gc(args: argparse.Namespace) -> int:
    removed = pipeline.gc()
    if args.json:
        _print_json(removed)
        return 0
    for kind, items in removed.items():
        for item in items:
            print(f"{_GC_KINDS.get(kind, kind)} {item}")
    if not any(removed.values()):
        print("nothing to remove")
    return 0


# ---- fork / snapshot ----


def _fork_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", type=_workspace_id, help="the running workspace to fork")
    p.add_argument("-n", "--count", type=int, default=1, help="number of clones (default 1)")
    p.add_argument("--memory", default="auto", choices=("auto", *memory.NAMES),
                   help="memory engine (default auto: cow with /dev/bunshin, else ksm on Linux >= 6.4, else copy)")
    p.add_argument("--snapshot", metavar="PATH", help="fork a snapshot saved by 'bunshin snapshot' instead")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _fork(args: argparse.Namespace) -> int:
    if bool(args.id) == bool(args.snapshot):
        raise _UsageError("fork takes either a workspace id or --snapshot PATH")
    if args.count < 1:
        raise _UsageError("--count must be at least 1")
    if args.snapshot:
        snap = Snapshot.load(args.snapshot)
        try:
            results = snap.fork(args.count, memory=args.memory)
        finally:
            snap.release()
    else:
        results = _connect(args.id).fork(args.count, memory=args.memory)
    clones = [r for r in results if isinstance(r, Workspace)]
    errors = [r for r in results if not isinstance(r, Workspace)]
    if args.json:
        _print_json({"clones": [c.id for c in clones], "errors": [str(e) for e in errors]})
    else:
        for c in clones:
            print(c.id)
        for e in errors:
            print(f"{PROG}: error: a clone failed: {e}", file=sys.stderr)
    return 1 if errors else 0


def _snapshot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=_workspace_id)
    p.add_argument("--out", metavar="PATH",
                   help="where to save it (a new directory; default /var/lib/bunshin/snapshots/<id>)")


def _snapshot(args: argparse.Namespace) -> int:
    ws = _connect(args.id)
    # A snapshot outlives this command only as a durable save; the retained one is released.
    with ws.snapshot() as snap:
        out = args.out or f"/var/lib/bunshin/snapshots/{snap.id}"
        path = snap.save(out).result()
    print(path)
    return 0


# ---- doctor ----


def _doctor(args: argparse.Namespace) -> int:
    checks = doctor.run_checks()
    if args.json:
        _print_json([{**asdict(c), "level": c.level} for c in checks])
    else:
        print(doctor.format_checks(checks))
    return 1 if doctor.failed_required(checks) else 0


# ---- storage ----


def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=("show", "setup"), default="show",
                   help="show where layers live (default), or set up the btrfs layer store")
    p.add_argument("--size", metavar="SIZE", help="setup: the sparse image's size (default 32G, at most half "
                   "the free space)")


def _storage(args: argparse.Namespace) -> int:
    if args.action == "setup":
        store.setup(spec.parse_size(args.size, "--size") if args.size else None)
    check = store.check_store()
    print(f"{check.level}  {check.detail}")
    return 0 if check.ok or args.action == "show" else 1


# ---- registry ----

register(Subcommand("create", "create and start a workspace; prints its id", _create_args, _create))
register(Subcommand("exec", "run a command in a workspace: bunshin exec [OPTIONS] ID CMD [ARG...]",
                    _exec_args, _exec, takes_command=True))
register(Subcommand("ps", "list workspaces", _ps_args, _ls))
register(Subcommand("ls", "list workspaces (same as ps)", _ps_args, _ls))
register(Subcommand("info", "show a workspace's record", _id_json_args, _info))
register(Subcommand("memory", "show what a workspace costs the host (anon, tmpfs, page cache, kernel), and its "
                    "rss, pss, uss", _id_json_args,
                    _memory))
register(Subcommand("pause", "freeze every process of workspaces", _ids_args, _pause))
register(Subcommand("unpause", "resume paused workspaces", _ids_args, _unpause))
register(Subcommand("kill", "send a signal to workspaces (default KILL: ends them; rm removes them)",
                    _kill_args, _kill))
register(Subcommand("rm", "remove workspaces (-f: running ones too)", _rm_args, _rm))
register(Subcommand("gc", "remove what crashed creators left behind", _gc_args, _gc))
register(Subcommand("doctor", "check what this host offers bunshin", _json_args, _doctor, needs_root=False))
register(Subcommand("fork", "live-fork a running workspace (or a saved snapshot) into N clones",
                    _fork_args, _fork))
register(Subcommand("snapshot", "snapshot a running workspace and save it durably; prints the path",
                    _snapshot_args, _snapshot))
register(Subcommand("storage", "where layers live; 'setup' makes the btrfs layer store", _storage_args,
                    _storage))
register(Subcommand("serve", "serve E2B's API over HTTP for the e2b SDKs; prints the variables to export",
                    cli_serve.configure, cli_serve.run))


# ---- entry point ----


class _UsageError(Exception):
    """A usage mistake argparse cannot express; reported like argparse's own errors."""


class _Parser(argparse.ArgumentParser):
    """argparse with podman's status for a usage error (125) instead of 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_RUNTIME)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Create, run commands in and live-fork container workspaces.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--root", metavar="DIR", help=f"state directory (default {state.RUN_ROOT})")
    subs = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True, parser_class=_Parser)
    for sub in SUBCOMMANDS.values():
        p = subs.add_parser(sub.name, help=sub.help, description=sub.help)
        sub.configure(p)
        p.set_defaults(_sub=sub, _parser=p)
    return parser


def _takes_value(parser: argparse.ArgumentParser, option: str) -> bool:
    action = parser._option_string_actions.get(option)
    return action is not None and action.nargs != 0


def _split_command(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str] | None]:
    """For a subcommand that runs a command: (its options and id, the command); (argv, None) else.

    The command starts at `--` or at the first bare word after the workspace id, so that
    `exec ID ls -la` hands `-la` to ls, as podman does.
    """
    i = 0
    while i < len(argv) and argv[i].startswith("-"):  # global options, --root DIR among them
        i += 2 if _takes_value(parser, argv[i]) else 1
    sub = SUBCOMMANDS.get(argv[i]) if i < len(argv) else None
    if sub is None or not sub.takes_command:
        return argv, None
    sub_parser = parser._subparsers._group_actions[0].choices[sub.name]  # type: ignore[union-attr]
    positionals = 0
    i += 1
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if word.startswith("-") and len(word) > 1:
            # -eK=V and --env=K=V carry their value; -it is two flags.
            opt = word.split("=", 1)[0] if word.startswith("--") else word[:2]
            attached = "=" in word if word.startswith("--") else len(word) > 2 and _takes_value(sub_parser, opt)
            i += 2 if _takes_value(sub_parser, opt) and not attached else 1
            continue
        if positionals == 1:
            return argv[:i], argv[i:]
        positionals += 1
        i += 1
    return argv, []


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
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
    sub: Subcommand = args._sub
    saved_root = state.RUN_ROOT
    try:
        if args.root:
            state.RUN_ROOT = Path(args.root).absolute()
        if sub.needs_root:
            state.require_root()
        return sub.run(args)
    except _UsageError as e:
        # The same shape and exit status as argparse's own usage errors.
        sub_parser: argparse.ArgumentParser = args._parser
        print(sub_parser.format_usage(), end="", file=sys.stderr)
        print(f"{sub_parser.prog}: error: {e}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
