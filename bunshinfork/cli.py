"""The `bunshin` command line: create, exec in, list, inspect and remove workspaces.

Every subcommand is an entry in SUBCOMMANDS; `fork` and `snapshot` are added there later
(see the end of this module). Errors the user can act on (BunshinError) are printed as
one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from . import __version__, doctor, memory, pipeline, spec, state
from .errors import BunshinError, SpecError, WorkspaceStateError
from .workspace import MemoryStats, Snapshot, Workspace, WorkspaceInfo

PROG = "bunshin"
Handler = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Subcommand:
    """One `bunshin NAME ...` subcommand.

    takes_command: everything after the first `--` is handed over verbatim as `args.command`,
    because argparse cannot parse options placed between a positional and a trailing
    nargs="*" list (bunshin exec ID --timeout 5 -- CMD).
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


def _write(stream: TextIO, text: str) -> None:
    """Stream command output as it arrives; a terminal that cannot encode a character gets '?'."""
    try:
        stream.write(text)
    except UnicodeEncodeError:
        enc = stream.encoding or "utf-8"
        stream.write(text.encode(enc, "replace").decode(enc))
    stream.flush()


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
    p.add_argument("--pids", metavar="N", type=int, help="maximum number of processes")
    p.add_argument("--network", choices=spec.NETWORK_MODES, help="network mode (default: none)")
    p.add_argument("--nat", action="store_true", help="masquerade a bridge network to the host's uplink")
    p.add_argument("--storage-dir", metavar="DIR", help="where the writable layer lives (btrfs: subvolumes)")
    p.add_argument("--env", metavar="K=V", type=_key_value, action="append", default=[],
                   help="environment of every command (repeatable)")


def _create(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.memory is not None:
        # Parsed here so the error names the flag the user typed, not the spec field.
        overrides["memory_limit"] = spec.parse_size(args.memory, "--memory")
    for flag, field_name in (("rootfs", "rootfs"), ("hostname", "hostname"), ("pids", "pids_limit"),
                             ("network", "network"), ("storage_dir", "storage_dir")):
        value = getattr(args, flag)
        if value is not None:
            overrides[field_name] = value
    if args.nat:
        if args.network != "bridge":
            raise SpecError("--nat needs --network bridge")
        overrides["nat"] = True
    if args.env:
        overrides["env"] = dict(args.env)
    ws = Workspace.create(**overrides)
    print(ws.id)
    return 0


# ---- exec ----


def _exec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", type=_workspace_id)
    p.add_argument("--timeout", type=_positive_float, metavar="S",
                   help="kill the command after S seconds (default: no limit)")
    p.add_argument("--cwd", metavar="DIR", help="working directory inside the workspace (default: /root)")
    p.add_argument("--env", metavar="K=V", type=_key_value, action="append", default=[],
                   help="extra environment variable (repeatable)")
    p.add_argument("command", nargs="*", help="the command, after '--'")


def _exec(args: argparse.Namespace) -> int:
    if not args.command:
        raise _UsageError("exec needs a command: bunshin exec ID -- CMD [ARG...]")
    ws = _connect(args.id)
    # A shell string rather than an argv list, so the workspace's shell resolves the program the
    # way an interactive user would; shlex.join keeps every argument exactly as typed.
    result = ws.commands.run(
        shlex.join(args.command),
        timeout=args.timeout,
        env=dict(args.env) or None,
        cwd=args.cwd,
        on_stdout=lambda text: _write(sys.stdout, text),
        on_stderr=lambda text: _write(sys.stderr, text),
    )
    return result.exit_code


# ---- ls / info / memory ----


def _json_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _memory_of(info: WorkspaceInfo) -> MemoryStats | None:
    if info.state == "dead":
        return None
    # The workspace may be destroyed by someone else between listing and measuring.
    with contextlib.suppress(BunshinError, OSError, ValueError):
        return Workspace.connect(info.id).memory()
    return None


def _ls(args: argparse.Namespace) -> int:
    rows = [(info, _memory_of(info)) for info in Workspace.list()]
    if args.json:
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
    for k in ("rss", "pss", "uss", "shared", "cgroup_usage"):
        print(f"{k + ':':<14}{_human(getattr(mem, k))}")
    print(f"{'processes:':<14}{mem.processes}")
    return 0


# ---- rm / gc ----


def _rm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ids", nargs="*", metavar="ID", type=_workspace_id)
    p.add_argument("--all", action="store_true",
                   help="remove every workspace (dead ones through 'gc')")


def _rm(args: argparse.Namespace) -> int:
    if args.all == bool(args.ids):
        raise _UsageError("rm takes either workspace ids or --all")
    failed = False
    ids = [info.id for info in Workspace.list() if info.state != "dead"] if args.all else args.ids
    for ws_id in ids:
        try:
            _connect(ws_id).destroy()
        except BunshinError as e:
            # Keep going: one stuck workspace must not shield the others from removal.
            print(f"{PROG}: error: {e}", file=sys.stderr)
            failed = True
            continue
        print(ws_id)
    if args.all:
        # Dead workspaces cannot be connected to; gc is what takes them apart.
        for ws_id in pipeline.gc()["workspaces"]:
            print(ws_id)
    return 1 if failed else 0


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


# ---- registry ----

register(Subcommand("create", "create and start a workspace; prints its id", _create_args, _create))
register(Subcommand("exec", "run a command in a workspace: bunshin exec ID [opts] -- CMD [ARG...]",
                    _exec_args, _exec, takes_command=True))
register(Subcommand("ls", "list workspaces", _json_args, _ls))
register(Subcommand("info", "show a workspace's record", _id_json_args, _info))
register(Subcommand("memory", "show a workspace's memory (rss, pss, uss, shared, cgroup)", _id_json_args,
                    _memory))
register(Subcommand("rm", "destroy workspaces", _rm_args, _rm))
register(Subcommand("gc", "remove what crashed creators left behind", _gc_args, _gc))
register(Subcommand("doctor", "check what this host offers bunshin", _json_args, _doctor, needs_root=False))
register(Subcommand("fork", "live-fork a running workspace (or a saved snapshot) into N clones",
                    _fork_args, _fork))
register(Subcommand("snapshot", "snapshot a running workspace and save it durably; prints the path",
                    _snapshot_args, _snapshot))


# ---- entry point ----


class _UsageError(Exception):
    """A usage mistake argparse cannot express; reported like argparse's own errors (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Create, run commands in and live-fork container "
                                     "workspaces.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subs = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    for sub in SUBCOMMANDS.values():
        p = subs.add_parser(sub.name, help=sub.help, description=sub.help)
        sub.configure(p)
        p.set_defaults(_sub=sub, _parser=p)
    return parser


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Cut off the command after `--` for subcommands that run one; (argv, None) otherwise."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    # No top-level option takes a value, so the first bare word names the subcommand.
    name = next((a for a in argv[:cut] if not a.startswith("-")), None)
    sub = SUBCOMMANDS.get(name or "")
    if sub is None or not sub.takes_command:
        return argv, None
    return argv[:cut], argv[cut + 1:]


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    head, tail = _split_command(argv)
    args = parser.parse_args(head)
    if tail is not None:
        # Words before `--` were the command's start, so that `--` belongs to the command itself.
        args.command = [*args.command, "--", *tail] if args.command else tail
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse: --help, --version and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    sub: Subcommand = args._sub
    try:
        if sub.needs_root:
            state.require_root()
        return sub.run(args)
    except _UsageError as e:
        # The same shape and exit status as argparse's own usage errors.
        sub_parser: argparse.ArgumentParser = args._parser
        print(sub_parser.format_usage(), end="", file=sys.stderr)
        print(f"{sub_parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except BunshinError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
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


if __name__ == "__main__":
    sys.exit(main())
