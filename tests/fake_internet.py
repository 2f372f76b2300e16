"""A fake internet host for the network tests: a network namespace the test makes, with a
server in it, reached through this host as a router on its own segment (198.51.100.0/24,
TEST-NET-2, never routed anywhere), not on the workspaces' bridge.

The server echoes every byte it gets and records each connection's peer: the flows the
fake host saw. `extra` ports serve the same echo, in TLS where a context is given (the
domain-rule tests' HTTP on 80 and HTTPS on 443); every connection on any port is in `arrivals`
with the first bytes it carried (decrypted for TLS).
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute, NetNS, netns

from bunshinfork.network.nsock import socket_in

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
PORT = 7100
# Run inside a workspace with a fake host's address and port: what a new connection meets
# ("connected" when the echo answers, else the error's name).
PROBE = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=8)
    s.sendall(b"hi")
    print("connected" if s.recv(2) == b"hi" else "EOF")
except OSError as e:
    print(type(e).__name__)
"""


def reach_from_sandbox(sbx: Any, host: FakeHost) -> str:
    """PROBE from inside an E2B sandbox (the SDK's or bunshinfork's: the same files and
    commands), timed: a refusal must be immediate (rejected, never dropped into a timeout)."""
    sbx.files.write("/tmp/probe.py", PROBE)
    t0 = time.monotonic()
    out = str(sbx.commands.run(f"python3 /tmp/probe.py {host.addr} {PORT}", timeout=30).stdout).strip()
    assert time.monotonic() - t0 < 5, (out, "a denied connection must be refused at once")
    return out


@dataclass
class Arrival:
    port: int  # the fake host's port
    peer: str
    first: bytes = b""


@dataclass
class FakeHost:
    name: str
    addr: str  # the host's address on its segment
    router: str  # this machine's address on that segment
    host_if: str
    flows: list[tuple[str, int]] = field(default_factory=list)  # peers, in order of connection
    received: list[bytes] = field(default_factory=list)  # the first bytes of each connection
    arrivals: list[Arrival] = field(default_factory=list)  # every connection, on any port
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def seen(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self.flows)


def _serve(host: FakeHost, srv: socket.socket, conns: list[socket.socket], stop: threading.Event,
           tls: ssl.SSLContext | None = None) -> None:
    port = srv.getsockname()[1]
    while not stop.is_set():
        try:
            c, peer = srv.accept()
        except OSError:
            return
        arrival = Arrival(port, peer[0])
        with host._lock:
            host.flows.append((peer[0], peer[1]))
            host.arrivals.append(arrival)
            conns.append(c)
        threading.Thread(target=_echo, args=(host, c, arrival, tls, conns), daemon=True).start()


def _echo(host: FakeHost, c: socket.socket, arrival: Arrival, tls: ssl.SSLContext | None,
          conns: list[socket.socket]) -> None:
    first = True
    with contextlib.suppress(OSError):
        if tls is not None:
            c.settimeout(10)
            c = tls.wrap_socket(c, server_side=True)  # detaches the plain socket: close this one at the end
            c.settimeout(None)
            with host._lock:
                conns.append(c)
        while data := c.recv(4096):
            if first:
                with host._lock:
                    host.received.append(data)
                    arrival.first = data
                first = False
            c.sendall(data)


@contextlib.contextmanager
def fake_host(index: int = 0, port: int = PORT,
              extra: dict[int, ssl.SSLContext | None] | None = None, prefix: str = "198.51.100") -> Iterator[FakeHost]:
    """Fake host number `index` (198.51.100.4i+2 behind router 198.51.100.4i+1), serving on `port`
    and on each of `extra`'s ports (TLS where it gives a context). `prefix`: another /24 for it
    (the containment tests' link-local and private destinations)."""
    name = f"bunshin-test-fake-{secrets.token_hex(3)}"
    base = 4 * index
    host = FakeHost(name, f"{prefix}.{base + 2}", f"{prefix}.{base + 1}", f"bt{secrets.token_hex(4)}")
    saved_forward = IP_FORWARD.read_text().strip()
    netns.create(name)
    stop = threading.Event()
    conns: list[socket.socket] = []
    servers: list[socket.socket] = []
    try:
        with IPRoute() as ipr:
            ipr.link("add", ifname=host.host_if, kind="veth", peer={"ifname": "eth0", "net_ns_fd": name})
            idx = ipr.link_lookup(ifname=host.host_if)[0]
            ipr.addr("add", index=idx, address=host.router, prefixlen=30)
            ipr.link("set", index=idx, state="up")
        with NetNS(name) as ns:
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
            eth = ns.link_lookup(ifname="eth0")[0]
            ns.addr("add", index=eth, address=host.addr, prefixlen=30)
            ns.link("set", index=eth, state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=host.router)
        IP_FORWARD.write_text("1")
        for p, tls in {port: None, **(extra or {})}.items():
            srv = socket_in(host.path, socket.AF_INET, socket.SOCK_STREAM)
            servers.append(srv)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((host.addr, p))
            srv.listen(64)
            threading.Thread(target=_serve, args=(host, srv, conns, stop, tls), daemon=True).start()
        yield host
    finally:
        stop.set()
        for srv in servers:
            with contextlib.suppress(OSError):
                srv.shutdown(socket.SHUT_RDWR)
            srv.close()
        with host._lock:
            for c in conns:
                c.close()
        IP_FORWARD.write_text(saved_forward)
        with IPRoute() as ipr:
            for idx in ipr.link_lookup(ifname=host.host_if):
                with contextlib.suppress(Exception):
                    ipr.link("del", index=idx)
        netns.remove(name)
