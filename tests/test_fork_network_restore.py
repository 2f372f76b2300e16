"""A bridged clone's network namespace, restored without the ip and iptables tools where they had
nothing to add (CRIU patches 0012-0014), is the one its source had: its addresses and routes
(replayed from the ip tool's dumps), its rules (left as a new namespace has them only where they
are those), its legacy iptables rules (their tool probed and run only where the dump holds
rules); in a user namespace, eth0 made in the clone's namespace by CRIU's usernsd rather than
moved in. Each source is changed from the host, as code with CAP_NET_ADMIN inside could.
CRIU's dump keeps the main routing table only (`ip route save`): routes in other tables were
never carried, with the ip tool or without it."""

from __future__ import annotations

import re
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshinfork import Snapshot, Workspace, state
from bunshinfork.errors import ForkError

USERNS = [pytest.param(False, id="root"), pytest.param(True, id="userns")]


def _in_netns(ws: Workspace, *argv: str) -> str:
    r = subprocess.run(["nsenter", "-t", str(ws.init_pid), "-n", *argv], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, (argv, r.stderr)
    return r.stdout


def _view(ws: Workspace) -> dict[str, list[str]]:
    """What the namespace holds, as the host's ip tool lists it: ifindexes and link-layer
    addresses included (a clone keeps eth0's), lifetimes and counters left out."""
    addrs = [re.sub(r"\s+valid_lft.*", "", ln) for ln in _in_netns(ws, "ip", "-o", "addr", "show").splitlines()]
    links = [re.sub(r"@if\d+|link-netnsid \d+", "", ln)
             for ln in _in_netns(ws, "ip", "-o", "link", "show").splitlines()]
    return {"addr": addrs, "link": [re.sub(r"state \w+ ", "", ln) for ln in links],
            "route": sorted(_in_netns(ws, "ip", "route", "show", "table", "all").splitlines()),  # local too
            "rule": _in_netns(ws, "ip", "rule", "show").splitlines(),
            "iptables-legacy": _in_netns(ws, "iptables-legacy", "-S").splitlines()}


def _log(ws: Workspace) -> str:
    return (state.RUN_ROOT / ws.id / "criu" / "restore.log").read_text(errors="replace")


@pytest.fixture
def source(request: pytest.FixtureRequest) -> Iterator[Workspace]:
    userns = request.param
    with Workspace.create(rootfs="debian" if userns else "host", userns=userns, network="bridge", nat=True) as ws:
        yield ws


def _clone(snap: Snapshot) -> Workspace:
    (c,) = snap.fork(1)
    assert not isinstance(c, Exception), c
    return c


@pytest.mark.parametrize("source", USERNS, indirect=True)
def test_a_clone_has_its_sources_addresses_routes_and_rules(source: Workspace) -> None:
    gateway = source.info().network["gateway"]
    _in_netns(source, "ip", "addr", "add", "10.77.0.5/32", "dev", "eth0")
    _in_netns(source, "ip", "route", "add", "10.78.0.0/24", "via", gateway, "dev", "eth0", "src", "10.77.0.5")
    with source.snapshot("copy") as snap:
        c = _clone(snap)
        try:
            assert _view(c) == _view(source)
            log = _log(c)
            assert "ip addr dump replayed: done" in log and "ip route dump replayed: done" in log
            assert "ip rules as saved" in log  # the three a new namespace has
            assert "Running ip " not in log and "nft backend" not in log and "iptables" not in log
            if source.record.spec.userns:  # made where it lives, not made on the host and moved
                assert "Restoring netdev eth0 idx" in log and "via usernsd" in log
                assert "move_veth" not in log
        finally:
            c.destroy()


@pytest.mark.parametrize("source", USERNS, indirect=True)
def test_a_sources_own_rules_and_legacy_iptables_are_restored_by_their_tools(source: Workspace) -> None:
    _in_netns(source, "ip", "rule", "add", "from", "10.77.0.9", "table", "100", "priority", "100")
    _in_netns(source, "iptables-legacy", "-A", "OUTPUT", "-d", "10.79.0.1", "-j", "DROP")
    with source.snapshot("copy") as snap:
        c = _clone(snap)
        try:
            view = _view(c)
            assert view == _view(source)
            assert any("from 10.77.0.9 lookup 100" in r for r in view["rule"])
            assert "-A OUTPUT -d 10.79.0.1/32 -j DROP" in view["iptables-legacy"]
            log = _log(c)
            assert "Running ip rule restore" in log and "ip rules as saved" not in log
            assert "iptables-legacy-restore" in log
        finally:
            c.destroy()


@pytest.fixture(scope="module")
def saved_bridged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with Workspace.create(network="bridge", nat=True) as ws:
        snap = ws.snapshot("copy")
        try:
            path = Path(snap.save(str(tmp_path_factory.mktemp("bridged") / "s")).result(timeout=120))  # type: ignore[union-attr]
        finally:
            snap.release()
    yield path


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(image=st.sampled_from(["ifaddr", "route", "rule"]),
       magic=st.sampled_from([0x47361222, 0x45311224, 0x71706986, 0]),
       body=st.binary(max_size=256))
def test_a_snapshots_forged_ip_dump_is_refused_or_restored_inside_its_clone(
        saved_bridged: Path, image: str, magic: int, body: bytes) -> None:
    """A snapshot is untrusted: its ip dumps, replayed by CRIU itself now, are forged here (any
    magic, any bytes after it). The clone is made or refused with a ForkError, nothing is left
    behind (the leak census), and what was replayed stayed inside the clone's namespace: the
    host's addresses, routes and rules are as they were."""
    (f,) = (saved_bridged / "images").glob(f"{image}-*.img")
    original = f.read_bytes()
    host = _host_net()
    f.write_bytes(struct.pack("I", magic) + body)
    try:
        loaded = Snapshot.load(saved_bridged)
        try:
            (c,) = loaded.fork(1)
            if isinstance(c, Exception):
                assert isinstance(c, ForkError), c
            else:
                c.destroy()
        finally:
            loaded.release()
    finally:
        f.write_bytes(original)
    assert _host_net() == host


def _host_net() -> tuple[set[tuple[str, str]], set[str], list[str]]:
    """The host's addresses (by device), routes and rules; not what changes by itself (address
    lifetimes, a bridge's carrier)."""
    def ip(*argv: str) -> list[str]:
        return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10).stdout.splitlines()
    addrs = {(ln.split()[1], ln.split()[3]) for ln in ip("-o", "addr", "show")}
    routes = {ln.replace(" linkdown", "") for ln in ip("route", "show", "table", "all")}
    return addrs, routes, ip("rule", "show")
