"""Forking workspaces that have a network (paper §4.6): internal connections kept, external
ones closed in the clones and alive in the source, each clone online on its own.

The outside peer is a fake internet host in a namespace the test makes (fake_internet.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from fake_internet import PORT, PROBE, FakeHost, fake_host
from fork_support import COW, WORKLOADS, fork_chain, forked
from helpers import run_ok, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshinfork.commands import CommandHandle
from bunshinfork.errors import NetworkError, SpecError
from bunshinfork.network import clones
from bunshinfork.workspace import Workspace
from bunshinrl import Speculator, ToolCall
from bunshinrl.calls.tools import Tool

AGENT = "/root/netagent.py"
CLONES = 4

# Run inside a clone: a new connection to the fake host, one byte echoed.
CONNECT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(sys.argv[3].encode())
print(s.recv(64).decode())
"""


@pytest.fixture
def internet() -> Iterator[FakeHost]:
    with fake_host(0) as h:
        yield h


def netstate(ws: Workspace) -> tuple[int, str]:
    def probe() -> tuple[int, str] | None:
        raw = run_ok(ws, "cat /tmp/netstate 2>/dev/null || true").stdout.split(maxsplit=1)
        return (int(raw[0]), raw[1]) if len(raw) == 2 else None
    return wait_for(probe, timeout=10)


def _started(ws: Workspace, h: CommandHandle) -> bool:
    if ws.files.exists(f"/.bunshin/cmd/{h.cmd_id}/exit"):
        raise AssertionError(f"agent died: {ws.files.read(f'/.bunshin/cmd/{h.cmd_id}/stderr')}")
    raw = run_ok(ws, "cat /tmp/netstate 2>/dev/null || true").stdout.split(maxsplit=1)
    return len(raw) == 2 and raw[1].startswith("alive") and int(raw[0]) > 5


def start(ws: Workspace, host: FakeHost) -> None:
    ws.files.write(AGENT, (WORKLOADS / "netagent.py").read_text())
    ip = ws.info().network["ip"]
    h = ws.commands.run(f"exec python3 {AGENT} {ip} {host.addr} {PORT}", background=True)
    assert isinstance(h, CommandHandle)
    try:
        wait_for(lambda: _started(ws, h), timeout=20)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_diagnose(ws, host)}") from None


def _diagnose(ws: Workspace, host: FakeHost) -> str:
    """What the routes and filters looked like when the workspace could not reach the fake host."""
    inside = ws.commands.run("ip -4 addr; ip -4 route; ip neigh", timeout=10)
    out = [f"inside: {getattr(inside, 'stdout', inside)}"]
    for cmd in (["ip", "-4", "route"], ["ip", "route", "get", host.addr], ["sysctl", "net.ipv4.ip_forward"],
                ["ip", "netns", "exec", host.name, "ip", "-4", "route"], ["ip", "neigh"],
                ["nft", "list", "ruleset"], ["cat", "/proc/net/nf_conntrack"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        out.append(f"{' '.join(cmd)}: {r.stdout}{r.stderr}")
    return "\n".join(out)[:8000]


def advances(ws: Workspace) -> bool:
    first = netstate(ws)[0]
    return bool(wait_for(lambda: netstate(ws)[0] > first, timeout=10))


def check_family(src: Workspace, kids: list[Workspace], host: FakeHost) -> None:
    inside = run_ok(src, "ip -4 -o addr show eth0; ip -4 route; cat /etc/resolv.conf 2>/dev/null || true").stdout
    flows_before = len(host.seen())
    for ws in [src, *kids]:
        assert advances(ws), ws.id  # the internal pair, through eth0's address, survived
        assert run_ok(ws, "ip -4 -o addr show eth0; ip -4 route; cat /etc/resolv.conf 2>/dev/null || true"
                      ).stdout == inside
    # The source's external connection is alive and still carries traffic.
    ext_n = int(netstate(src)[1].split()[1])
    wait_for(lambda: netstate(src)[1].startswith("alive") and int(netstate(src)[1].split()[1]) > ext_n + 3,
             timeout=10)
    for ws in kids:
        # Closed at the first use after the fork, by a reset or EOF, never by a timeout.
        state = wait_for(lambda ws=ws: netstate(ws)[1] if netstate(ws)[1].startswith("closed") else None,
                         timeout=5)
        assert state in ("closed:ConnectionAbortedError", "closed:ConnectionResetError", "closed:EOF"), state
    # Nothing of an inherited flow reached the fake host: no new flow yet, only the echo of the
    # source's own bytes.
    assert len(host.seen()) == flows_before
    for i, ws in enumerate(kids):
        tag = f"clone{i}"
        assert run_ok(ws, ["python3", "-c", CONNECT, host.addr, str(PORT), tag], timeout=20).stdout.strip() == tag
    new = host.seen()[flows_before:]
    assert len(set(new)) == len(kids), new


@pytest.mark.parametrize("memory", ["copy", "ksm", COW])
@pytest.mark.parametrize("nat", [False, True], ids=["routed", "nat"])
def test_fork_keeps_internal_closes_external(internet: FakeHost, memory: str, nat: bool) -> None:
    with Workspace.create(network="bridge", nat=nat) as src:
        start(src, internet)
        kids = forked(src.fork(CLONES, memory))
        try:
            check_family(src, kids, internet)
            # A fork of a fork behaves the same.
            grand = forked(kids[0].fork(1, memory))
            try:
                state = wait_for(lambda: netstate(grand[0])[1], timeout=5)
                assert advances(grand[0])
                assert state.startswith("closed"), state
            finally:
                for g in grand:
                    g.destroy()
        finally:
            for k in kids:
                k.destroy()
    assert clones.table_rules() == []


def test_fork_in_a_user_namespace_is_online(internet: FakeHost) -> None:
    """A clone in a user namespace (serve's default) gets eth0 as the source had it (CRIU's
    usernsd makes it in the clone's namespace: criu/patches/0012), and
    its ICMP sockets (ping_group_range in the map's host gids, which CRIU's dump maps into the
    namespace: the whole-range value failed the restore with EINVAL)."""
    with Workspace.create(rootfs="debian", userns=True, network="bridge", nat=True) as src:
        start(src, internet)
        kids = forked(src.fork(2, "copy"))
        try:
            check_family(src, kids, internet)
            for k in kids:
                assert run_ok(k, ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "python3", "-c",
                                  "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM, "
                                  "socket.IPPROTO_ICMP); print('icmp')"]).stdout.strip() == "icmp"
        finally:
            for k in kids:
                k.destroy()
    assert clones.table_rules() == []


def test_fork_of_a_saved_snapshot(internet: FakeHost, tmp_path: object) -> None:
    with Workspace.create(network="bridge") as src:
        start(src, internet)
        snap = src.snapshot("copy")
        try:
            path = snap.save(str(tmp_path) + "/saved").result(timeout=120)  # type: ignore[operator]
        finally:
            snap.release()
        from bunshinfork import Snapshot
        loaded = Snapshot.load(path)
        try:
            kids = forked(loaded.fork(2))
            try:
                check_family(src, kids, internet)
            finally:
                for k in kids:
                    k.destroy()
        finally:
            loaded.release()  # its file-system layer


def test_clone_rules_go_with_a_failed_fork(internet: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    from bunshinfork.process import restore

    def fail(_session: object) -> None:
        raise RuntimeError("injected restore failure")

    with Workspace.create(network="bridge") as src:
        start(src, internet)
        monkeypatch.setattr(restore, "RESTORE_HOOK", fail)
        results = src.fork(2, "copy")
        assert all(isinstance(r, Exception) for r in results), results
        assert clones.table_rules() == []
        assert clones.leftover_rules() == set()
        monkeypatch.setattr(restore, "RESTORE_HOOK", None)
        assert netstate(src)[1].startswith("alive")


def _ask(addr: tuple[str, int]) -> str:
    with socket.create_connection(addr, timeout=10) as s:
        return s.makefile().readline().strip()


def test_each_clone_publishes_its_own_port(internet: FakeHost) -> None:
    with Workspace.create(network="bridge") as src:
        start(src, internet)
        kids = forked(src.fork(CLONES, "copy"))
        try:
            addrs = {}
            for ws in [src, *kids]:
                if ws is not src:
                    run_ok(ws, f"echo {ws.id} > /tmp/who")
                addrs[ws.id] = ws.ports.publish(8000)
            assert len(set(addrs.values())) == len(addrs)
            for ws_id, addr in addrs.items():
                who, count = _ask(addr).split()
                assert who == ("source" if ws_id == src.id else ws_id)
                assert int(count) > 0
            # A taken host port is a typed error, and builds nothing.
            with pytest.raises(NetworkError, match="taken"):
                kids[0].ports.publish(7000, host_port=addrs[src.id][1])
        finally:
            for k in kids:
                k.destroy()
        assert kids[0].ports.list() == {}


def test_publish_reaches_a_none_workspace() -> None:
    with Workspace.create() as ws:
        h = ws.commands.run("exec python3 -m http.server 8000 --bind 127.0.0.1", background=True)
        assert isinstance(h, CommandHandle)
        host, port = ws.ports.publish(8000)

        def get() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                return s.recv(12).startswith(b"HTTP/1.0 200")
            return False

        assert wait_for(get, timeout=10)
        assert ws.ports.unpublish(8000)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, port), timeout=5)


# ---- egress policy ----

def reach(ws: Workspace, host: FakeHost) -> str:
    return run_ok(ws, ["python3", "-c", PROBE, host.addr, str(PORT)], timeout=20).stdout.strip()


@pytest.fixture
def two_hosts() -> Iterator[tuple[FakeHost, FakeHost]]:
    with fake_host(0) as a, fake_host(1) as b:
        yield a, b


def _allowed(policy: dict[str, list[str]], addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if any(ip in ipaddress.ip_network(c) for c in policy.get("allow_out", [])):
        return True
    return not any(ip in ipaddress.ip_network(c) for c in policy.get("deny_out", []))


def _check_policy(family: list[Workspace], hosts: tuple[FakeHost, ...], policy: dict[str, list[str]]) -> None:
    for host in hosts:
        before = len(host.seen())
        expect = "connected" if _allowed(policy, host.addr) else "ConnectionRefusedError"
        for ws in family:
            t0 = time.monotonic()
            assert reach(ws, host) == expect, (ws.id, host.addr, policy)
            assert time.monotonic() - t0 < 5  # rejected at once, never a timeout
        arrived = len(host.seen()) - before
        assert arrived == (len(family) if expect == "connected" else 0), (host.addr, policy)


@pytest.mark.parametrize("policy", [
    {"deny_out": ["198.51.100.6/32"]},
    {"allow_out": ["198.51.100.2"], "deny_out": ["0.0.0.0/0"]},
], ids=["deny-one", "allow-wins"])
def test_egress_policy_holds_in_source_and_clones(two_hosts: tuple[FakeHost, FakeHost],
                                                  policy: dict[str, list[str]]) -> None:
    with Workspace.create(network="bridge", egress=policy) as src:
        kids = forked(src.fork(2, "copy"))
        try:
            _check_policy([src, *kids], two_hosts, policy)
        finally:
            for k in kids:
                k.destroy()


def test_closed_egress_and_bad_rules_are_typed_errors() -> None:
    for bad in ({"deny_out": ["example.com"]}, {"allow_out": ["10.0.0.0/33"]}, {"deny_out": "0.0.0.0/0"},
                {"allow_out": ["::1"]}, {"rules": []}, "open"):
        with pytest.raises(SpecError):
            Workspace.create(network="bridge", egress=bad)


CIDRS = ["198.51.100.2/32", "198.51.100.6/32", "198.51.100.0/24", "0.0.0.0/0"]


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(allow=st.lists(st.sampled_from(CIDRS), max_size=2, unique=True),
       deny=st.lists(st.sampled_from(CIDRS), max_size=2, unique=True),
       depth=st.integers(min_value=0, max_value=2))
def test_nothing_denied_ever_arrives(two_hosts: tuple[FakeHost, FakeHost], allow: list[str], deny: list[str],
                                     depth: int) -> None:
    policy = {"allow_out": allow, "deny_out": deny}
    with Workspace.create(network="bridge", nat=depth == 1, egress=policy) as src, fork_chain(src, depth) as family:
        _check_policy(family, two_hosts, policy)


# ---- speculation stays inside the workspace ----

@pytest.mark.parametrize("placement", ["live", "fork_first"])
def test_speculated_call_reaching_out_is_refused_then_runs_for_real(internet: FakeHost, placement: str) -> None:
    def fetch(ws: Workspace, tag: str) -> str:
        return reach(ws, internet)

    tool = Tool.from_function(fetch, name="fetch")
    call = ToolCall("fetch", {"tag": "a"})

    async def main() -> None:
        ws = await asyncio.to_thread(Workspace.create, network="bridge")
        spec = Speculator(memory="copy", placement=placement)  # type: ignore[arg-type]
        live: Workspace | None = None
        try:
            branch = await spec.launch(ws, [call], {"fetch": tool})
            await asyncio.to_thread(wait_for, lambda: branch.completed >= 1, 60)
            assert await branch.resolve(call) is None  # refused in the branch: a miss
            assert spec.stats["spec_refused_egress"] == 1
            assert internet.seen() == []
            live = await branch.close()
            assert await tool.run(live, call.args) == "connected"
            assert len(internet.seen()) == 1
        finally:
            await spec.drain()
            for w in (live, ws):
                if w is not None:
                    await asyncio.to_thread(w.destroy)

    asyncio.run(main())
