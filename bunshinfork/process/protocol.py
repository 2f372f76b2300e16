"""The workspace init's wire format (see csrc/init.c), with no I/O.

A request is a 4-byte little-endian length and NUL-terminated items: the operation, then
one item per field, each tagged by its first byte ('a' argv, 'e' environment, 'c' cwd,
'i' command id, 'p' pid, 's' signal, 'u' user, 'n' stdin). Replies and a command's input
are frames: a 1-byte kind, a 4-byte little-endian length, the data. The blocking client
(control.py) and the asyncio one (control_aio.py) both speak it through this module, so a
change of the wire touches this file and csrc/init.c only.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import TypedDict

from ..errors import CommandError, WorkspaceStateError

CTL_SOCK = "/.bunshin/ctl.sock"
CMD_DIR = "/.bunshin/cmd"
# A command started with an input has its shim listen here, at /.bunshin/io/<pid>.
IO_DIR = "/.bunshin/io"
# The request of every running command, at /.bunshin/procs/<pid>.
PROCS_DIR = "/.bunshin/procs"
# How long a request waits for the init's first answer (a frozen init gives none).
REPLY_TIMEOUT = 10.0
HEADER = struct.Struct("<BI")
# How much a reader asks the socket for at once.
CHUNK = 65536


class Fields(TypedDict, total=False):
    """A request's fields beside its operation (encode's keyword parameters)."""

    argv: Sequence[str]
    env: Mapping[str, str] | None
    cwd: str | None
    cmd_id: str | None
    pid: int | None
    sig: int | None
    user: str | None
    stdin: str | None


def encode(op: str, argv: Sequence[str] = (), env: Mapping[str, str] | None = None, cwd: str | None = None,
           cmd_id: str | None = None, pid: int | None = None, sig: int | None = None, user: str | None = None,
           stdin: str | None = None) -> bytes:
    """One request as the init reads it; CommandError for what it could not carry."""
    items = [op]
    items += ["a" + a for a in argv]
    for k in env or {}:
        if not k or "=" in k:
            raise CommandError(f"environment variable name {k!r} is empty or contains '='")
    items += [f"e{k}={v}" for k, v in (env or {}).items()]
    if cwd is not None:
        items.append("c" + cwd)
    if cmd_id is not None:
        items.append("i" + cmd_id)
    if pid is not None:
        items.append(f"p{pid}")
    if sig is not None:
        items.append(f"s{sig}")
    if user is not None:
        items.append("u" + user)
    if stdin is not None:
        items.append("n" + stdin)
    for it in items:
        if "\0" in it:
            raise CommandError(f"NUL byte in command, environment or cwd: {it[1:]!r}")
    try:
        # surrogateescape: bytes that Python decoded from a file name or argv go back as they were.
        payload = b"".join(it.encode("utf-8", "surrogateescape") + b"\0" for it in items)
    except UnicodeEncodeError as e:
        raise CommandError(f"command, environment or cwd cannot be encoded: {e}") from None
    return struct.pack("<I", len(payload)) + payload


def frame(kind: str, data: bytes = b"") -> bytes:
    """A frame as the init sends them, and as it takes input: 'I' stdin bytes, 'C' close
    stdin, 'R' b"ROWS COLS"."""
    return HEADER.pack(ord(kind), len(data)) + data


def input_data(data: str | bytes) -> bytes:
    """What an 'I' frame carries for `data` (a str goes as UTF-8)."""
    return data.encode() if isinstance(data, str) else bytes(data)


def resize_data(rows: int, cols: int) -> bytes:
    """What an 'R' frame carries."""
    return f"{rows} {cols}".encode()


def header(hdr: bytes) -> tuple[str, int]:
    """A frame's kind and the length of its data."""
    kind, length = HEADER.unpack(hdr)
    return chr(kind), length


def input_path(pid: int) -> str:
    """Where, inside the workspace, command `pid`'s shim takes its input (the host reaches it
    through inroot.bunshin_socket, never by a host path)."""
    return f"{IO_DIR}/{pid}"


class SimpleReply:
    """The answer to a request answered by one frame ('X' or 'P' carries it, 'F' is a failure):
    feed() every frame up to the init's hang-up, then value()."""

    def __init__(self, init_pid: int, op: str) -> None:
        self.init_pid, self.op = init_pid, op
        self._reply: str | None = None

    def feed(self, kind: str, data: bytes) -> None:
        if kind == "F":
            raise CommandError(data.decode(errors="replace"))
        if kind in ("X", "P") and self._reply is None:
            self._reply = data.decode()

    def value(self) -> str:
        if self._reply is None:
            raise WorkspaceStateError(
                f"workspace init (pid {self.init_pid}) closed the connection without answering {self.op}")
        return self._reply

    def timed_out(self, limit: float | None) -> WorkspaceStateError:
        # A frozen init accepts nothing; a bare socket timeout would not say so.
        return WorkspaceStateError(f"workspace init (pid {self.init_pid}) did not answer {self.op} within "
                                   f"{limit}s; is the workspace paused?")


class RunReply:
    """The frames answering a 'run' request: the command's pid ('P'), its output ('O' stdout,
    'E' stderr), a failure to start it ('F'), its wait status ('X'). feed() every frame up to
    the init's hang-up, then status(): the status is held until then, since a caller that
    returned on 'X' would let a snapshot find the workspace still connected to it."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.pid: int | None = None
        self._status: int | None = None

    def feed(self, kind: str, data: bytes) -> bool:
        """True for output ('O' or 'E') the caller hands on; the rest is taken here."""
        if kind == "P":
            self.pid = int(data)
        elif kind == "F":
            raise CommandError(f"cannot run {self.argv!r}: {data.decode(errors='replace')}")
        elif kind == "X":
            self._status = int(data)
        return kind in ("O", "E")

    def status(self) -> int:
        if self._status is None:
            raise WorkspaceStateError("the workspace's init closed the connection before the command ended "
                                      "(was the workspace destroyed?)")
        return self._status


def not_answering(init_pid: int, error: BaseException) -> WorkspaceStateError:
    return WorkspaceStateError(f"workspace init (pid {init_pid}) is not answering at {CTL_SOCK}: "
                               f"{error}")


def no_input(pid: int) -> CommandError:
    return CommandError(f"command {pid} is not running, or was started without stdin")


def check_input_ack(pid: int, hdr: bytes | None, reply: bytes | None) -> None:
    """The shim's acknowledgement of one input frame: CommandError unless it took it."""
    if hdr is None or reply is None:
        raise CommandError(f"command {pid} exited before it took the input")
    if header(hdr)[0] == "F":
        raise CommandError(f"input to command {pid}: {reply.decode(errors='replace')}")


def input_timed_out(pid: int) -> WorkspaceStateError:
    return WorkspaceStateError(f"command {pid} did not take its input in time; is the workspace paused?")
