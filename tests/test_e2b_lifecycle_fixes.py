"""Issue 39's lifecycle and ingress fixes, through a real `bunshin serve` and E2B's own SDK (and
plain HTTP where the SDK has no call): a filesystem-only pause (pause {"memory": false},
autoPauseMemory false) keeps the files and cold-boots, and so does connect {"memory": false};
a /health probe during a deadline's pause never kills the sandbox (50 runs); a request to a
paused auto-resume sandbox's port resumes it, and one the sandbox would refuse does not;
network.maskRequestHost is the Host its ports get; POST /snapshots/{id}/fork (e2b-dev/infra
PR #3441) under the server's cap; the metrics' walk of a layer follows no link."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import e2b
import e2b_server_support as support
import httpx
import pytest

from bunshinfork.e2b import lifecycle

pytestmark = pytest.mark.timeout(600)
CAP = 4  # the server's --max-sandboxes


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.Served]:
    # The server's defaults: every sandbox in a user namespace, whose memory pause restores.
    with support.serving(tmp_path_factory.mktemp("serve"), extra=("--max-sandboxes", str(CAP))) as s:
        yield s


@pytest.fixture
def made(served: support.Served) -> Iterator[list[str]]:
    """Ids of sandboxes the test made: killed at its end, whatever happened."""
    ids: list[str] = []
    yield ids
    for i in ids:
        httpx.delete(f"{served.url}/sandboxes/{i}", headers={"X-API-Key": served.key}, timeout=60)


def _api(served: support.Served) -> httpx.Client:
    return httpx.Client(base_url=served.url, headers={"X-API-Key": served.key}, timeout=120)


def _wait(check: object, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _identity(sbx: e2b.Sandbox) -> tuple[str, str]:
    return (sbx.files.read("/proc/sys/kernel/random/boot_id").strip(), sbx.commands.run("hostname").stdout.strip())


def _processes(sbx: e2b.Sandbox) -> str:
    """The command lines running in the sandbox (its rootfs may have no ps)."""
    return sbx.commands.run("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done", user="root").stdout


# ---- 1. filesystem-only pause ----


def test_pause_without_memory_keeps_files_and_cold_boots(served: support.Served, made: list[str]) -> None:
    sbx = e2b.Sandbox.create(timeout=120)
    made.append(sbx.sandbox_id)
    sbx.files.write("/home/user/kept.txt", "kept")
    sbx.commands.run("touch /etc/gone && mkdir -p /home/user/d && echo x > /home/user/d/f && ln -s d /home/user/l",
                     user="root")
    assert sbx.pause()  # a memory pause first: the files-only one then takes a paused-and-resumed layer
    sbx.connect()
    sbx.commands.run("rm /etc/gone", user="root")  # a whiteout in the layer
    sbx.commands.run("sleep 1000", background=True)
    before = _identity(sbx)
    assert sbx.pause(keep_memory=False)
    assert not sbx.is_running()
    assert sbx.get_info().state == e2b.SandboxState.PAUSED
    resumed = sbx.connect()
    assert resumed.sandbox_id == sbx.sandbox_id and resumed.is_running()
    assert resumed.files.read("/home/user/kept.txt") == "kept"
    assert resumed.commands.run("cat /home/user/l/f; test ! -e /etc/gone && stat -c %U /home/user/kept.txt"
                                ).stdout == "x\nuser\n"
    after = _identity(resumed)
    assert after[0] != before[0] and after[1] != before[1]  # a cold boot: new boot id and hostname
    assert "sleep 1000" not in _processes(resumed)  # no process came back


def test_auto_pause_without_memory(served: support.Served, made: list[str]) -> None:
    with pytest.raises(e2b.InvalidArgumentException):  # the SDK's own check; the server's below
        e2b.Sandbox.create(lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}, "auto_resume": True})
    with _api(served) as api:
        r = api.post("/sandboxes", json={"templateID": "base", "autoPause": True, "autoPauseMemory": False,
                                         "autoResume": {"enabled": True}})
        assert r.status_code == 400 and "autoResume" in r.json()["message"]
    sbx = e2b.Sandbox.create(timeout=60, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    made.append(sbx.sandbox_id)
    sbx.files.write("/home/user/m.txt", "m")
    before = _identity(sbx)
    sbx.set_timeout(0)
    _wait(lambda: sbx.get_info().state == e2b.SandboxState.PAUSED, "the deadline did not pause it")
    resumed = sbx.connect()
    assert resumed.files.read("/home/user/m.txt") == "m"
    assert _identity(resumed)[0] != before[0]


def test_reboot_ignores_the_memory_a_pause_saved(served: support.Served, made: list[str]) -> None:
    """connect(on_resume="reboot") (memory false): a cold boot from the files of a memory pause."""
    sbx = e2b.Sandbox.create(timeout=120)
    made.append(sbx.sandbox_id)
    sbx.files.write("/home/user/r.txt", "r")
    sbx.commands.run("sleep 1000", background=True)
    before = _identity(sbx)
    assert sbx.pause()
    resumed = sbx.connect(on_resume="reboot")
    assert resumed.files.read("/home/user/r.txt") == "r"
    assert _identity(resumed)[0] != before[0]
    assert "sleep 1000" not in _processes(resumed)


# ---- 2. /health during a deadline's pause ----


def test_health_probe_during_deadline_pause_never_kills(served: support.Served, made: list[str]) -> None:
    """50 deadline pauses, each probed by /health as fast as it answers: every one ends paused
    (before the fix, the probe saw the pausing workspace not running and killed it: 6 of 6)."""
    sbx = e2b.Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"})
    made.append(sbx.sandbox_id)
    probe = httpx.Client(base_url=served.url, timeout=120,
                         headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""})
    with probe, _api(served) as api:
        for i in range(50):
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/timeout", json={"timeout": 0}).status_code == 204
            _wait(lambda: probe.get("/health").status_code == 502, f"run {i}: the deadline did not pause it")
            state = api.get(f"/sandboxes/{sbx.sandbox_id}")
            assert state.status_code == 200 and state.json()["state"] == "paused", f"run {i}: {state.text}"
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 300}).status_code == 201
    assert sbx.commands.run("echo alive").stdout == "alive\n"


# ---- 3. a port's traffic resumes an auto-resume sandbox ----


def _serve_port(sbx: e2b.Sandbox, port: int, code: str) -> None:
    sbx.files.write("/tmp/srv.py", code)
    sbx.commands.run(f"python3 /tmp/srv.py {port}", background=True)
    sbx.commands.run(f"for i in $(seq 200); do python3 -c 'import socket; socket.create_connection("
                     f"(\"127.0.0.1\", {port}), 1)' 2>/dev/null && exit 0; sleep 0.05; done; exit 1")


ECHO_HOST = """import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{self.headers.get('Host')}|{self.headers.get('X-Forwarded-Host')}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"""


def test_port_traffic_resumes_only_what_it_may_reach(served: support.Served, made: list[str]) -> None:
    sbx = e2b.Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True},
                             network={"allow_public_traffic": False})
    made.append(sbx.sandbox_id)
    _serve_port(sbx, 8000, ECHO_HOST)
    host = {"Host": sbx.get_host(8000)}
    token = {"e2b-traffic-access-token": sbx.traffic_access_token or ""}
    assert sbx.pause()
    with _api(served) as api:
        def state() -> str:
            return str(api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"])

        # Refused anyway (no traffic token, a wrong one, envd without its token): nothing resumed.
        assert httpx.get(served.url + "/", headers=host, timeout=60).status_code == 403
        assert httpx.get(served.url + "/", headers={**host, "e2b-traffic-access-token": "x"},
                         timeout=60).status_code == 403
        health = httpx.get(served.url + "/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id}, timeout=60)
        assert health.status_code == 502 and state() == "paused"
        # With its token: resumed, the process still serving (a memory resume).
        r = httpx.get(served.url + "/", headers={**host, **token}, timeout=120)
        assert r.status_code == 200 and state() == "running"
        # A public sandbox's port resumes on any request, as E2B's does.
        public = e2b.Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True})
        made.append(public.sandbox_id)
        _serve_port(public, 8001, ECHO_HOST)
        assert public.pause()
        r = httpx.get(served.url + "/", headers={"Host": public.get_host(8001)}, timeout=120)
        assert r.status_code == 200 and public.is_running()


# ---- 4. mask_request_host ----


def test_mask_request_host_is_the_host_a_port_gets(served: support.Served, made: list[str]) -> None:
    with pytest.raises(e2b.SandboxException, match="mask request host is not valid"):
        e2b.Sandbox.create(network={"mask_request_host": "evil\r\nX-Injected: 1"})
    sbx = e2b.Sandbox.create(timeout=120, network={"mask_request_host": "localhost:${PORT}"})
    made.append(sbx.sandbox_id)
    plain = e2b.Sandbox.create(timeout=120)
    made.append(plain.sandbox_id)
    for s in (sbx, plain):
        _serve_port(s, 8000, ECHO_HOST)
    host = sbx.get_host(8000)
    r = httpx.get(served.url + "/", headers={"Host": host, "X-Forwarded-Host": "spoofed"}, timeout=60)
    assert r.status_code == 200 and r.text == f"localhost:8000|{host}"
    # Unmasked, the sandbox gets the client's own Host, and no X-Forwarded-Host it sent.
    r = httpx.get(served.url + "/", headers={"Host": plain.get_host(8000), "X-Forwarded-Host": "spoofed"},
                  timeout=60)
    assert r.status_code == 200 and r.text == f"{plain.get_host(8000)}|None"


# ---- 5. POST /snapshots/{id}/fork ----


def test_snapshot_fork(served: support.Served, made: list[str]) -> None:
    src = e2b.Sandbox.create(timeout=300)
    made.append(src.sandbox_id)
    src.files.write("/home/user/ckpt.txt", "weights")
    src.commands.run("sleep 1000", background=True)
    name = f"rl-ckpt-{os.urandom(3).hex()}"
    snap = src.create_snapshot(name=name)
    src.kill()  # the checkpoint outlives its source
    with _api(served) as api:
        assert api.post(f"/snapshots/{name}/fork", json={"count": 101}).status_code == 400
        over = api.post(f"/snapshots/{name}/fork", json={"count": CAP + 1})
        assert over.status_code == 400 and str(CAP) in over.json()["message"]
        assert api.post("/snapshots/nope/fork", json={"count": 1}).status_code == 404
        other = e2b.Sandbox.create(timeout=120)  # one running: CAP more do not fit
        made.append(other.sandbox_id)
        full = api.post(f"/snapshots/{name}/fork", json={"count": CAP})
        assert full.status_code == 429 and full.json()["code"] == 429
        other.kill()
        r = api.post(f"/snapshots/{snap.snapshot_id}/fork", json={"count": 3, "timeout": 120})
        assert r.status_code == 201, r.text
        entries = r.json()
        assert len(entries) == 3 and all("sandbox" in x for x in entries), entries
        made.extend(x["sandbox"]["sandboxID"] for x in entries)
        for x in entries:
            child = e2b.Sandbox.connect(x["sandbox"]["sandboxID"])
            assert child.files.read("/home/user/ckpt.txt") == "weights"
            assert "sleep 1000" in _processes(child)  # memory and processes forked
        # Default lifetime: E2B's 15 s (SandboxTimeoutDefault).
        r = api.post(f"/snapshots/{name}/fork", json={})
        (one,) = r.json()
        made.append(one["sandbox"]["sandboxID"])
        end = api.get(f"/sandboxes/{one['sandbox']['sandboxID']}").json()["endAt"]
        started = api.get(f"/sandboxes/{one['sandbox']['sandboxID']}").json()["startedAt"]
        assert _seconds(end) - _seconds(started) == pytest.approx(15, abs=2)


def _seconds(iso: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# ---- 6. metrics follow no link ----


def test_layer_bytes_follows_no_link(tmp_path: Path) -> None:
    """What a layer takes counts each entry itself: a link whose target exists on the host counts
    as much as one whose target does not (the host's files decide nothing)."""
    top = tmp_path / "upper"
    (top / "d").mkdir(parents=True)
    (top / "d" / "f").write_bytes(b"x" * 100)
    host_file = tmp_path / "host-secret"
    host_file.write_bytes(b"s" * 10_000)
    (top / "to-host").symlink_to(host_file)
    (top / "dangling").symlink_to(str(host_file) + "-nope")
    (top / "to-dir").symlink_to(tmp_path)  # never walked into
    links = sum(os.lstat(top / n).st_size for n in ("to-host", "dangling", "to-dir"))
    assert lifecycle.layer_bytes(top) == 100 + links
