"""Attack tests of a workspace's network containment (issue 36's #8 and #13): what root inside a
bridged workspace, or a clone of one, tries in order to reach the host or another workspace.

Each test reproduces one attack and fails on the code before its defence: IPv6 link-local to a
host listener, a host service on the bridge address, 169.254/16 and private destinations, another
workspace when ports are isolated (with the bridge-family rules alone, whatever br_netfilter
does), forged ARP, IPv6, source addresses and MACs on the bridge, and raw sockets. Traffic goes
only to listeners the test starts on the host's bunshin addresses, to namespaces it made
(fake_internet.py) and to workspaces.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_internet import fake_host
from fork_support import forked
from helpers import run_ok, wait_for

from bunshinfork.workspace import Workspace

KINDS = ["created", "clone", "resumed"]

# Run inside: connect to argv[1]:argv[2], say what happened (a bridged drop times out: the
# bridge family cannot reject in this kernel, and a local peer answers in milliseconds).
CONNECT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
    s.sendall(b"hi")
    print("connected")
except OSError as e:
    print(type(e).__name__)
"""

# Run inside: the gateway's link-local IPv6 address, from its MAC (ARP, then EUI-64), as an
# attacker finds it; then connect there.
LINK_LOCAL = """
import socket, sys, time
gw, port = sys.argv[1], int(sys.argv[2])
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", (gw, 9))  # any packet makes the ARP
mac, deadline = None, time.monotonic() + 3
while mac is None and time.monotonic() < deadline:
    for line in open("/proc/net/arp").read().splitlines()[1:]:
        f = line.split()
        if f[0] == gw and f[3] != "00:00:00:00:00:00":
            mac = f[3]
    time.sleep(0.02)
b = bytes.fromhex(mac.replace(":", ""))
eui = bytes([b[0] ^ 2]) + b[1:3] + b"\\xff\\xfe" + b[3:]
ll = "fe80::" + ":".join(eui[i:i + 2].hex() for i in range(0, 8, 2))
# Both ends' link-local addresses are tentative for a second (duplicate detection): an attacker
# waits, as long as eth0 has one at all.
deadline = time.monotonic() + 4
while True:
    try:
        s = socket.create_connection((ll + "%eth0", port), timeout=2)
        s.sendall(b"hi")
        print("connected")
        break
    except OSError as e:
        has_v6 = any(line.split()[-1] == "eth0" for line in open("/proc/net/if_inet6"))
        if not has_v6 or time.monotonic() > deadline:
            print(type(e).__name__)
            break
        time.sleep(0.1)
"""

# Run inside: what raw sockets and ping sockets give root.
RAW = """
import socket
for name, args in (("packet", (socket.AF_PACKET, socket.SOCK_RAW)),
                   ("raw", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))):
    try:
        socket.socket(*args).close()
        print(name, "ok")
    except OSError as e:
        print(name, type(e).__name__)
try:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    s.settimeout(3)
    s.sendto(b"\\x08\\x00\\x00\\x00\\x00\\x00\\x00\\x01ping", ("127.0.0.1", 0))
    print("ping", "reply" if s.recv(64)[0] == 0 else "other")
except OSError as e:
    print("ping", type(e).__name__)
"""

# Run inside a privileged workspace (raw sockets): forged frames to the bridge's broadcast,
# each carrying its marker in the payload or the Ethernet padding.
FORGE = """
import socket, struct, sys
ip, gw, mac = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3].replace(":", ""))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
bcast = b"\\xff" * 6

def csum(b):
    b += b"\\0" * (len(b) % 2)
    n = sum(struct.unpack(f"!{len(b) // 2}H", b))
    while n >> 16:
        n = (n & 0xffff) + (n >> 16)
    return ~n & 0xffff

def ipv4(src, marker):
    body = struct.pack("!HHHH", 9999, 9999, 8 + len(marker), 0) + marker
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 1, 0, 64, 17, 0,
                      socket.inet_aton(src), socket.inet_aton("255.255.255.255"))
    return hdr[:10] + struct.pack("!H", csum(hdr)) + hdr[12:] + body

def arp(sender_ip, marker):
    # A gratuitous reply: "sender_ip is at my MAC".
    return struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 2, mac, socket.inet_aton(sender_ip),
                       bcast, socket.inet_aton(sender_ip)) + marker

frames = {
    "legit": bcast + mac + b"\\x08\\x00" + ipv4(ip, b"bunshin-legit"),
    "ip-spoof": bcast + mac + b"\\x08\\x00" + ipv4(gw, b"bunshin-ip-spoof"),
    "mac-spoof": bcast + b"\\x02\\xba\\xd0\\x00\\x00\\x01" + b"\\x08\\x00" + ipv4(ip, b"bunshin-mac-spoof"),
    "arp-spoof": bcast + mac + b"\\x08\\x06" + arp(gw, b"bunshin-arp-spoof"),
    "ipv6": bcast + mac + b"\\x86\\xdd" + bytes([0x60, 0, 0, 0, 0, 16, 17, 64]) + b"\\xfe\\x80" + b"\\0" * 30
            + b"bunshin-ipv6",
}
for _ in range(3):
    for f in frames.values():
        s.send(f)
print("sent")
"""


def _out(ws: Workspace, script: str, *args: str) -> str:
    return run_ok(ws, ["python3", "-c", script, *args], timeout=20).stdout.strip()


@contextlib.contextmanager
def _sandbox(kind: str, **spec: Any) -> Iterator[Workspace]:
    """A bridged workspace with `spec`: created, a clone of one (its source alive beside it), or
    one paused to disk and resumed (on a routed link of its own, as a clone)."""
    with Workspace.create(network="bridge", **spec) as src:
        if kind != "clone":
            if kind == "resumed":
                src.pause_to_disk()
                src.resume_from_disk()
            yield src
            return
        kid = forked(src.fork(1, "copy"))[0]
        try:
            yield kid
        finally:
            kid.destroy()


@contextlib.contextmanager
def _listener(family: int, addr: str) -> Iterator[tuple[socket.socket, int]]:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((addr, 0))
        s.listen(4)
        s.setblocking(False)
        yield s, s.getsockname()[1]
    finally:
        s.close()


def _accepted(s: socket.socket) -> bool:
    return bool(select.select([s], [], [], 0)[0])


def _serve(ws: Workspace) -> Any:
    ip = ws.info().network["ip"]
    return ws.commands.run(f"exec python3 -m http.server 8000 --bind {ip}", background=True)


def _reach(attacker: Workspace, victim: Workspace) -> str:
    return _out(attacker, CONNECT, victim.info().network["ip"], "8000")


@pytest.mark.parametrize("kind", KINDS)
def test_no_ipv6_to_the_host_link_local(kind: str) -> None:
    with _sandbox(kind) as ws, _listener(socket.AF_INET6, "::") as (srv, port):
        gw = ws.info().network["gateway"]
        assert _out(ws, LINK_LOCAL, gw, str(port)) != "connected"
        assert not _accepted(srv)
        # IPv6 is off on eth0 and for any interface to come; loopback keeps ::1.
        addrs = run_ok(ws, "ip -6 -o addr").stdout
        assert "eth0" not in addrs and "::1/128" in addrs, addrs
        assert run_ok(ws, "cat /proc/sys/net/ipv6/conf/eth0/disable_ipv6 "
                          "/proc/sys/net/ipv6/conf/default/disable_ipv6").stdout.split() == ["1", "1"]


@pytest.mark.parametrize("kind", KINDS)
def test_no_host_service_on_the_bridge_address(kind: str) -> None:
    with _sandbox(kind) as ws:
        gw = ws.info().network["gateway"]
        with _listener(socket.AF_INET, gw) as (srv, port):
            t0 = time.monotonic()
            assert _out(ws, CONNECT, gw, str(port)) == "ConnectionRefusedError"
            assert time.monotonic() - t0 < 5, "refused at once, never left to time out"
            assert not _accepted(srv)


@pytest.mark.parametrize("kind", KINDS)
def test_link_local_and_private_ranges(kind: str) -> None:
    with fake_host(prefix="169.254.77") as meta, fake_host(prefix="192.168.213") as lan:
        with _sandbox(kind) as ws:
            assert _out(ws, CONNECT, meta.addr, "7100") == "ConnectionRefusedError"
            assert _out(ws, CONNECT, lan.addr, "7100") == "connected"  # private ranges: only when asked
        with _sandbox(kind, block_private=True) as ws:
            assert _out(ws, CONNECT, lan.addr, "7100") == "ConnectionRefusedError"
        assert [p for p, _ in meta.seen()] == []
        assert len(lan.seen()) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_isolated_ports_reach_no_other_workspace(kind: str) -> None:
    with Workspace.create(network="bridge", port_isolation=True) as victim, \
            _sandbox(kind, port_isolation=True) as attacker, Workspace.create(network="bridge") as plain:
        server = _serve(victim)
        try:
            run_ok(victim, "for i in $(seq 100); do ss -ltn | grep -q :8000 && exit 0; sleep 0.05; done; exit 1")
            assert _reach(plain, victim) != "connected"  # isolation holds both ways
            assert _reach(attacker, victim) != "connected"
            # Its way out is the host's, as ever: refused at the gateway, not cut off.
            assert _out(attacker, CONNECT, attacker.info().network["gateway"], "9") == "ConnectionRefusedError"
        finally:
            server.kill()


def test_isolation_holds_with_bridge_rules_alone() -> None:
    """Bridged frames between two ports pass the ip-family hooks only when br_netfilter's
    bridge-nf-call-iptables is on (it is built in; dockerd turns it on). Without the ip-family
    rules the bridge-family ones must still hold, whatever that sysctl says; and with them gone
    too, the same probe connects (the test can see a connection)."""
    from bunshinfork.network import guard
    with Workspace.create(network="bridge", port_isolation=True) as a, \
            Workspace.create(network="bridge", port_isolation=True) as b:
        server = _serve(b)
        try:
            run_ok(b, "for i in $(seq 100); do ss -ltn | grep -q :8000 && exit 0; sleep 0.05; done; exit 1")
            assert guard.remove({a.id, b.id}, families=("inet",)) == sorted([a.id, b.id])
            assert _reach(a, b) != "connected"
            guard.remove({a.id, b.id}, families=("bridge",))
            # Retried: the dropped probes can leave a neighbour entry to resolve again first
            # (1 in 7 runs timed out within the probe's 1 s on the first try).
            wait_for(lambda: _reach(a, b) == "connected", timeout=15)
        finally:
            server.kill()


def test_forged_frames_never_reach_another_port() -> None:
    """Root with raw sockets (a privileged workspace) forges ARP, IPv6, source addresses and
    MACs; the victim's port sees only the honest frame. Clones sit on routed links of their
    own, with no other workspace on their segment, so this is about bridge ports."""
    with Workspace.create(network="bridge", privileged=True) as a, Workspace.create(network="bridge") as b:
        net = a.info().network
        mac = run_ok(a, "cat /sys/class/net/eth0/address").stdout.strip()
        sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))  # ETH_P_ALL
        try:
            sniff.bind((b.info().network["host_if"], 0))
            sniff.setblocking(False)
            assert _out(a, FORGE, net["ip"], net["gateway"], mac) == "sent"
            seen: set[str] = set()
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                if select.select([sniff], [], [], 0.05)[0]:
                    frame = sniff.recv(2048)
                    seen |= {w for w in ("legit", "ip-spoof", "mac-spoof", "arp-spoof", "ipv6")
                             if f"bunshin-{w}".encode() in frame}
        finally:
            sniff.close()
        assert seen == {"legit"}


@pytest.mark.parametrize("kind", KINDS)
def test_no_raw_sockets_but_ping_works(kind: str) -> None:
    with _sandbox(kind) as ws:
        assert _out(ws, RAW).splitlines() == ["packet PermissionError", "raw PermissionError", "ping reply"]
        bounding = int(run_ok(ws, "grep CapBnd /proc/self/status").stdout.split()[1], 16)
        assert not bounding & (1 << 13)  # CAP_NET_RAW


def test_egress_policy_holds_between_ports_with_bridge_rules_alone() -> None:
    """A closed workspace reaches no other workspace on the bridge, with its ip-family egress
    rules gone (as when bridge-nf-call-iptables is off: they never see bridged frames); a
    speculation's hold the same. Both ends are bridge ports: a clone's traffic is routed."""
    from bunshinfork.network import egress

    with Workspace.create(network="bridge", egress="closed") as a, Workspace.create(network="bridge") as b:
        server = _serve(b)
        try:
            run_ok(b, "for i in $(seq 100); do ss -ltn | grep -q :8000 && exit 0; sleep 0.05; done; exit 1")
            _drop_ip_family_egress(egress, a.id)
            assert _reach(a, b) != "connected"
            a.set_egress(None)
            assert _reach(a, b) == "connected"  # the probe sees a connection where one is allowed
            assert egress.hold_closed(a.id, a._rec.network)
            _drop_ip_family_egress(egress, a.id)
            assert _reach(a, b) != "connected"
            egress.release_hold(a.id)
        finally:
            server.kill()


def test_the_policy_in_force_is_not_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """set_egress with the policy a workspace has (a clone given its snapshot's, serve's every
    create) rewrites no rule; another policy is installed."""
    import bunshinfork.workspace as workspace_mod

    calls: list[object] = []
    real = workspace_mod.set_egress
    monkeypatch.setattr(workspace_mod, "set_egress", lambda *a: (calls.append(a[2]), real(*a)))
    with Workspace.create(network="bridge", egress="closed") as a:
        a.set_egress("closed")
        assert calls == []
        a.set_egress(None)
        assert len(calls) == 1 and a.info().egress is None


def _drop_ip_family_egress(egress: Any, ws_id: str) -> None:
    from bunshinfork.network.nat import nft_json

    rules = [r for r in egress.table_rules(egress.FAMILY, egress.TABLE) if egress._owner(r) == ws_id]
    assert rules
    nft_json([{"delete": {"rule": {"family": egress.FAMILY, "table": egress.TABLE, "chain": r["chain"],
                                   "handle": r["handle"]}}} for r in rules])
