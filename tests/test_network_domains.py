"""Domain names in egress allow_out: matched on the HTTP Host header and the TLS SNI by the
workspace's host-side proxy, in the source and in its clones.

Two fake internet hosts (fake_internet.py) serve HTTP on 80 and TLS on 443 (a self-signed
certificate made here), and a third answers DNS for the test's names; the workspaces resolve
through it, and so do the proxies ($BUNSHIN_EGRESS_RESOLVER). Every connection that reaches a
fake host carries a tag, so a test knows exactly which probe arrived where.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import ssl
import struct
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_internet import PORT, FakeHost, fake_host
from fork_support import fork_chain, forked
from helpers import run_ok
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshinfork.errors import WorkspaceStateError
from bunshinfork.network import gc as network_gc
from bunshinfork.network import proxies
from bunshinfork.network.sniproxy import name_matches
from bunshinfork.workspace import Workspace

A, B, DNS = "198.51.100.2", "198.51.100.6", "198.51.100.10"
NAMES = {"allowed.test": A, "denied.test": B, "wild.test": A, "a.wild.test": A, "deep.sub.wild.test": B}
POLICY = {"allow_out": [f"{DNS}/32", "allowed.test", "*.wild.test"], "deny_out": ["0.0.0.0/0"]}
REFUSED = ("ConnectionResetError", "ConnectionRefusedError")

PROBE = r"""
import json, socket, ssl, sys, time
out = []
for p in json.loads(sys.argv[1]):
    t0 = time.monotonic()
    try:
        ip = p.get("ip") or socket.gethostbyname(p["name"])
        s = socket.create_connection((ip, p["port"]), timeout=8)
        if p["port"] == 443:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(s, server_hostname=p["name"])
            msg = p["tag"].encode()
        else:
            msg = ("GET /%s HTTP/1.1\r\nHost: %s\r\n\r\n" % (p["tag"], p["name"])).encode()
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        r = "ok" if got == msg else "EOF"
    except Exception as e:
        r = type(e).__name__
    out.append([r, time.monotonic() - t0])
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Probe:
    name: str  # in Host / SNI
    port: int
    ip: str | None = None  # where the client connects; None: the name as the workspace resolves it


# ---- the fake internet: web hosts and a DNS server ----

def _dns_answer(query: bytes, names: dict[str, str]) -> bytes | None:
    if len(query) < 17:
        return None
    qid = struct.unpack_from("!H", query)[0]
    p, labels = 12, []
    while p < len(query) and query[p]:
        labels.append(query[p + 1:p + 1 + query[p]].decode(errors="replace"))
        p += 1 + query[p]
    if p + 5 > len(query):
        return None
    qtype = struct.unpack_from("!H", query, p + 1)[0]
    question = query[12:p + 5]
    addr = names.get(".".join(labels).lower())
    answer = b""
    if addr and qtype == 1:
        answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(addr)
    rcode = 0 if addr else 3  # NXDOMAIN
    return struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, 1 if answer else 0, 0, 0) + question + answer


@contextlib.contextmanager
def dns_server(host: FakeHost, names: dict[str, str]) -> Iterator[None]:
    """A records for `names`, answered on host's address, port 53, inside its namespace."""
    from bunshinfork.network.nsock import socket_in
    sock = socket_in(host.path, socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host.addr, 53))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                query, peer = sock.recvfrom(512)
                if not query:
                    return  # shut down
                if (reply := _dns_answer(query, names)) is not None:
                    sock.sendto(reply, peer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the recvfrom
        t.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def tls_context(tmp_path_factory: pytest.TempPathFactory) -> ssl.SSLContext:
    d = tmp_path_factory.mktemp("cert")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=fake",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    return ctx


@pytest.fixture
def web(tls_context: ssl.SSLContext, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, FakeHost]]:
    extra: dict[int, ssl.SSLContext | None] = {80: None, 443: tls_context}
    monkeypatch.setenv(proxies.RESOLVER_ENV, DNS)
    with fake_host(0, extra=extra) as a, fake_host(1, extra=extra) as b, fake_host(2) as d, dns_server(d, NAMES):
        assert (a.addr, b.addr, d.addr) == (A, B, DNS)
        yield {A: a, B: b}


# ---- probing ----

def probe(family: list[Workspace], hosts: dict[str, FakeHost], probes: list[Probe]) -> dict[str, list[str]]:
    """Run every probe from every workspace; returns, per fake host, the tags that arrived there.
    Each result must be "ok" or a refusal that came at once."""
    marks = {addr: len(h.arrivals) for addr, h in hosts.items()}
    results: dict[str, str] = {}
    for w, ws in enumerate(family):
        batch = [{"name": p.name, "port": p.port, "ip": p.ip, "tag": f"t{w}x{i}"} for i, p in enumerate(probes)]
        out = json.loads(run_ok(ws, ["python3", "-c", PROBE, json.dumps(batch)], timeout=120).stdout)
        for b, (result, seconds) in zip(batch, out, strict=True):
            assert result == "ok" or (result in REFUSED and seconds < 5), (ws.id, b, result, seconds)
            results[str(b["tag"])] = result
    arrived: dict[str, list[str]] = {}
    for addr, h in hosts.items():
        tags = []
        for a in h.arrivals[marks[addr]:]:
            text = a.first.decode(errors="replace")
            tag = text[5:].split(" ", 1)[0] if text.startswith("GET /") else text
            tags.append(tag)
        arrived[addr] = sorted(tags)
    # What the clients saw agrees with what arrived: "ok" exactly for the tags that got somewhere.
    ok = sorted(t for t, r in results.items() if r == "ok")
    assert ok == sorted(t for tags in arrived.values() for t in tags), (results, arrived)
    return arrived


def expected(policy: dict[str, list[str]], probes: list[Probe], n: int) -> dict[str, list[str]]:
    """Where each probe of `n` workspaces must arrive under `policy` (E2B's semantics, the
    proxy connecting to the name's own address)."""
    def within(addr: str, key: str) -> bool:
        return any(ipaddress.ip_address(addr) in ipaddress.ip_network(c)
                   for c in policy.get(key, []) if c[0].isdigit())

    domains = tuple(d for d in policy.get("allow_out", []) if not d[0].isdigit())
    out: dict[str, list[str]] = {A: [], B: []}
    for w in range(n):
        for i, p in enumerate(probes):
            dst = p.ip or NAMES[p.name]
            if within(dst, "allow_out") or not within(dst, "deny_out"):
                out[dst].append(f"t{w}x{i}")
            elif p.port in (80, 443) and name_matches(p.name, domains):
                out[NAMES[p.name]].append(f"t{w}x{i}")
    return {k: sorted(v) for k, v in out.items()}


# ---- tests ----

PROBES = [
    Probe("allowed.test", 80), Probe("allowed.test", 443),  # Host, SNI: allowed
    Probe("denied.test", 80), Probe("denied.test", 443),  # another name: reset
    Probe("a.wild.test", 443), Probe("deep.sub.wild.test", 80),  # under the wildcard, any depth
    Probe("wild.test", 80), Probe("wild.test", 443),  # the wildcard's apex is not under it
    Probe("allowed.test", 80, ip=B), Probe("allowed.test", 443, ip=B),  # a lying Host/SNI: to the name's own server
    Probe("allowed.test", PORT),  # another port: CIDR rules only
]


def test_domain_rules_hold_in_source_and_clones(web: dict[str, FakeHost]) -> None:
    with Workspace.create(network="bridge", egress=POLICY) as src:
        src.files.write("/etc/resolv.conf", f"nameserver {DNS}\n")
        kids = forked(src.fork(2, "copy"))
        try:
            family = [src, *kids]
            assert sorted(ws for ws in proxies.running().values()) == sorted(w.id for w in family)
            arrived = probe(family, web, PROBES)
            assert arrived == expected(POLICY, PROBES, len(family))
            assert arrived[B] == [f"t{w}x5" for w in range(3)]  # only the wildcard's own name reached B
        finally:
            for k in kids:
                k.destroy()
        assert [ws for ws in proxies.running().values() if ws != src.id] == []


def test_without_deny_domains_need_no_proxy(web: dict[str, FakeHost]) -> None:
    policy = {"allow_out": ["allowed.test"], "deny_out": []}
    with Workspace.create(network="bridge", egress=policy) as ws:
        assert ws.id not in proxies.running().values()
        probes = [Probe("denied.test", 80, ip=B), Probe("allowed.test", 443, ip=A)]
        assert probe([ws], web, probes) == expected(policy, probes, 1)


def test_speculations_hold_closes_allowed_names_too(web: dict[str, FakeHost]) -> None:
    probes = [Probe("allowed.test", 443, ip=A)]
    with Workspace.create(network="bridge", egress=POLICY) as ws:
        assert ws.egress_refused() == 0
        assert ws.hold_egress()  # the public hold (Workspace), which bunshinrl's speculation uses
        try:
            assert probe([ws], web, probes) == {A: [], B: []}
            assert ws.egress_refused() >= 1
        finally:
            ws.release_egress_hold()
        assert ws.egress_refused() == 0
        ws.release_egress_hold()  # idempotent
        assert probe([ws], web, probes) == {A: ["t0x0"], B: []}
    with Workspace.create() as offline:
        assert not offline.hold_egress()  # no link: nothing to hold
    with pytest.raises(WorkspaceStateError):
        offline.hold_egress()


def test_a_failed_forks_proxies_go(web: dict[str, FakeHost], monkeypatch: pytest.MonkeyPatch) -> None:
    from bunshinfork.process import restore

    def fail(_session: object) -> None:
        raise RuntimeError("injected restore failure")

    with Workspace.create(network="bridge", egress=POLICY) as src:
        monkeypatch.setattr(restore, "RESTORE_HOOK", fail)
        assert all(isinstance(r, Exception) for r in src.fork(2, "copy"))
        assert list(proxies.running().values()) == [src.id]


def test_a_dead_creators_proxy_is_gcd() -> None:
    ws_id = "ws-00000000dead"
    proxies.start(ws_id, ("allowed.test",), "10.213.0.1")
    assert ws_id in proxies.running().values()
    removed = network_gc()
    assert any(f"ws={ws_id}" in r for r in removed), removed
    assert ws_id not in proxies.running().values()


DOMAINS = ["allowed.test", "*.wild.test", "denied.test", "*.test"]
CIDRS = ["198.51.100.2/32", "198.51.100.6/32", "198.51.100.0/24", "0.0.0.0/0"]
RANDOM_PROBES = [
    Probe("allowed.test", 80, ip=A), Probe("allowed.test", 443, ip=A), Probe("denied.test", 443, ip=B),
    Probe("deep.sub.wild.test", 80, ip=B), Probe("wild.test", 443, ip=A), Probe("allowed.test", 80, ip=B),
    Probe("denied.test", 443, ip=A), Probe("allowed.test", PORT, ip=B),
]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(allow=st.lists(st.sampled_from(CIDRS + DOMAINS), max_size=3, unique=True),
       deny=st.lists(st.sampled_from(CIDRS), max_size=2, unique=True),
       depth=st.integers(min_value=0, max_value=2))
def test_nothing_denied_ever_arrives(web: dict[str, FakeHost], allow: list[str], deny: list[str], depth: int) -> None:
    policy = {"allow_out": allow, "deny_out": deny}
    with Workspace.create(network="bridge", nat=depth == 1, egress=policy) as src, fork_chain(src, depth) as family:
        assert probe(family, web, RANDOM_PROBES) == expected(policy, RANDOM_PROBES, len(family)), policy


def test_proxy_file_is_standalone() -> None:
    """The proxy runs as `python -I sniproxy.py`: nothing of the package may be imported there."""
    from bunshinfork.network import sniproxy
    text = Path(sniproxy.__file__).read_text()
    assert "from ." not in text and "import bunshinfork" not in text and "from bunshinfork" not in text


def test_e2b_sandbox_rules_with_domains(web: dict[str, FakeHost]) -> None:
    """E2B's own shape through the in-process Sandbox: domains and CIDRs at create, held in a
    fork, and replaced by update_network (the name it lists is the only one let through)."""
    from bunshinfork import Sandbox

    rules = {"deny_out": ["0.0.0.0/0"], "allow_out": [f"{DNS}/32", "allowed.test", "*.wild.test"]}
    sbx = Sandbox.create(network=rules)
    try:
        sbx.files.write("/etc/resolv.conf", f"nameserver {DNS}\n", user="root")
        (kid,) = sbx.fork(count=1)
        assert isinstance(kid, Sandbox), kid
        try:
            family = [sbx.workspace, kid.workspace]
            assert probe(family, web, PROBES) == expected(rules, PROBES, 2)
            update = {"deny_out": ["0.0.0.0/0"], "allow_out": [f"{DNS}/32", "denied.test"]}
            sbx.update_network(update)
            probes = [Probe("denied.test", 80), Probe("allowed.test", 443)]
            assert probe([sbx.workspace], web, probes) == expected(update, probes, 1)
        finally:
            kid.kill()
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in proxies.running().values()
