"""What one client of `bunshin serve`, or the code in one of its sandboxes, can take from the
others (issue 36 #9, #14): each drives the real server (a child process on loopback) with the
real `e2b` SDK, httpx or raw sockets.

- sandboxes of one server reach each other by no path (port isolation), and get CPU, memory,
  pids and disk limits (a template's own where the operator set them), reported as
  cpuCount/memoryMB/diskSizeMB;
- they run in a user namespace: root inside, sudo's included, is an unprivileged host id;
  `base` is a Debian rootfs with E2B's base tools (sudo for `user`, python3, git, curl);
- running sandboxes are capped per server (429, the SDK's RateLimitException);
- bodies: a control-plane body past 1 MiB, an upload past --max-upload-bytes are refused with
  413, the port proxy streams a body through instead of holding it;
- a connection that does not send a request head in time is closed, and others are answered
  meanwhile; one idle between requests is kept for the keep-alive, not closed at the head deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2b
import e2b_server_support as support
import httpx
import pytest

from bunshinfork import Workspace
from bunshinfork.cli import serve as cli_serve
from bunshinfork.serve.limits import Limits

pytestmark = pytest.mark.timeout(240)

MAX_SANDBOXES = 3
UPLOAD_CAP = 1 << 20
HEADER_TIMEOUT = 1.0
KEEP_ALIVE = 3.0
COUNT_SERVER = r"""
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        left, n = int(self.headers.get("Content-Length") or 0), 0
        while left:
            got = self.rfile.read(min(left, 1 << 20))
            if not got:
                break
            left -= len(got)
            n += len(got)
        body = str(n).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.Served]:
    extra = ("--max-sandboxes", str(MAX_SANDBOXES), "--max-upload-bytes", str(UPLOAD_CAP),
             "--header-timeout", str(HEADER_TIMEOUT), "--timeout-keep-alive", str(KEEP_ALIVE), "--block-private",
             "--template-limits", "debian", "cpu=1,memory-mb=256,disk-mb=1024,pids=512")
    with support.serving(tmp_path_factory.mktemp("serve"), extra) as s:
        yield s


@pytest.fixture(scope="module")
def pair(served: support.Served) -> Iterator[tuple[e2b.Sandbox, e2b.Sandbox]]:
    """A sandbox serving port 8000 (it counts the bytes of a POST), and its neighbour."""
    made: list[e2b.Sandbox] = []
    try:
        server = e2b.Sandbox.create(timeout=300)
        made.append(server)
        neighbour = e2b.Sandbox.create(timeout=300)
        made.append(neighbour)
        server.files.write("/tmp/count.py", COUNT_SERVER)
        server.commands.run("python3 /tmp/count.py", background=True)
        server.commands.run("for i in $(seq 200); do python3 -c 'import socket; socket.create_connection("
                            "(\"127.0.0.1\", 8000), 1)' 2>/dev/null && exit 0; sleep 0.05; done; exit 1")
        yield server, neighbour
    finally:
        for s in made:
            with contextlib.suppress(Exception):
                s.kill()


def _api(served: support.Served, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, served.url + path, headers={"X-API-KEY": served.key, **kw.pop("headers", {})},
                         timeout=60, **kw)


def _addr(served: support.Served) -> tuple[str, int]:
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_sandboxes_of_one_server_do_not_reach_each_other(pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    server, neighbour = pair
    ip = str(Workspace.connect(server.sandbox_id).info().network["ip"]).split("/")[0]
    probe = (f"python3 -c 'import socket; socket.create_connection((\"{ip}\", 8000), 3); print(\"reached\")' "
             "2>&1 || true")
    assert "reached" in server.commands.run(probe.replace(ip, "127.0.0.1")).stdout  # the port is served
    assert "reached" not in neighbour.commands.run(probe, timeout=30).stdout
    for sbx in pair:  # what the server asked for is what the workspace has
        spec = Workspace.connect(sbx.sandbox_id)._rec.spec
        assert spec.port_isolation and spec.block_private


def test_sandboxes_get_limits_reported_in_their_info(served: support.Served,
                                                     pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    info = Workspace.connect(pair[0].sandbox_id).info()
    assert (info.memory_limit, info.pids_limit, info.cpu_limit, info.disk_limit) == (
        512 << 20, 1024, 2.0, 10240 << 20)
    got = _api(served, "GET", f"/sandboxes/{pair[0].sandbox_id}").json()
    assert (got["memoryMB"], got["cpuCount"], got["diskSizeMB"]) == (512, min(2, os.cpu_count() or 1), 10240)
    assert pair[0].get_info().memory_mb == 512
    # The operator's --template-limits for debian: held and reported.
    sbx = e2b.Sandbox.create("debian", timeout=120)
    try:
        info = Workspace.connect(sbx.sandbox_id).info()
        assert (info.memory_limit, info.pids_limit, info.cpu_limit, info.disk_limit) == (
            256 << 20, 512, 1.0, 1024 << 20)
        got = _api(served, "GET", f"/sandboxes/{sbx.sandbox_id}").json()
        assert (got["memoryMB"], got["cpuCount"], got["diskSizeMB"]) == (256, 1, 1024)
        # A busy loop gets at most one core's worth, whatever the host has free.
        used = sbx.commands.run("python3 -c 'import os, time\nt = time.time()\nwhile time.time() - t < 2: pass\n"
                                "c = os.times(); print(c.user + c.system)' & python3 -c 'import os, time\n"
                                "t = time.time()\nwhile time.time() - t < 2: pass\nc = os.times(); "
                                "print(c.user + c.system)'; wait", timeout=60).stdout.split()
        assert sum(float(x) for x in used) < 1.0 * 2 * 1.5 + 0.2, used
        stat = Path(Workspace.connect(sbx.sandbox_id)._cgroup().paths.get("cpu", ""), "cpu.stat")
        if stat.parent.name:  # the v1 cpu hierarchy (this host); cgroup v2 keeps it in unified/
            assert "nr_throttled 0\n" not in stat.read_text()
    finally:
        sbx.kill()


def test_sandboxes_run_in_a_user_namespace_with_e2b_base_tools(pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    """serve's base: sudo for `user` (E2B's base image), python3, git and curl, all the rootfs's
    own; root inside, sudo's too, is host uid 100000 and up, not the host's root."""
    sbx = pair[1]
    out = sbx.commands.run("sudo -n id -u; git --version; curl --version | head -1; python3 -V; ps -p 1 -o pid=",
                           timeout=60).stdout.split("\n")
    assert out[0] == "0" and out[1].startswith("git version") and out[2].startswith("curl ")
    assert out[3].startswith("Python 3") and out[4].strip() == "1"
    _in_the_user_namespace(sbx)
    # A clone and a resumed sandbox keep the map (CRIU restores the namespace), sudo's root too.
    [fork] = sbx.fork()
    try:
        _in_the_user_namespace(fork)
    finally:
        fork.kill()
    paused = e2b.Sandbox.create(timeout=120)
    try:
        paused.pause()
        resumed = e2b.Sandbox.connect(paused.sandbox_id, timeout=120)
        _in_the_user_namespace(resumed)
    finally:
        paused.kill()


def _in_the_user_namespace(sbx: e2b.Sandbox) -> None:
    out = sbx.commands.run("cat /proc/self/uid_map; sudo -n sleep 30 & sleep 0.5; sudo -n id -u",
                           timeout=60).stdout.split("\n")
    assert out[0].split()[:2] == ["0", "100000"] and out[1] == "0", out
    ws = Workspace.connect(sbx.sandbox_id)
    assert ws.record.spec.userns
    host_uids = {int(Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[1]) for p in ws.host_pids()}
    assert host_uids and min(host_uids) >= 100000, host_uids  # the sudo'd sleep among them


def test_cli_defaults_are_the_limits_defaults() -> None:
    want, d = Limits(), cli_serve.DEFAULTS
    assert (d.max_sandboxes, d.memory_mb, d.pids, d.max_upload_bytes, d.header_timeout) == (
        want.max_sandboxes, want.memory_mb, want.pids, want.max_upload_bytes, want.header_timeout)


def test_running_sandboxes_are_capped(served: support.Served, pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    running = len(_api(served, "GET", "/sandboxes").json())
    extra = [e2b.Sandbox.create(timeout=120) for _ in range(MAX_SANDBOXES - running)]
    try:
        with pytest.raises(e2b.RateLimitException):
            extra.append(e2b.Sandbox.create(timeout=120))
        r = _api(served, "POST", "/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 429 and r.json()["code"] == 429, r.text
        r = _api(served, "POST", f"/sandboxes/{pair[0].sandbox_id}/fork", json={"count": 1})
        assert r.status_code == 429 and r.json()["code"] == 429, r.text
    finally:
        for s in extra:
            s.kill()
    fresh = e2b.Sandbox.create(timeout=60)  # room again once they are gone
    fresh.kill()


def test_traffic_resumes_within_the_cap(served: support.Served) -> None:
    """Auto-resume (traffic to a paused sandbox wakes it) counts against the cap too."""
    r = _api(served, "POST", "/v2/sandboxes", json={"templateID": "base", "timeout": 120, "autoPause": True,
                                                    "autoResume": {"enabled": True}})
    assert r.status_code == 201, r.text
    paused, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    extra: list[e2b.Sandbox] = []
    try:
        assert _api(served, "POST", f"/sandboxes/{paused}/pause").status_code == 204
        running = len(_api(served, "GET", "/v2/sandboxes?state=running").json())
        extra = [e2b.Sandbox.create(timeout=120) for _ in range(MAX_SANDBOXES - running)]
        # With its envd token: a request the sandbox would take (one without wakes nothing).
        r = httpx.get(served.url + "/health", headers={"Host": f"49983-{paused}.localhost",
                                                       "X-Access-Token": token}, timeout=30)
        assert r.status_code == 429 and r.json()["code"] == 429, r.text
        assert _api(served, "GET", f"/sandboxes/{paused}").json()["state"] == "paused"
    finally:
        for s in extra:
            s.kill()
        _api(served, "DELETE", f"/sandboxes/{paused}")


def test_control_plane_bodies_are_capped(served: support.Served) -> None:
    big = b"{" + b" " * (2 << 20) + b"}"
    r = _api(served, "POST", "/v2/sandboxes", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["code"] == 413, r.text
    # Without a Content-Length (chunked), counted as it arrives.
    r = _api(served, "POST", "/v2/sandboxes", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]))
    assert r.status_code == 413 and r.json()["code"] == 413, r.text
    # Without the key, refused before a byte of it is read (by its length, or for the key).
    r = httpx.post(served.url + "/v2/sandboxes", content=big, timeout=60)
    assert r.status_code in (401, 413)
    r = httpx.post(served.url + "/v2/sandboxes", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                   timeout=60)
    assert r.status_code == 401


def test_uploads_are_capped(pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    sbx = pair[1]
    sbx.files.write("/tmp/small", b"x" * (UPLOAD_CAP // 2))
    with pytest.raises(Exception, match="larger than") as err:
        sbx.files.write("/tmp/large", b"x" * (UPLOAD_CAP * 2))
    assert "413" in repr(err.value) or "larger than" in str(err.value)
    assert not sbx.files.exists("/tmp/large")


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_proxy_streams_bodies(served: support.Served, pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    size = 256 << 20
    chunk = b"x" * (1 << 20)
    before = _peak_rss(served.proc.pid)
    host = pair[0].get_host(8000)
    r = httpx.post(served.url + "/", headers={"Host": host, "Content-Length": str(size)},
                   content=iter([chunk] * (size // len(chunk))), timeout=120)
    assert r.status_code == 200 and r.text == str(size), r.text
    # No key, no such sandbox: answered without reading the body.
    r = httpx.post(served.url + "/", headers={"Host": "8000-nosuchsandbox.localhost", "Content-Length": str(size)},
                   content=iter([chunk] * (size // len(chunk))), timeout=120)
    assert r.status_code == 502
    grown = _peak_rss(served.proc.pid) - before
    assert grown < 64 << 20, f"the server's peak RSS grew by {grown >> 20} MiB for a {size >> 20} MiB body"


def test_slow_request_heads_are_closed(served: support.Served) -> None:
    conns = []
    try:
        for i in range(100):
            s = socket.create_connection(_addr(served), 5)
            if i % 2:  # half send part of a head, half nothing at all
                s.sendall(b"GET /sandboxes HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
            conns.append(s)
        t0 = time.monotonic()
        assert _api(served, "GET", "/sandboxes").status_code == 200  # the others are answered
        for s in conns:  # closed by the server (before: held open for ever)
            s.settimeout(max(0.1, t0 + HEADER_TIMEOUT + 10 - time.monotonic()))
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(4096) == b""
    finally:
        for s in conns:
            s.close()


def test_idle_connections_are_kept_for_the_keep_alive(served: support.Served) -> None:
    """Idle between requests, a connection is the keep-alive's: not closed at the head deadline
    (timed from the response, it closed a connection idle past it, which a client reusing it
    just then met as "connection closed before message completed"); a head begun after idling
    gets the head deadline from its first byte."""
    conn = http.client.HTTPConnection(*_addr(served), timeout=KEEP_ALIVE + 10)

    def get() -> int:
        conn.request("GET", "/sandboxes", headers={"X-API-KEY": served.key})
        r = conn.getresponse()
        r.read()
        return r.status

    try:
        assert get() == 200
        sock = conn.sock
        time.sleep(2 * HEADER_TIMEOUT)  # idle past the head deadline, within the keep-alive
        assert get() == 200 and conn.sock is sock, "the idle connection was not kept"
        time.sleep(2 * HEADER_TIMEOUT)
        t0 = time.monotonic()
        sock.sendall(b"GET /sandboxes HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(4096) == b""
        took = time.monotonic() - t0
        assert HEADER_TIMEOUT <= took < KEEP_ALIVE, f"a stalled head closed after {took:.2f} s"
    finally:
        conn.close()
    conn = http.client.HTTPConnection(*_addr(served), timeout=KEEP_ALIVE + 10)
    try:
        assert get() == 200
        t0 = time.monotonic()
        assert conn.sock.recv(4096) == b""  # closed by the server, idle
        took = time.monotonic() - t0
        assert KEEP_ALIVE - 0.5 <= took < KEEP_ALIVE + 5, f"an idle connection closed after {took:.2f} s"
    finally:
        conn.close()


def test_watchers_are_capped(pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    from bunshinfork.serve.envd import MAX_WATCHERS_PER_SANDBOX

    sbx = pair[1]
    handles = []
    try:
        for _ in range(MAX_WATCHERS_PER_SANDBOX):
            handles.append(sbx.files.watch_dir("/tmp"))
        with pytest.raises(Exception, match="too many watchers"):
            handles.append(sbx.files.watch_dir("/tmp"))
    finally:
        for h in handles:
            h.stop()
    sbx.files.watch_dir("/tmp").stop()  # given back


def test_forwarded_ports_of_a_fork_are_capped(served: support.Served, pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    from bunshinfork.serve.ports import MAX_FORWARDED_PORTS

    (fork,) = pair[0].fork(count=1)
    assert not isinstance(fork, Exception), fork
    try:
        codes = [httpx.get(served.url + "/", headers={"Host": fork.get_host(9000 + i)}, timeout=30).status_code
                 for i in range(MAX_FORWARDED_PORTS + 1)]
        assert codes[:MAX_FORWARDED_PORTS] == [502] * MAX_FORWARDED_PORTS and codes[-1] == 429, codes
        # A port it forwards already is still served.
        assert httpx.get(served.url + "/", headers={"Host": fork.get_host(9000)}, timeout=30).status_code == 502
    finally:
        fork.kill()


def _read_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def test_output_is_read_once(served: support.Served, pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    """A command writing 32 MiB over about 2 s: the server reads it about once (it re-read the
    whole output file at every poll: 400 MB of output cost it 20 s of CPU and 1.3 GiB)."""
    size = 32 << 20
    before = _read_bytes(served.proc.pid)
    flood = ("python3 -c 'import sys, time\nfor _ in range(64):\n    sys.stdout.write(\"x\" * (1 << 19)); "
             "sys.stdout.flush(); time.sleep(0.03)'")
    got = 0

    def seen(text: str) -> None:
        nonlocal got
        got += len(text)

    pair[1].commands.run(flood, on_stdout=seen, timeout=60)
    assert got == size
    read = _read_bytes(served.proc.pid) - before
    assert read < 3 * size, f"the server read {read >> 20} MiB for {size >> 20} MiB of output"


def test_output_is_not_held_by_the_server(served: support.Served, pair: tuple[e2b.Sandbox, e2b.Sandbox]) -> None:
    """96 MiB of output passes through the server in bounded buffers (it kept all of a
    command's output for the command's result, which envd never sends)."""
    size = 96 << 20
    before = _peak_rss(served.proc.pid)
    got = 0

    def seen(text: str) -> None:
        nonlocal got
        got += len(text)

    pair[1].commands.run(f"head -c {size} /dev/zero | tr '\\0' x", on_stdout=seen, timeout=120)
    assert got == size
    grown = _peak_rss(served.proc.pid) - before
    assert grown < 48 << 20, f"the server's peak RSS grew by {grown >> 20} MiB for {size >> 20} MiB of output"
