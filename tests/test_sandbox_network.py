"""Sandbox's network with E2B's semantics: online by default (a bridged workspace with NAT,
which forks), E2B's own rule shapes in Sandbox.create(network=...) and update_network, a
typed error for what cannot apply locally. Workspace keeps loopback only by default.

The outside peers are fake internet hosts in namespaces the test makes (fake_internet.py):
198.51.100.2 (allowed in the tests) and 198.51.100.6 (denied).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_internet import FakeHost, fake_host, reach_from_sandbox
from helpers import wait_for

from bunshinfork import AsyncSandbox, InvalidArgumentException, Sandbox, Workspace, state
from bunshinfork.network import ports

REFUSED = "ConnectionRefusedError"


@pytest.fixture
def two_hosts() -> Iterator[tuple[FakeHost, FakeHost]]:
    with fake_host(0) as a, fake_host(1) as b:
        yield a, b


def check(family: list[Sandbox], hosts: tuple[FakeHost, FakeHost], expect: tuple[str, str]) -> None:
    """Every sandbox of `family` meets `expect` at each host, and a host sees only the allowed flows."""
    for host, want in zip(hosts, expect, strict=True):
        before = len(host.seen())
        for sbx in family:
            assert reach_from_sandbox(sbx, host) == want, (sbx.sandbox_id, host.addr)
        assert len(host.seen()) - before == (len(family) if want == "connected" else 0), host.addr


def forks(sbx: Sandbox, n: int) -> list[Sandbox]:
    kids = sbx.fork(count=n)
    assert all(isinstance(k, Sandbox) for k in kids), kids
    return [k for k in kids if isinstance(k, Sandbox)]


def test_sandbox_is_online_by_default_and_forks(two_hosts: tuple[FakeHost, FakeHost]) -> None:
    with Sandbox.create() as sbx:
        net = sbx.workspace.info().network
        assert net["mode"] == "bridge" and net["nat"] is True
        info = sbx.get_info()
        assert info.allow_internet_access is True and info.network == {}
        kids = forks(sbx, 2)
        try:
            check([sbx, *kids], two_hosts, ("connected", "connected"))
            assert all(k.get_info().allow_internet_access for k in kids)
        finally:
            for k in kids:
                k.kill()
    with Workspace.create() as ws:
        assert ws.info().network == {"mode": "none"}  # Workspace's default stays loopback only


def test_create_with_e2b_rule_shapes_holds_in_forks(two_hosts: tuple[FakeHost, FakeHost]) -> None:
    allowed, denied = two_hosts
    # E2B's documented shapes: a static list, and a callable given ctx.all_traffic.
    with Sandbox.create(network={"allow_out": [allowed.addr], "deny_out": lambda ctx: [ctx.all_traffic]}) as sbx:
        assert sbx.get_info().network == {"allow_out": [f"{allowed.addr}/32"], "deny_out": ["0.0.0.0/0"]}
        kids = forks(sbx, 2)
        try:
            check([sbx, *kids], two_hosts, ("connected", REFUSED))
            # A fork of a fork too.
            grand = forks(kids[0], 1)
            try:
                check(grand, two_hosts, ("connected", REFUSED))
            finally:
                grand[0].kill()
        finally:
            for k in kids:
                k.kill()
    with Sandbox.create(network={"deny_out": [f"{denied.addr}/32"]}) as sbx:
        check([sbx], two_hosts, ("connected", REFUSED))


def test_allow_internet_access_false_is_deny_all_where_allow_out_wins(two_hosts: tuple[FakeHost, FakeHost]) -> None:
    allowed, _ = two_hosts
    with Sandbox.create(allow_internet_access=False) as sbx:
        info = sbx.get_info()
        assert info.allow_internet_access is False and info.network == {"allow_out": [], "deny_out": ["0.0.0.0/0"]}
        check([sbx], two_hosts, (REFUSED, REFUSED))
        # Still reachable from the host: only egress is closed.
        sbx.commands.run("cd /tmp && exec python3 -m http.server 8000", background=True)
        host, port = sbx.get_host(8000).split(":")
        assert wait_for(lambda: _http_ok(host, int(port)), timeout=20)
    with Sandbox.create(allow_internet_access=False, network={"allow_out": [allowed.addr]}) as sbx:
        check([sbx], two_hosts, ("connected", REFUSED))


def _http_ok(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return s.recv(12).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


def test_update_network_replaces_the_rules(two_hosts: tuple[FakeHost, FakeHost]) -> None:
    allowed, denied = two_hosts
    with Sandbox.create() as sbx:
        sbx.update_network({"deny_out": [denied.addr]})
        check([sbx], two_hosts, ("connected", REFUSED))
        # By id, from the class (another object over the same sandbox): E2B's variant.
        Sandbox.update_network(sbx.sandbox_id, {"allow_internet_access": False, "allow_out": [allowed.addr]})
        assert sbx.get_info().allow_internet_access is False
        check([sbx], two_hosts, ("connected", REFUSED))
        # A fork made now inherits the rules in force, whoever set them.
        (kid,) = forks(sbx, 1)
        try:
            check([kid], two_hosts, ("connected", REFUSED))
            assert kid.get_info().allow_internet_access is False
        finally:
            kid.kill()
        # What an update leaves out is cleared: everything allowed again.
        sbx.update_network({})
        assert sbx.get_info().network == {} and sbx.get_info().allow_internet_access is True
        check([sbx], two_hosts, ("connected", "connected"))
        with pytest.raises(InvalidArgumentException):
            sbx.update_network({"deny_out": ["example.com"]})
        check([sbx], two_hosts, ("connected", "connected"))  # a refused update changed nothing

        async def via_asyncio() -> None:
            asbx = await AsyncSandbox.from_id(sbx.sandbox_id)
            await asbx.update_network({"deny_out": [allowed.addr, denied.addr]})

        asyncio.run(via_asyncio())
        check([sbx], two_hosts, (REFUSED, REFUSED))


@pytest.mark.parametrize("network", [
    {"rules": {"api.example.com": [{"transform": {"headers": {"X": "y"}}}]}},
    {"egress_proxy": {"address": "proxy.example.com:1080"}},
    {"dns_servers": ["1.1.1.1"]},
    {"mask_request_host": "${PORT}-x.example.com"},
    {"deny_out": ["example.com"]},
    {"allow_out": ["10.0.0.0/33"]},
    {"deny_out": "0.0.0.0/0"},
    {"allow_public_traffic": False},
    {"https_ports": ["443"]},
    {"no_such_option": True},
], ids=["rules", "egress_proxy", "dns_servers", "mask_request_host", "domain-denied", "bad-cidr", "not-a-list",
        "public-traffic", "https-ports", "unknown"])
def test_what_cannot_apply_is_a_typed_error_before_anything_is_built(network: dict[str, object]) -> None:
    before = set(state.all_ids())
    with pytest.raises(InvalidArgumentException):
        Sandbox.create(network=network)  # type: ignore[arg-type]
    assert set(state.all_ids()) == before


def test_accepted_options_that_configure_only_the_transport() -> None:
    # https_ports re-encrypts E2B's public URLs; here a port is reached directly, TLS and all.
    with Sandbox.create(network={"https_ports": [443], "allow_public_traffic": True, "egress_proxy": None}) as sbx:
        assert sbx.get_info().network == {}


# ---- published ports and gc ----

CHILD = """
import os, sys
from bunshinfork import Workspace
ws = Workspace.create()
ws.commands.run("exec python3 -m http.server 8000 --bind 127.0.0.1", background=True)
host, port = ws.ports.publish(8000)
print(ws.id, port, flush=True)
sys.stdin.read()
"""


def test_gc_frees_the_published_ports_of_a_dead_creator() -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    ws_id, port = child.stdout.readline().split()
    try:
        assert wait_for(lambda: _http_ok("127.0.0.1", int(port)), timeout=20)
        ports_file = state.RUN_ROOT / ws_id / ports.PORTS_FILE
        assert ports_file.exists()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(port)), timeout=5)
        # The entry outlived its publisher; `bunshin gc` drops it, and keeps the live workspace.
        out = subprocess.run([sys.executable, "-m", "bunshinfork.cli", "gc"], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"{ws_id}:8000" in out.stdout + out.stderr
        assert not ports_file.exists()
        assert Workspace.connect(ws_id).is_running()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        Workspace.connect(ws_id).destroy()


def _get(addr: str, path: str) -> str | None:
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    return body.decode() if head.startswith(b"HTTP/1.0 200") else None


def test_get_host_of_each_fork_reaches_that_fork() -> None:
    """Forks share their source's inside address: get_host must still reach each one's own port."""
    with Sandbox.create() as sbx:
        sbx.files.write("/tmp/www/who", "source")
        sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8000", background=True)
        assert wait_for(lambda: _get(sbx.get_host(8000), "/who") == "source", timeout=20)
        kids = forks(sbx, 2)
        try:
            for k in kids:
                k.files.write("/tmp/www/who", k.sandbox_id)
            for s in [sbx, *kids]:
                want = "source" if s is sbx else s.sandbox_id
                assert s.get_host(8000) == s.get_host(8000)  # one forwarder per port, as E2B's is one name
                assert _get(s.get_host(8000), "/who") == want, s.sandbox_id
        finally:
            for k in kids:
                k.kill()
