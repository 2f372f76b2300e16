"""Sockets that live in a workspace's network namespace, opened from the host process.

A socket belongs to the network namespace its creator was in when it was made, and keeps it
for life; setns() moves only the calling thread. So a short-lived thread enters the
workspace's namespace, makes the socket and ends: the host holds a socket inside the
workspace without running anything there (published ports' forwarders, the sock_diag
socket that closes a clone's inherited connections). The namespace's sysctls are written the
same way (sysctls_in).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .. import native
from ..errors import NetworkError

CLONE_NEWNET = 0x40000000
NETLINK_SOCK_DIAG = 4
SOCK_DESTROY = 21
NLMSG_ERROR = 2
NLM_F_REQUEST = 1
NLM_F_ACK = 4
_ALL_STATES = 0xFFFFFFFF
_NO_COOKIE = 0xFFFFFFFF
T = TypeVar("T")


def _in_netns(netns: int | str, work: Callable[[], T]) -> T:
    """`work()` run by a short-lived thread inside a network namespace: that of process `netns`,
    or the one bound at path `netns`."""
    out: list[T | BaseException] = []
    path = f"/proc/{netns}/ns/net" if isinstance(netns, int) else netns

    def enter() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            out.append(NetworkError(f"network namespace {path} is gone ({e}); it cannot be reached"))
            return
        try:
            native.setns(fd, CLONE_NEWNET)
            out.append(work())
        except BaseException as e:  # handed to the caller's thread
            out.append(e)
        finally:
            os.close(fd)

    t = threading.Thread(target=enter, name="bunshin-netns", daemon=True)
    t.start()
    t.join()
    got = out[0]
    if isinstance(got, BaseException):
        raise got
    return got


def socket_in(netns: int | str, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A new socket inside a network namespace: that of process `netns`, or the one bound at path `netns`."""
    return _in_netns(netns, lambda: socket.socket(family, kind, proto))


def sysctls_in(netns: int | str, values: dict[str, str]) -> None:
    """Write net sysctls (paths under /proc/sys/net) of a network namespace from the host: /proc/sys/net
    shows the namespace of the thread that opens a file, whatever /proc is mounted where, so
    the workspace's own read-only /proc/sys is never involved. A key whose file is missing (no
    IPv6 in this kernel) is skipped: there is nothing to turn off."""
    def write() -> None:
        for key, value in values.items():
            try:
                with open(f"/proc/sys/net/{key}", "w") as f:
                    f.write(value)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise NetworkError(f"cannot set net.{key.replace('/', '.')}={value} in the workspace: {e}") from e
    _in_netns(netns, write)


@dataclass(frozen=True)
class Flow:
    """A TCP connection as its local end sees it."""

    src: str
    sport: int
    dst: str
    dport: int

    def as_list(self) -> list[str | int]:
        return [self.src, self.sport, self.dst, self.dport]


def _destroy_request(flow: Flow, seq: int) -> bytes:
    def addr(a: str) -> bytes:
        return ipaddress.IPv4Address(a).packed + bytes(12)

    req = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
    req += struct.pack("!HH", flow.sport, flow.dport) + addr(flow.src) + addr(flow.dst)
    req += struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    return struct.pack("=IHHII", 16 + len(req), SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + req


def destroy_tcp(init_pid: int, flows: list[Flow]) -> int:
    """Abort each of these TCP sockets inside the namespace (the kernel's sock_destroy, as
    `ss -K`): the owner's next read or write fails with ECONNABORTED, and the RST the kernel
    sends is the host's to drop. Returns how many were found; one already gone is fine."""
    if not flows:
        return 0
    s = socket_in(init_pid, socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    found = 0
    try:
        s.settimeout(5)
        for seq, flow in enumerate(flows, 1):
            s.send(_destroy_request(flow, seq))
            reply = s.recv(4096)
            _, kind, _, _, _ = struct.unpack_from("=IHHII", reply)
            if kind != NLMSG_ERROR:
                continue
            (err,) = struct.unpack_from("=i", reply, 16)
            if err == 0:
                found += 1
            elif -err == errno.EOPNOTSUPP:
                raise NetworkError("the kernel cannot destroy sockets (CONFIG_INET_DIAG_DESTROY); "
                                   "a clone's inherited connections cannot be closed")
            elif -err != errno.ENOENT:
                raise NetworkError(f"closing the inherited connection {flow} failed: {os.strerror(-err)}")
    finally:
        s.close()
    return found
