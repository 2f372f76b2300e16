"""Workspace networking, on real namespaces, veths, bridge and nftables.

Traffic rule of the test machines: nothing is sent anywhere but to loopback, the bridge
gateway and workspace addresses; NAT is checked only by the rule it installs.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import secrets
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest
from pyroute2 import IPRoute, NetlinkError

from bunshinfork import network, state
from bunshinfork.commands import CommandHandle, CommandResult
from bunshinfork.errors import NetworkError, WorkspaceStateError
from bunshinfork.workspace import Workspace

HTTP_PORT = 8000

# Run inside a workspace: connect to argv[1]:argv[2], retrying for argv[3] seconds while refused.
PROBE = """
import socket, sys, time
host, port, patience = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + patience
while True:
    try:
        s = socket.create_connection((host, port), timeout=2)
    except OSError as e:
        if isinstance(e, ConnectionRefusedError) and time.monotonic() < deadline:
            time.sleep(0.02)
            continue
        print(type(e).__name__)
        sys.exit(1)
    s.sendall(b"hello")
    s.close()
    print("connected")
    break
"""


def _probe(ws: Workspace, host: str, port: int, patience: float = 0.0) -> CommandResult:
    r = ws.commands.run(["python3", "-c", PROBE, host, str(port), str(patience)], timeout=15)
    assert isinstance(r, CommandResult)
    return r


def _sh(ws: Workspace, cmd: str) -> str:
    r = ws.commands.run(cmd, timeout=15)
    assert isinstance(r, CommandResult)
    assert r.exit_code == 0, r
    return r.stdout


def _serve_http(ws: Workspace, bind: str) -> CommandHandle:
    h = ws.commands.run(f"exec python3 -m http.server {HTTP_PORT} --bind {bind}", background=True)
    assert isinstance(h, CommandHandle)
    return h


def _http_get(host: str, port: int, patience: float = 5.0) -> int:
    """Status of GET / from the host, retrying while the server is still starting."""
    deadline = time.monotonic() + patience
    while True:
        conn = http.client.HTTPConnection(host, port, timeout=2)
        try:
            conn.request("GET", "/")
            return conn.getresponse().status
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        finally:
            conn.close()


@contextlib.contextmanager
def _host_listener(addr: str) -> Iterator[tuple[socket.socket, int]]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((addr, 0))
        s.listen(4)
        s.settimeout(5)
        yield s, s.getsockname()[1]
    finally:
        s.close()


def _link(ipr: IPRoute, name: str) -> Any:
    idx = ipr.link_lookup(ifname=name)
    return ipr.get_links(idx[0])[0] if idx else None


@pytest.fixture
def bridge_ws() -> Iterator[Workspace]:
    with Workspace.create(network="bridge") as ws:
        yield ws


# ---- mode "none" ----

def test_none_mode_has_only_loopback_and_no_way_out() -> None:
    with Workspace.create() as ws, _host_listener("127.0.0.1") as (_, port):
        assert ws.info().network == {"mode": "none"}
        links = _sh(ws, "ip -o link").strip().splitlines()
        assert len(links) == 1, links
        assert ": lo: " in links[0] and "UP" in links[0]
        assert _sh(ws, "ip -4 route").strip() == ""
        # The workspace's 127.0.0.1 is its own loopback, not the host's listener.
        r = _probe(ws, "127.0.0.1", port)
        assert (r.exit_code, r.stdout.strip()) == (1, "ConnectionRefusedError")
        # No route at all: the kernel refuses before a packet exists.
        r = _probe(ws, str(network.subnet().network_address + 1), port)
        assert r.exit_code == 1 and "connected" not in r.stdout


# ---- mode "bridge" ----

def test_bridge_workspace_gets_eth0_with_its_address(bridge_ws: Workspace) -> None:
    net = bridge_ws.info().network
    sub = network.subnet()
    assert net["mode"] == "bridge" and net["nat"] is False
    assert net["host_if"] == network.host_ifname(bridge_ws.id)
    assert len(net["host_if"]) <= 15 and net["host_if"].startswith("bn")
    assert ipaddress.ip_address(net["ip"]) in sub and net["ip"] != net["gateway"]
    assert net["gateway"] == str(sub.network_address + 1) and net["prefixlen"] == sub.prefixlen

    assert f"inet {net['ip']}/{net['prefixlen']} " in _sh(bridge_ws, "ip -o -4 addr show dev eth0")
    assert "UP" in _sh(bridge_ws, "ip -o link show dev eth0")
    assert f"default via {net['gateway']} dev eth0" in _sh(bridge_ws, "ip route show default")

    with IPRoute() as ipr:
        br = _link(ipr, network.BRIDGE)
        host = _link(ipr, net["host_if"])
        assert br is not None and host is not None
        assert host.get("master") == br["index"]
        assert host.get("operstate") == "UP"
        addrs = {a.get("address") for a in ipr.get_addr(index=br["index"], family=socket.AF_INET)}
        assert net["gateway"] in addrs


def test_host_reaches_a_server_inside_the_workspace(bridge_ws: Workspace) -> None:
    ip = bridge_ws.info().network["ip"]
    server = _serve_http(bridge_ws, ip)
    try:
        assert _http_get(ip, HTTP_PORT) == 200
    finally:
        server.kill()


def _link_answers(ws: Workspace) -> bool:
    """The gateway answers at once: a host service there is refused (guard.py), by the host."""
    gateway = ws.info().network["gateway"]
    with _host_listener(gateway) as (_, port):
        r = _probe(ws, gateway, port)
    return (r.exit_code, r.stdout.strip()) == (1, "ConnectionRefusedError")


def test_workspace_reaches_the_gateway_and_no_host_service(bridge_ws: Workspace) -> None:
    assert _link_answers(bridge_ws)


def test_two_workspaces_get_distinct_addresses_and_reach_each_other() -> None:
    with Workspace.create(network="bridge") as a, Workspace.create(network="bridge") as b:
        na, nb = a.info().network, b.info().network
        assert na["ip"] != nb["ip"] and na["host_if"] != nb["host_if"]
        server = _serve_http(b, nb["ip"])
        try:
            r = _probe(a, nb["ip"], HTTP_PORT, patience=5)
            assert r.stdout.strip() == "connected", r
        finally:
            server.kill()


def test_loopback_is_private_to_each_workspace() -> None:
    with Workspace.create(network="bridge") as a, Workspace.create(network="bridge") as b:
        server = _serve_http(a, "127.0.0.1")
        try:
            assert _probe(a, "127.0.0.1", HTTP_PORT, patience=5).stdout.strip() == "connected"
            r = _probe(b, "127.0.0.1", HTTP_PORT)
            assert (r.exit_code, r.stdout.strip()) == (1, "ConnectionRefusedError")
        finally:
            server.kill()


def test_destroy_removes_the_veth_and_is_idempotent() -> None:
    ws = Workspace.create(network="bridge")
    net = ws.info().network
    assert net["host_if"] in network.leftover_interfaces()
    ws.destroy()
    assert net["host_if"] not in network.leftover_interfaces()
    assert not Path(f"/sys/class/net/{net['host_if']}").exists()
    ws.destroy()
    network.teardown(ws.id, ws._rec.network)
    network.teardown(ws.id, None)
    with pytest.raises(WorkspaceStateError):
        ws.commands.run("true")


# ---- NAT ----

def _has_masquerade(rules: list[dict[str, Any]], sub: ipaddress.IPv4Network) -> bool:
    prefix = {"prefix": {"addr": str(sub.network_address), "len": sub.prefixlen}}
    return any(
        {"masquerade": None} in r["expr"]
        and any(e.get("match", {}).get("right") == prefix for e in r["expr"])
        for r in rules
    )


def test_nat_rule_lives_exactly_as_long_as_nat_workspaces() -> None:
    pytest.importorskip("nftables", reason="needs python3-nftables (system site-packages)")
    if network.nat_rules():
        pytest.skip("another NAT workspace is running on this host")
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    forward_before = forward.read_text()
    sub = network.subnet()

    with Workspace.create(network="bridge"):
        assert network.nat_rules() == []  # a plain bridge workspace needs no NAT

    a = Workspace.create(network="bridge", nat=True)
    try:
        assert a.info().network["nat"] is True
        assert _has_masquerade(network.nat_rules(), sub)
        assert forward.read_text().strip() == "1"
        with Workspace.create(network="bridge", nat=True):
            assert len(network.nat_rules()) == 1  # shared, not one rule per workspace
        assert _has_masquerade(network.nat_rules(), sub), "the table went with a workspace that was not last"
    finally:
        a.destroy()
    assert network.nat_rules() == []
    assert forward.read_text() == forward_before


# ---- gc and errors ----

def test_gc_removes_orphan_veths_and_then_the_bridge() -> None:
    tail = secrets.token_hex(5)  # other sessions may run this test on the same host
    orphan = "bn" + tail
    with IPRoute() as ipr:
        ipr.link("add", ifname=orphan, kind="veth", peer="bx" + tail)
    try:
        assert orphan in network.leftover_interfaces()
        with Workspace.create(network="bridge") as ws:
            host_if = ws.info().network["host_if"]
            removed = network.gc()
            assert orphan in removed
            assert host_if not in removed and network.BRIDGE not in removed
            assert orphan not in network.leftover_interfaces()
            assert host_if in network.leftover_interfaces()
            assert _link_answers(ws)
        others = network.leftover_interfaces()  # another session's workspaces on this host
        removed = network.gc()
        if not others:
            assert network.BRIDGE in removed
            assert not Path(f"/sys/class/net/{network.BRIDGE}").exists()
    finally:
        with IPRoute() as ipr, contextlib.suppress(NetlinkError):
            ipr.link("del", ifname=orphan)


def test_gc_under_another_state_root_spares_live_workspaces(
    bridge_ws: Workspace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    net = bridge_ws.info().network
    monkeypatch.setattr(state, "RUN_ROOT", tmp_path)
    removed = network.gc()
    monkeypatch.undo()
    assert net["host_if"] not in removed and network.BRIDGE not in removed
    assert net["host_if"] in network.leftover_interfaces()
    assert _link_answers(bridge_ws)


def test_bad_subnet_is_refused_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNSHIN_SUBNET", "not-a-net")
    with pytest.raises(NetworkError, match="BUNSHIN_SUBNET"):
        Workspace.create(network="bridge")
    monkeypatch.setenv("BUNSHIN_SUBNET", "fd00:1::/64")
    with pytest.raises(NetworkError, match="IPv4"):
        Workspace.create(network="bridge")


def test_subnet_change_under_running_workspaces_is_refused(
    bridge_ws: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUNSHIN_SUBNET", "10.214.0.0/16")
    with pytest.raises(NetworkError, match="same subnet"):
        Workspace.create(network="bridge")
    assert network.leftover_interfaces().count(bridge_ws.info().network["host_if"]) == 1


def test_subnet_overlapping_a_host_interface_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    tail = secrets.token_hex(5)
    taken = "bn" + tail  # a veth, since not every kernel has dummy interfaces
    with IPRoute() as ipr:
        ipr.link("add", ifname=taken, kind="veth", peer="bx" + tail)
        try:
            ipr.addr("add", index=ipr.link_lookup(ifname=taken)[0], address="10.215.7.1", prefixlen=24)
            monkeypatch.setenv("BUNSHIN_SUBNET", "10.215.0.0/16")
            with pytest.raises(NetworkError, match=f"overlaps 10.215.7.0/24 on host interface {taken}"):
                Workspace.create(network="bridge")
        finally:
            ipr.link("del", ifname=taken)


def test_concurrent_creates_get_distinct_addresses() -> None:
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(Workspace.create, network="bridge") for _ in range(4)]
        wait(futures)
    spaces = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(spaces) == 4, [f.exception() for f in futures]
        ips = [ws.info().network["ip"] for ws in spaces]
        assert len(set(ips)) == 4, ips
        assert {ws.info().network["host_if"] for ws in spaces} <= set(network.leftover_interfaces())
    finally:
        for ws in spaces:
            ws.destroy()
