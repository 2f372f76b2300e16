"""bunshin serve's connections send each response as soon as it is written: Nagle's algorithm is
off on every accepted connection. Left on (asyncio turns it off only on a socket that says it is
TCP, and the listener was made with protocol 0), a response's body waited behind its head for
the client's delayed ACK: 40 ms on every call after a kept-alive connection's first, which is
every call an E2B SDK makes. Read from the server's own socket, taken with pidfd_getfd."""

from __future__ import annotations

import ctypes
import os
import socket
import tempfile
from pathlib import Path

import e2b_server_support as support

SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438


def _server_socket(pid: int, client: socket.socket) -> socket.socket:
    """The server's end of `client`'s connection: the inode /proc/net/tcp lists for it, found
    among the server's descriptors, and duplicated into this process."""
    local, peer = client.getsockname(), client.getpeername()
    want = f"{socket.inet_aton(peer[0])[::-1].hex().upper()}:{peer[1]:04X}", \
        f"{socket.inet_aton(local[0])[::-1].hex().upper()}:{local[1]:04X}"
    inode = next(row.split()[9] for row in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if tuple(row.split()[1:3]) == want)
    fd = next(int(n) for n in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{n}") == f"socket:[{inode}]")
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
    assert pidfd >= 0, os.strerror(ctypes.get_errno())
    try:
        mine = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        assert mine >= 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(pidfd)
    return socket.socket(fileno=mine)


def test_the_servers_connections_have_nagle_off() -> None:
    with tempfile.TemporaryDirectory(prefix="bunshin-nodelay-") as d, support.serving(Path(d)) as s:
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as c:
            c.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert c.recv(4096).startswith(b"HTTP/1.1 ")
            with _server_socket(s.proc.pid, c) as server_end:
                assert server_end.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
