"""Attacks on `bunshin serve` by its clients (issue 36): with a key, without one, and with a
sandbox's own tokens. Each drives the real server (a child process on loopback) with the real
`e2b` SDK, httpx or raw sockets, and each attack runs from a created sandbox, a fork and a
resumed (paused, then connected) one. Listeners the test starts on 127.0.0.1 stand for the
host's loopback-only services: they must see zero connections.

- authority: a sandbox's token acts on that sandbox only, whatever Host and E2b-Sandbox-Id say;
- the port proxy: only origin-form request-targets, upstream URLs built from parts, E2B's own
  headers (tokens, the API key) never reach the sandbox;
- snapshots and templates: an allowlist, scoped to the server, with generic errors;
- signed upload URLs write the signed path only; the server's secrets on disk are private.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2b
import e2b_server_support as support
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshinfork.errors import InvalidArgumentException
from bunshinfork.images import templates as store
from bunshinfork.serve.allow import TemplatePolicy

pytestmark = pytest.mark.timeout(300)

KINDS = ["created", "fork", "resumed"]
E2B_HEADERS = {"e2b-traffic-access-token", "x-api-key", "x-access-token", "e2b-sandbox-id"}
ECHO = r"""
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(sorted(k.lower() for k in self.headers.keys())).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""
# One WebSocket message echoed with the path it came to (a server with nothing but the socket
# module, as the sandbox's python has no WebSocket library).
WS_ECHO = r"""
import base64, hashlib, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8001))
s.listen()
while True:
    c, _ = s.accept()
    req = b""
    while b"\r\n\r\n" not in req and (chunk := c.recv(4096)):
        req += chunk
    if b"\r\n\r\n" not in req:  # a readiness probe
        c.close()
        continue
    lines = req.split(b"\r\n")
    key = [v.split(b":", 1)[1].strip() for v in lines if v.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    head = c.recv(2)
    mask = c.recv(4)
    data = bytes(b ^ mask[i % 4] for i, b in enumerate(c.recv(head[1] & 0x7F)))
    reply = lines[0].split(b" ")[1] + b" " + data
    c.sendall(bytes([0x81, len(reply)]) + reply)
    c.close()
"""


class Listener:
    """A TCP listener on the host's 127.0.0.1 that counts the connections it accepts: a
    loopback-only host service that no client of the server may reach through it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.05)
            if ready:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    li = Listener()
    try:
        yield li
    finally:
        li.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.Served]:
    with support.serving(tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="module")
def sandboxes(served: support.Served) -> Iterator[dict[str, e2b.Sandbox]]:
    """The attackers (a created sandbox, its fork, a resumed one) and their victim, closed to
    public traffic and serving its request headers back on port 8000."""
    made: list[e2b.Sandbox] = []
    try:
        created = e2b.Sandbox.create(timeout=600)
        made.append(created)
        (fork,) = created.fork(count=1)
        assert not isinstance(fork, Exception), fork
        made.append(fork)
        paused = e2b.Sandbox.create(timeout=600)
        made.append(paused)
        assert paused.pause()
        resumed = e2b.Sandbox.connect(paused.sandbox_id, timeout=600)
        victim = e2b.Sandbox.create(timeout=600, network={"allow_public_traffic": False})
        made.append(victim)
        victim.files.write("/tmp/echo.py", ECHO)
        victim.commands.run("python3 /tmp/echo.py", background=True)
        victim.files.write("/tmp/ws.py", WS_ECHO)
        victim.commands.run("python3 /tmp/ws.py", background=True)
        victim.commands.run("for p in 8000 8001; do for i in $(seq 200); do python3 -c 'import socket, sys; "
                            "socket.create_connection((\"127.0.0.1\", int(sys.argv[1])), 1)' $p 2>/dev/null "
                            "&& continue 2; sleep 0.05; done; exit 1; done")
        yield {"created": created, "fork": fork, "resumed": resumed, "victim": victim}
    finally:
        for s in made:
            with contextlib.suppress(Exception):
                s.kill()


def _token(sbx: e2b.Sandbox) -> str:
    token = sbx._envd_access_token  # the SDK keeps it there
    assert token
    return token


def _api(served: support.Served, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, served.url + path, headers={"X-API-KEY": served.key, **kw.pop("headers", {})},
                         timeout=60, **kw)


def _raw(served: support.Served, head: str, body: bytes = b"", timeout: float = 15) -> tuple[int, bytes]:
    """Send `head` (request line and headers, CRLF-joined, without the blank line) as is,
    so that targets and repeated headers reach the server unnormalised; (status, body)."""
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout) as s:
        s.settimeout(timeout)
        extra = f"\r\nContent-Length: {len(body)}" if body else ""
        s.sendall(f"{head}{extra}\r\nConnection: close\r\n\r\n".encode("latin-1") + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    if not data.startswith(b"HTTP/1.1 "):
        return 0, data
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


def _make_dir(served: support.Served, path: str, token: str, headers: list[tuple[str, str]]) -> httpx.Response:
    """envd's Filesystem.MakeDir as a Connect JSON call, with the headers given as they are."""
    return httpx.post(served.url + "/filesystem.Filesystem/MakeDir", content=json.dumps({"path": path}),
                      headers=[("Content-Type", "application/json"), ("Connect-Protocol-Version", "1"),
                               ("X-Access-Token", token), *headers], timeout=30)


# ---- #3: a sandbox's token acts on that sandbox only ----


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_acts_on_its_own_sandbox_only(served: support.Served, sandboxes: dict[str, e2b.Sandbox],
                                              kind: str) -> None:
    attacker, victim = sandboxes[kind], sandboxes["victim"]
    a, b = attacker.sandbox_id, victim.sandbox_id
    tried = {
        # the token checked against Host's sandbox, the handler acting on the header's
        "host-vs-header": [("Host", f"49983-{a}.localhost"), ("E2b-Sandbox-Id", b)],
        # two headers: auth read the last, the handler the first
        "two-headers": [("E2b-Sandbox-Id", b), ("E2b-Sandbox-Id", a)],
        "two-headers-same": [("E2b-Sandbox-Id", a), ("E2b-Sandbox-Id", a)],
    }
    for name, headers in tried.items():
        path = f"/tmp/pwned-{kind}-{name}"
        r = _make_dir(served, path, _token(attacker), headers)
        assert not victim.files.exists(path), f"{name}: {a}'s token acted on {b}"
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (name, r.status_code, r.text)
    # What the attacker is entitled to still works: its own sandbox, by header or by Host.
    for name, headers in {"header": [("E2b-Sandbox-Id", a)],
                          "host": [("Host", f"49983-{a}.localhost")],
                          "both": [("Host", f"49983-{a}.localhost"), ("E2b-Sandbox-Id", a)]}.items():
        r = _make_dir(served, f"/tmp/mine-{kind}-{name}", _token(attacker), headers)
        assert r.status_code == 200, (name, r.text)
        assert attacker.files.exists(f"/tmp/mine-{kind}-{name}")


def test_plain_http_envd_routes_refuse_a_second_id(served: support.Served,
                                                   sandboxes: dict[str, e2b.Sandbox]) -> None:
    a, b = sandboxes["created"], sandboxes["victim"]
    r = httpx.get(served.url + "/files", params={"path": "/tmp/echo.py"}, timeout=30,
                  headers=[("X-Access-Token", _token(a)), ("E2b-Sandbox-Id", b.sandbox_id),
                           ("E2b-Sandbox-Id", a.sandbox_id)])
    assert r.status_code == 400 and "echo" not in r.text
    gone = httpx.get(served.url + "/health", headers={"E2b-Sandbox-Id": "inope", "X-Access-Token": "x"}, timeout=30)
    assert gone.status_code == 502  # unknown ids keep E2B's answer: the SDK's is_running() reads it


# ---- #2 and #13: the port proxy ----


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["@127.0.0.1:{P}/", "http://127.0.0.1:{P}/", "127.0.0.1:{P}", "*",
                                    "\\@127.0.0.1:{P}/", "/x\\@127.0.0.1:{P}/"])
def test_proxy_targets_stay_in_the_sandbox(served: support.Served, sandboxes: dict[str, e2b.Sandbox],
                                           listener: Listener, kind: str, target: str) -> None:
    host, before = sandboxes[kind].get_host(8000), listener.accepted
    t = target.replace("{P}", str(listener.port))
    status, _ = _raw(served, f"GET {t} HTTP/1.1\r\nHost: {host}")
    ws, _ = _raw(served, f"GET {t} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13")
    assert listener.accepted == before, f"{t!r} through {kind}'s port reached the host's loopback"
    assert status == 400, status
    assert ws in (400, 403), ws


@pytest.mark.parametrize("kind", KINDS)
def test_proxy_reaches_each_sandboxs_own_port(served: support.Served, sandboxes: dict[str, e2b.Sandbox],
                                              kind: str) -> None:
    """What the proxy is for still works from parts: each sandbox's own port (a fork's through
    the server's forwarder into its namespace), with the path and query as sent."""
    sbx = sandboxes[kind]
    sbx.files.write(f"/tmp/www-{kind}/a@b/index.html", f"hello from {sbx.sandbox_id}")
    server = sbx.commands.run(f"python3 -m http.server 8002 -d /tmp/www-{kind}", background=True)
    try:
        sbx.commands.run("for i in $(seq 200); do python3 -c 'import socket; socket.create_connection("
                         "(\"127.0.0.1\", 8002), 1)' 2>/dev/null && exit 0; sleep 0.05; done; exit 1")
        r = httpx.get(served.url + "/a%40b/index.html?x=@y", headers={"Host": sbx.get_host(8002)}, timeout=30)
        assert r.status_code == 200 and r.text == f"hello from {sbx.sandbox_id}", r.text
    finally:
        server.kill()


def test_proxy_strips_e2bs_headers(served: support.Served, sandboxes: dict[str, e2b.Sandbox]) -> None:
    victim = sandboxes["victim"]
    token = victim.traffic_access_token
    assert token
    r = httpx.get(served.url + "/", timeout=30, headers={
        "Host": victim.get_host(8000), "e2b-traffic-access-token": token, "X-API-KEY": served.key,
        "X-Access-Token": _token(victim), "E2b-Sandbox-Id": victim.sandbox_id, "X-Kept": "1"})
    assert r.status_code == 200, r.text
    seen = set(r.json())
    assert "x-kept" in seen and not seen & E2B_HEADERS, seen


def test_proxy_relays_websockets(served: support.Served, sandboxes: dict[str, e2b.Sandbox]) -> None:
    """A WebSocket through the proxy still reaches the sandbox's port, its path as sent, with the
    traffic token; without the token it is refused before it reaches the sandbox."""
    victim = sandboxes["victim"]
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    for token, want in ((victim.traffic_access_token, b"/chat?x=%40y hello"), (None, None)):
        with socket.create_connection((host, int(port)), 15) as s:
            s.settimeout(15)
            auth = f"e2b-traffic-access-token: {token}\r\n" if token else ""
            s.sendall(f"GET /chat?x=%40y HTTP/1.1\r\nHost: {victim.get_host(8001)}\r\nUpgrade: websocket\r\n"
                      "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                      f"Sec-WebSocket-Version: 13\r\n{auth}\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(1)
            if want is None:
                assert head.startswith(b"HTTP/1.1 403"), head
                continue
            assert head.startswith(b"HTTP/1.1 101"), head
            mask, data = os.urandom(4), b"hello"
            s.sendall(bytes([0x81, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))
            frame = s.recv(2)
            assert frame[0] == 0x81
            got = b""
            while len(got) < frame[1]:
                got += s.recv(frame[1] - len(got))
            assert got == want


# ---- the Hypothesis test: random targets, Host names and repeated headers ----

_TARGETS = ["@127.0.0.1:{P}/", "http://127.0.0.1:{P}/", "127.0.0.1:{P}", "*", "\\\\127.0.0.1:{P}\\x",
            "/%40127.0.0.1:{P}/", "//127.0.0.1:{P}/", "[::1]:{P}", "[fe80::1%25lo]:{P}", "@[::1%lo]:{P}/",
            "http://[::ffff:127.0.0.1]:{P}/", "/a@127.0.0.1:{P}", "@localhost:{P}/x", "ws://127.0.0.1:{P}/",
            "/filesystem.Filesystem/MakeDir", "http://49983-{B}.localhost/filesystem.Filesystem/MakeDir",
            "/filesystem.Filesystem/MakeDir?x=@127.0.0.1:{P}", "/files?path=/tmp/x&path=/etc/y"]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(target=st.one_of(st.sampled_from(_TARGETS),
                        st.text(st.sampled_from("/@\\%:.?#[]*abclo019-"), min_size=1, max_size=24)),
       host=st.sampled_from(["8000-{A}.localhost", "49983-{A}.localhost", "8000-{B}.localhost",
                             "49983-{B}.localhost", "localhost", "8000-{A}.localhost:1", "127.0.0.1:{P}",
                             "8000-{A}.localhost@127.0.0.1:{P}", "49983-{A}.localhost.", "[::1]"]),
       ids=st.lists(st.sampled_from(["{A}", "{B}", "inope"]), max_size=3),
       extra=st.lists(st.sampled_from([("Host", "49983-{B}.localhost"), ("X-Access-Token", "{TB}"),
                                       ("e2b-traffic-access-token", "{TT}"), ("Upgrade", "websocket")]),
                      max_size=2),
       method=st.sampled_from(["GET", "POST"]))
def test_fuzzed_targets_hosts_and_headers(served: support.Served, sandboxes: dict[str, e2b.Sandbox],
                                          listener: Listener, target: str, host: str, ids: list[str],
                                          extra: list[tuple[str, str]], method: str) -> None:
    """Whatever the target, Host and repeated headers, with the created sandbox's token: the
    host's listener sees nothing, and nothing happens in the victim."""
    attacker, victim = sandboxes["created"], sandboxes["victim"]
    names = {"{A}": attacker.sandbox_id, "{B}": victim.sandbox_id, "{P}": str(listener.port),
             "{TB}": _token(victim), "{TT}": victim.traffic_access_token or ""}

    def fill(text: str) -> str:
        for k, v in names.items():
            text = text.replace(k, v)
        return text

    mark = f"/tmp/hyp-{uuid.uuid4().hex[:8]}"
    headers = [("Host", fill(host)), ("X-Access-Token", _token(attacker))]
    headers += [("E2b-Sandbox-Id", fill(i)) for i in ids] + [(k, fill(v)) for k, v in extra]
    head = f"{method} {fill(target)} HTTP/1.1\r\n" + "\r\n".join(f"{k}: {v}" for k, v in headers)
    if method == "POST":
        head += "\r\nContent-Type: application/json\r\nConnect-Protocol-Version: 1"
    status, body = _raw(served, head, json.dumps({"path": mark}).encode() if method == "POST" else b"")
    assert listener.accepted == 0, head
    assert status != 500, (head, body)
    assert not victim.files.exists(mark), head


# ---- #15: snapshots are the server's, and cannot shadow a template ----


@pytest.fixture
def foreign(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A warm template and a saved snapshot this server did not make, in the host's store."""
    made = {}
    store.ROOT.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:10]
    for kind in ("template", "snapshot"):
        d = store.ROOT / f"foreign-{kind}-{tag}"
        d.mkdir()
        (d / store.SAVED).write_text(json.dumps({"source": "elsewhere"}))
        (d / store.NAMES).write_text(json.dumps([f"ops-{kind}-{tag}"]))
        if kind == "template":
            (d / store.META).write_text(json.dumps({"from": "debian", "created_at": 0.0}))
        made[kind] = d.name
        made[f"{kind}-name"] = f"ops-{kind}-{tag}"
    try:
        yield made
    finally:
        for kind in ("template", "snapshot"):
            shutil.rmtree(store.ROOT / made[kind], ignore_errors=True)


def test_snapshot_names_cannot_shadow_templates(served: support.Served, sandboxes: dict[str, e2b.Sandbox],
                                                foreign: dict[str, str]) -> None:
    sid = sandboxes["created"].sandbox_id
    for name in ("debian", "base", "host", "docker:python:3.12", "registry:ghcr.io/x/y", "oci:x",
                 foreign["template-name"], foreign["snapshot-name"], foreign["template"]):
        r = _api(served, "POST", f"/sandboxes/{sid}/snapshots", json={"name": name})
        if r.status_code == 201:  # the finding: clean up what it made
            _api(served, "DELETE", f"/templates/{r.json()['snapshotID']}")
        assert r.status_code == 400 and r.json()["code"] == 400, (name, r.text)
    assert store.names(store.ROOT / foreign["template"]) == [foreign["template-name"]]


def test_snapshots_are_scoped_to_the_server(served: support.Served, foreign: dict[str, str]) -> None:
    listed = {s["snapshotID"] for s in _api(served, "GET", "/snapshots").json()}
    assert not listed & {foreign["template"], foreign["snapshot"]}, listed
    for sid in (foreign["template"], foreign["snapshot"]):
        assert _api(served, "DELETE", f"/templates/{sid}").status_code == 404
        assert (store.ROOT / sid).is_dir()
    for name in (foreign["snapshot"], foreign["snapshot-name"]):
        r = _api(served, "POST", "/v2/sandboxes", json={"templateID": name})
        assert r.status_code == 404 and r.json()["message"] == f"template {name!r} not found", r.text


def test_a_500_carries_no_host_path(served: support.Served, sandboxes: dict[str, e2b.Sandbox]) -> None:
    """The registry's directory replaced by a file: saving a record fails with an OSError that
    names the host path; the client gets a generic 500, the log the details."""
    records = served.state_dir / "sandboxes"
    aside = served.state_dir / "sandboxes.aside"
    records.rename(aside)
    try:
        records.write_text("")
        r = _api(served, "POST", f"/sandboxes/{sandboxes['created'].sandbox_id}/timeout", json={"timeout": 600})
    finally:
        records.unlink()
        aside.rename(records)
    assert r.status_code == 500, r.text
    assert str(served.state_dir) not in r.text and "/" not in r.json()["message"], r.text


# ---- #11: a signed upload URL writes its path only ----


@pytest.mark.parametrize("kind", KINDS)
def test_signed_upload_writes_the_signed_path_only(served: support.Served, sandboxes: dict[str, e2b.Sandbox],
                                                   kind: str) -> None:
    sbx = sandboxes[kind]
    url = sbx.upload_url(f"/tmp/signed-{kind}.txt", use_signature_expiration=60)
    r = httpx.post(url, timeout=30, files=[("file", (f"/tmp/signed-{kind}.txt", b"ok")),
                                           ("file", (f"/tmp/unsigned-{kind}.txt", b"evil"))])
    assert not sbx.files.exists(f"/tmp/unsigned-{kind}.txt"), "an unsigned path was written"
    assert r.status_code == 400 and r.json()["code"] == 400, r.text
    r = httpx.post(url, timeout=30, files=[("file", ("/tmp/elsewhere.txt", b"ok"))])
    assert r.status_code == 200 and sbx.files.read(f"/tmp/signed-{kind}.txt") == "ok"
    assert not sbx.files.exists("/tmp/elsewhere.txt")


# ---- #12: secrets on disk ----


def test_secrets_on_disk_are_private(served: support.Served, sandboxes: dict[str, e2b.Sandbox]) -> None:
    root = served.state_dir
    for d in (root, root / "sandboxes", root / "paused"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    records = list((root / "sandboxes").iterdir())
    assert records
    for f in records:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    # The key came from --api-key-file: the server does not print it.
    assert served.key not in "".join(served.log)


# ---- #7: templates are an allowlist ----


def test_templates_are_an_allowlist(served: support.Served, listener: Listener, tmp_path: Path) -> None:
    (tmp_path / "marker").write_text("host file")
    made = []
    try:
        for name in (str(tmp_path), "/", "host", f"oci:{tmp_path}", f"oci:{tmp_path}/none",
                     f"registry:127.0.0.1:{listener.port}/img:latest", "registry:[::1]:1/x"):
            r = _api(served, "POST", "/v2/sandboxes", json={"templateID": name})
            if r.status_code == 201:
                made.append(r.json()["sandboxID"])
            assert r.status_code == 404 and r.json() == {"code": 404, "message": f"template {name!r} not found"}, \
                (name, r.text)
    finally:
        for sid in made:
            _api(served, "DELETE", f"/sandboxes/{sid}")
    assert listener.accepted == 0


@pytest.mark.parametrize(("flags", "allowed", "refused"), [
    ({}, ["base", "debian"], ["host", "/", "/srv/img", "oci:/srv/img", "docker:alpine", "registry:ghcr.io/a/b",
                              "registry:python:3.12"]),
    ({"images": True}, ["docker:alpine", "registry:ghcr.io/a/b:1", "registry:python:3.12", "registry:8.8.8.8/a"],
     ["/", "oci:/srv/img", "registry:127.0.0.1:5000/a", "registry:[::1]:5000/a", "registry:localhost:5000/a",
      "registry:10.0.0.1/a", "registry:169.254.169.254/a", "registry:a.localhost/a", "registry:127.1/a",
      "registry:0x7f.1/a", "docker:-v/x", "registry:ghcr.io/../a"]),
    ({"templates": ("docker:python:*", "registry:ghcr.io/acme/*", "oci:/srv/img", "/srv/root")},
     ["docker:python:3.12", "registry:ghcr.io/acme/app:1", "oci:/srv/img", "/srv/root"],
     ["docker:pythonx", "registry:ghcr.io/other/app", "oci:/srv/img2", "/srv/root/..", "/srv/rootx", "/"]),
    ({"registries": ("127.0.0.1:5000",)}, ["registry:127.0.0.1:5000/a:1"],
     ["registry:127.0.0.1:5001/a", "registry:127.0.0.1/a", "docker:127.0.0.1:5000/a"]),
])
def test_template_policy(flags: dict[str, Any], allowed: list[str], refused: list[str]) -> None:
    """What the operator's flags offer, and nothing beside it (the server answers 404 for the rest)."""
    policy = TemplatePolicy(**flags)
    assert [t for t in allowed if not policy.allows(t)] == []
    assert [t for t in refused if policy.allows(t)] == []


@pytest.mark.parametrize("flags", [{"templates": ("oci:/srv/*",)}, {"templates": ("/srv/*",)},
                                   {"templates": ("python",)}, {"registries": ("ghcr.io/acme",)},
                                   {"registries": ("myregistry",)}])
def test_template_policy_flags_are_checked(flags: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentException):
        TemplatePolicy(**flags)


def test_allow_registry_flag_offers_that_registry(tmp_path: Path, listener: Listener) -> None:
    """--allow-registry reaches the server: the registry it names is dialled (the listener,
    which is no registry, answers nothing), and the error names no host path."""
    (tmp_path / "key").write_text("test-key-" + os.urandom(8).hex())
    s = support.start(tmp_path / "state", tmp_path / "key", extra=("--allow-registry", f"127.0.0.1:{listener.port}"))
    try:
        before = listener.accepted
        r = httpx.post(s.url + "/v2/sandboxes", headers={"X-API-KEY": s.key}, timeout=120,
                       json={"templateID": f"registry:127.0.0.1:{listener.port}/img:latest"})
        assert listener.accepted > before, r.text
        assert r.status_code in (404, 500) and str(tmp_path) not in r.text and "/var/" not in r.text, r.text
    finally:
        assert s.stop() == 0, "".join(s.log)
