#!/usr/bin/env python3
"""A minimal X11 client speaking the wire protocol over /tmp/.X11-unix/X<display>.

It creates and maps a named window, then makes a round trip (GetInputFocus) every few
milliseconds over the same connection, recording how many have completed in a file.
After a fork, the count advancing in a clone shows the client's connection to the
clone's own X server survived; the window name shows the server kept its state.
Stdlib only: it runs under the workspace's /usr/bin/python3.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

WINDOW_NAME = b"bunshin-fork-xclient"
COUNT_FILE = "/tmp/xclient.count"
WM_NAME, STRING = 39, 31  # predefined atoms


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("X server closed the connection")
        buf += chunk
    return buf


def pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def connect(display: int) -> tuple[socket.socket, int, int]:
    """Return the socket, the first free resource id and the root window."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(f"/tmp/.X11-unix/X{display}")
    s.sendall(struct.pack("<BxHHHHxx", ord("l"), 11, 0, 0, 0))
    head = recv_exact(s, 8)
    if head[0] != 1:
        raise ConnectionError(f"X server refused the connection: {head!r}")
    body = recv_exact(s, struct.unpack_from("<H", head, 6)[0] * 4)
    rid_base = struct.unpack_from("<I", body, 4)[0]
    vendor_len = struct.unpack_from("<H", body, 16)[0]
    n_formats = body[21]
    screens = 32 + len(pad(b"\0" * vendor_len)) + 8 * n_formats
    root = struct.unpack_from("<I", body, screens)[0]
    return s, rid_base, root


def main() -> int:
    display = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    s, wid, root = connect(display)
    # CreateWindow (depth, visual, class all CopyFromParent), ChangeProperty WM_NAME, MapWindow.
    s.sendall(struct.pack("<BBHIIhhHHHHII", 1, 0, 8, wid, root, 10, 10, 200, 100, 0, 0, 0, 0))
    name = pad(WINDOW_NAME)
    s.sendall(struct.pack("<BBHIIIBxxxI", 18, 0, 6 + len(name) // 4, wid, WM_NAME, STRING, 8,
                          len(WINDOW_NAME)) + name)
    s.sendall(struct.pack("<BxHI", 8, 2, wid))
    done = 0
    while True:
        s.sendall(struct.pack("<BxH", 43, 1))  # GetInputFocus
        while True:  # skip any event or error to the reply (type 1)
            packet = recv_exact(s, 32)
            if packet[0] == 0:
                raise ConnectionError(f"X error {packet[1]} for request {packet[10]}")
            if packet[0] == 1:
                break
        done += 1
        tmp = COUNT_FILE + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(done))
        os.rename(tmp, COUNT_FILE)
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(main())
