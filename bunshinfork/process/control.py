"""Client side of the workspace init's control protocol (see csrc/init.c).

The socket lives inside the workspace's own file system and is reached through
/proc/<init>/root, so no descriptor of the host stays inside the workspace
between calls. A call returns only once the init's shim has closed its end (EOF), so
a snapshot taken right after any call never finds a connection to the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

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


def _encode(op: str, argv: Sequence[str], env: Mapping[str, str] | None, cwd: str | None,
            cmd_id: str | None, pid: int | None, sig: int | None, user: str | None = None,
            stdin: str | None = None) -> bytes:
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


def socket_path(init_pid: int, inside: str) -> str:
    return f"/proc/{init_pid}/root{inside}"


class Connection:
    """One request to the init and its stream of reply frames."""

    def __init__(self, init_pid: int, timeout: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(REPLY_TIMEOUT if timeout is None else timeout)
        path = socket_path(init_pid, CTL_SOCK)
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
             sig: int | None = None, user: str | None = None, stdin: str | None = None) -> None:
        self.sock.sendall(_encode(op, argv, env, cwd, cmd_id, pid, sig, user, stdin))

    def send_frame(self, kind: str, data: bytes = b"") -> None:
        self.sock.sendall(frame(kind, data))

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


def send_input(init_pid: int, pid: int, kind: str, data: bytes = b"", timeout: float | None = None) -> None:
    """Hand one input frame to the shim of command `pid` and wait for its acknowledgement."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(REPLY_TIMEOUT if timeout is None else timeout)
    try:
        try:
            sock.connect(socket_path(init_pid, f"{IO_DIR}/{pid}"))
        except (FileNotFoundError, ConnectionRefusedError):
            raise CommandError(f"command {pid} is not running, or was started without stdin") from None
        sock.sendall(frame(kind, data))
        hdr = _recv_exact(sock, HEADER.size)
        reply = _recv_exact(sock, HEADER.unpack(hdr)[1]) if hdr else None
        if hdr is None or reply is None:
            raise CommandError(f"command {pid} exited before it took the input")
        if chr(hdr[0]) == "F":
            raise CommandError(f"input to command {pid}: {reply.decode(errors='replace')}")
        _await_hangup(sock)
    except TimeoutError:
        raise WorkspaceStateError(f"command {pid} did not take its input within {sock.gettimeout()}s; "
                                  "is the workspace paused?") from None
    finally:
        sock.close()


def _await_hangup(sock: socket.socket) -> None:
    """Leave only once the shim has closed its end: a snapshot must find nothing connected."""
    sock.shutdown(socket.SHUT_WR)
    while sock.recv(65536):
        pass


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class AsyncConnection:
    """Connection's twin on asyncio streams: one request and its reply frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._answered = False
        self._eof = False

    @classmethod
    async def open(cls, init_pid: int, timeout: float | None = None) -> AsyncConnection:
        path = socket_path(init_pid, CTL_SOCK)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path),
                                                    REPLY_TIMEOUT if timeout is None else timeout)
        except (OSError, TimeoutError) as e:
            raise WorkspaceStateError(f"workspace init (pid {init_pid}) is not answering at {path}: {e}") from e
        return cls(reader, writer)

    async def send(self, op: str, argv: Sequence[str] = (), env: Mapping[str, str] | None = None,
                   cwd: str | None = None, cmd_id: str | None = None, pid: int | None = None,
                   sig: int | None = None, user: str | None = None, stdin: str | None = None) -> None:
        self._writer.write(_encode(op, argv, env, cwd, cmd_id, pid, sig, user, stdin))
        await self._writer.drain()

    async def send_frame(self, kind: str, data: bytes = b"") -> None:
        self._writer.write(frame(kind, data))
        await self._writer.drain()

    async def frames(self) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (type, data) until the init closes the connection."""
        while True:
            try:
                hdr = await self._reader.readexactly(HEADER.size)
                self._answered = True
                kind, length = HEADER.unpack(hdr)
                data = await self._reader.readexactly(length) if length else b""
            except asyncio.IncompleteReadError:
                self._eof = True
                return
            yield chr(kind), data

    async def close(self) -> None:
        """As Connection.close: an answered request is left only once the shim hung up."""
        try:
            if self._answered and not self._eof:
                self._writer.write_eof()
                await asyncio.wait_for(_drain(self._reader), REPLY_TIMEOUT)
        except (OSError, TimeoutError):
            pass
        finally:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()


async def _drain(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


async def simple_async(init_pid: int, op: str, timeout: float | None = None, **kw: object) -> str:
    """simple() on asyncio streams."""
    limit = REPLY_TIMEOUT if timeout is None else timeout
    conn = await AsyncConnection.open(init_pid, limit)
    try:
        async def exchange() -> str | None:
            await conn.send(op, **kw)  # type: ignore[arg-type]
            reply: str | None = None
            async for kind, data in conn.frames():
                if kind == "F":
                    raise CommandError(data.decode(errors="replace"))
                if kind in ("X", "P") and reply is None:
                    reply = data.decode()
            return reply

        try:
            reply = await asyncio.wait_for(exchange(), limit)
        except TimeoutError:
            raise WorkspaceStateError(
                f"workspace init (pid {init_pid}) did not answer {op} within {limit}s; is the workspace paused?"
            ) from None
    finally:
        await conn.close()
    if reply is None:
        raise WorkspaceStateError(f"workspace init (pid {init_pid}) closed the connection without answering {op}")
    return reply
