"""The blocking client of the workspace init's control protocol (wire format: protocol.py).

The socket lives inside the workspace's own file system and is reached through
inroot.bunshin_socket (resolved under the workspace's root, no symlink followed), so no
descriptor of the host stays inside the workspace between calls. A call returns only once the
init's shim has closed its end (EOF), so a snapshot taken right after any call never finds a
connection to the host.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Unpack

from .. import inroot
from ..errors import CommandError, WorkspaceStateError
from . import protocol
from .protocol import REPLY_TIMEOUT, Fields


class Connection:
    """One request to the init and its stream of reply frames."""

    def __init__(self, init_pid: int, timeout: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(REPLY_TIMEOUT if timeout is None else timeout)
        try:
            with inroot.bunshin_socket(init_pid, protocol.CTL_SOCK) as address:
                self.sock.connect(address)
        except OSError as e:
            self.sock.close()
            raise protocol.not_answering(init_pid, e) from e
        except BaseException:
            self.sock.close()
            raise
        self._buf = b""
        self._answered = False  # a shim serves this request: it will close its end
        self._eof = False

    def send(self, op: str, **fields: Unpack[Fields]) -> None:
        self.sock.sendall(protocol.encode(op, **fields))

    def send_frame(self, kind: str, data: bytes = b"") -> None:
        self.sock.sendall(protocol.frame(kind, data))

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def _read(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(protocol.CHUNK, n - len(self._buf)))
            if not chunk:
                self._eof = True
                return None
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def frames(self) -> Iterator[tuple[str, bytes]]:
        """Yield (type, data) until the init closes the connection. socket.timeout propagates."""
        while True:
            hdr = self._read(protocol.HEADER.size)
            if hdr is None:
                return
            self._answered = True
            kind, length = protocol.header(hdr)
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
                while self.sock.recv(protocol.CHUNK):
                    pass
        except OSError:
            pass  # a timeout included: the workspace stopped answering, nothing more to wait for
        finally:
            self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def simple(init_pid: int, op: str, **fields: Unpack[Fields]) -> str:
    """Send a request whose reply is a single 'X' or 'F' frame; return the X payload."""
    reply = protocol.SimpleReply(init_pid, op)
    with Connection(init_pid) as c:
        try:
            c.send(op, **fields)
            # Read on to EOF: the shim closes its end right after replying, and returning before
            # that would let a snapshot find the workspace still connected to this process.
            for kind, data in c.frames():
                reply.feed(kind, data)
        except TimeoutError:
            raise reply.timed_out(c.sock.gettimeout()) from None
    return reply.value()


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
            with inroot.bunshin_socket(init_pid, protocol.input_path(pid)) as address:
                sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            raise protocol.no_input(pid) from None
        sock.sendall(protocol.frame(kind, data))
        hdr = _recv_exact(sock, protocol.HEADER.size)
        reply = _recv_exact(sock, protocol.header(hdr)[1]) if hdr else None
        protocol.check_input_ack(pid, hdr, reply)
        _await_hangup(sock)
    except TimeoutError:
        raise protocol.input_timed_out(pid) from None
    finally:
        sock.close()


def _await_hangup(sock: socket.socket) -> None:
    """Leave only once the shim has closed its end: a snapshot must find nothing connected."""
    sock.shutdown(socket.SHUT_WR)
    while sock.recv(protocol.CHUNK):
        pass


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf
