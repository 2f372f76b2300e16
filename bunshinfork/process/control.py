"""Client side of the workspace init's control protocol (see csrc/init.c).

The socket lives inside the workspace's own file system and is reached through
/proc/<init>/root, so no descriptor of the host stays inside the workspace
between calls. A call returns only once the init's shim has closed its end (EOF), so
a snapshot taken right after any call never finds a connection to the host.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator, Mapping, Sequence

from ..errors import CommandError, WorkspaceStateError

CTL_SOCK = "/.bunshin/ctl.sock"
CMD_DIR = "/.bunshin/cmd"
# How long a request waits for the init's first answer (a frozen init gives none).
REPLY_TIMEOUT = 10.0


def _encode(op: str, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None,
            cmd_id: str | None, pid: int | None, sig: int | None) -> bytes:
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
    for it in items:
        if "\0" in it:
            raise CommandError(f"NUL byte in command, environment or cwd: {it[1:]!r}")
    try:
        # surrogateescape: bytes that Python decoded from a file name or argv go back as they were.
        payload = b"".join(it.encode("utf-8", "surrogateescape") + b"\0" for it in items)
    except UnicodeEncodeError as e:
        raise CommandError(f"command, environment or cwd cannot be encoded: {e}") from None
    return struct.pack("<I", len(payload)) + payload


class Connection:
    """One request to the init and its stream of reply frames."""

    def __init__(self, init_pid: int, timeout: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(REPLY_TIMEOUT if timeout is None else timeout)
        path = f"/proc/{init_pid}/root{CTL_SOCK}"
        try:
            self.sock.connect(path)
        except OSError as e:
            self.sock.close()
            raise WorkspaceStateError(f"workspace init (pid {init_pid}) is not answering at {path}: {e}") from e
        self._buf = b""
        self._answered = False  # a shim serves this request: it will close its end
        self._eof = False

    def send(self, op: str, argv: Sequence[str] = (), env: Mapping[str, str] | None = None,
             cwd: str | None = None, cmd_id: str | None = None, pid: int | None = None,
             sig: int | None = None) -> None:
        self.sock.sendall(_encode(op, argv, env, cwd, cmd_id, pid, sig))

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def _read(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                self._eof = True
                return None
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def frames(self) -> Iterator[tuple[str, bytes]]:
        """Yield (type, data) until the init closes the connection. socket.timeout propagates."""
        while True:
            hdr = self._read(5)
            if hdr is None:
                return
            self._answered = True
            kind, length = chr(hdr[0]), struct.unpack("<I", hdr[1:])[0]
            data = self._read(length) if length else b""
            if data is None:
                return
            yield kind, data

    def close(self) -> None:
        """Close, having first waited (up to REPLY_TIMEOUT) for the shim to close its end. A caller
        that leaves early (a timeout, an error frame) shuts its side down: the shim takes that as
        the caller giving up (a `run` kills its command) and closes at once. A request no shim
        has answered yet (a frozen init) is not waited for."""
        try:
            if self._answered and not self._eof:
                self.sock.shutdown(socket.SHUT_WR)
                self.sock.settimeout(REPLY_TIMEOUT)
                while self.sock.recv(65536):
                    pass
        except OSError:
            pass  # a timeout included: the workspace stopped answering, nothing more to wait for
        finally:
            self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def simple(init_pid: int, op: str, **kw: object) -> str:
    """Send a request whose reply is a single 'X' or 'F' frame; return the X payload."""
    with Connection(init_pid) as c:
        try:
            c.send(op, **kw)  # type: ignore[arg-type]
            reply: str | None = None
            for kind, data in c.frames():
                if kind == "F":
                    raise CommandError(data.decode(errors="replace"))
                if kind in ("X", "P") and reply is None:
                    reply = data.decode()
            # Read on to EOF: the shim closes its end right after replying, and returning before
            # that would let a snapshot find the workspace still connected to this process.
            if reply is not None:
                return reply
        except TimeoutError:
            # A frozen init accepts nothing; a bare socket timeout would not say so.
            raise WorkspaceStateError(
                f"workspace init (pid {init_pid}) did not answer {op} within {c.sock.gettimeout()}s; "
                "is the workspace paused?"
            ) from None
    raise WorkspaceStateError(f"workspace init (pid {init_pid}) closed the connection without answering {op}")


def ping(init_pid: int) -> bool:
    try:
        simple(init_pid, "ping")
        return True
    except (WorkspaceStateError, CommandError, OSError):
        return False
