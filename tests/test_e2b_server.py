"""`bunshin serve` driven by the unmodified e2b SDK (sync and async) over loopback HTTP.

E2B's own README and docstring examples, the set tests/test_e2b_examples.py runs in-process,
run here verbatim against the real `e2b` package, with E2B_API_URL/E2B_SANDBOX_URL/E2B_API_KEY
pointing at a server started as a child process (`python -m bunshinfork.cli serve`). Then
E2B's semantics the examples do not show, pause to disk, the server's restarts and crashes,
bad input over HTTP, and a short load run (the long one is benchmarks/e2b_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2b
import e2b_server_support as support
import httpx
import pytest
import test_e2b_examples as ex
from fake_internet import fake_host
from fake_internet import reach_from_sandbox as _reach
from helpers import HOG, HOG_READY, ask_hog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshinfork import state

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("serve") / "key"
    f.write_text("test-key-" + os.urandom(8).hex() + "\n")
    return f


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[support.Served]:
    s = support.start(tmp_path_factory.mktemp("serve-state"), key_file)
    try:
        with support.env(s):
            yield s
    finally:
        assert s.stop() == 0, "".join(s.log)
        left = [i for i in state.all_ids() if _creator(i) == s.proc.pid]
        assert not left, f"the server left workspaces behind: {left}"


def _running_of(pid: int) -> set[str]:
    """The workspaces the server `pid` made that are running (a paused one keeps its record)."""
    out = set()
    for i in state.all_ids():
        with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
            rec = state.Record.load(i)
            if rec.creator_pid == pid and rec.status is state.Status.RUNNING:
                out.add(i)
    return out


def _creator(ws_id: str) -> int | None:
    with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
        return state.Record.load(ws_id).creator_pid
    return None


@pytest.fixture
def cleanup(served: support.Served) -> Iterator[None]:
    """The examples leave sandboxes running (E2B's end after 300 s): kill what the server holds."""
    yield
    for info in e2b.Sandbox.list(limit=100).next_items():
        e2b.Sandbox.kill(info.sandbox_id)


def run_sync(example: str, **names: Any) -> dict[str, Any]:
    ns: dict[str, Any] = {"Sandbox": e2b.Sandbox, **names}
    exec(compile(example, "<e2b example>", "exec"), ns)
    return ns


def run_async(example: str, **names: Any) -> dict[str, Any]:
    import ast

    ns: dict[str, Any] = {"AsyncSandbox": e2b.AsyncSandbox, **names}
    code = compile(example, "<e2b example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)

    async def main() -> None:
        result = eval(code, ns)
        if result is not None:
            await result

    asyncio.run(main())
    return ns


def api(served: support.Served, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"X-API-KEY": served.key, **kw.pop("headers", {})}
    return httpx.request(method, served.url + path, headers=headers, timeout=60, **kw)


# ---- E2B's examples, verbatim, over HTTP ----


def test_quickstart(served: support.Served, capsys: pytest.CaptureFixture[str], cleanup: None) -> None:
    ex._installed("README", ex.QUICKSTART)
    ns = run_sync(ex.QUICKSTART)
    assert capsys.readouterr().out == "Hello from E2B!\n\n"
    assert isinstance(ns["sandbox"], e2b.Sandbox) and not ns["sandbox"].is_running()


def test_stream_read(served: support.Served, cleanup: None) -> None:
    blob = os.urandom(3 << 20)
    sbx = e2b.Sandbox.create()
    sbx.files.write("big.bin", blob)
    ns = run_sync(ex.STREAM, sandbox=sbx, path="big.bin")
    assert blob.endswith(ns["chunk"])
    assert sbx.files.read("big.bin", format="bytes") == blob


# ---- E2B's semantics beyond the examples ----


def test_files(served: support.Served, cleanup: None) -> None:
    sbx = e2b.Sandbox.create()
    sbx.files.write_files([{"path": "/tmp/d/a.txt", "data": "a"}, {"path": "/tmp/d/b.txt", "data": b"b"}])
    assert sorted(e.name for e in sbx.files.list("/tmp/d")) == ["a.txt", "b.txt"]
    assert sbx.files.make_dir("/tmp/d/sub") is True and sbx.files.make_dir("/tmp/d/sub") is False
    sbx.files.rename("/tmp/d/a.txt", "/tmp/d/sub/a.txt")
    assert sbx.files.get_info("/tmp/d/sub/a.txt").size == 1
    sbx.files.remove("/tmp/d/b.txt")
    assert not sbx.files.exists("/tmp/d/b.txt")
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read("/no/such/file")
    # a path outside the sandbox stays inside it
    marker = f"e2b-escape-{os.getpid()}"
    sbx.files.write(f"../../../../../../tmp/{marker}", "x")
    assert not Path(f"/tmp/{marker}").exists() and sbx.files.read(f"/tmp/{marker}") == "x"
    # signed URLs: a plain client (no headers) reads and writes with them
    sbx2 = e2b.Sandbox.create(secure=True)
    sbx2.files.write("/tmp/signed.txt", "signed")
    url = sbx2.download_url("/tmp/signed.txt", use_signature_expiration=60)
    assert httpx.get(url, timeout=30).text == "signed"
    assert httpx.get(url.replace("signature=v1_", "signature=v1_x"), timeout=30).status_code == 401
    up = sbx2.upload_url("/tmp/up.txt", use_signature_expiration=60)
    assert httpx.post(up, files={"file": ("up.txt", b"uploaded")}, timeout=30).status_code == 200
    assert sbx2.files.read("/tmp/up.txt") == "uploaded"
    # a watch
    w = sbx.files.watch_dir("/tmp/d")
    sbx.files.write("/tmp/d/new.txt", "n")
    deadline = time.monotonic() + 10
    events: list[Any] = []
    while not any(e.name == "new.txt" for e in events) and time.monotonic() < deadline:
        events += w.get_new_events()
    w.stop()
    assert any(e.name == "new.txt" for e in events)


# ---- pause to disk ----


def test_pause_frees_memory_and_resumes(served: support.Served, cleanup: None) -> None:
    sbx = e2b.Sandbox.create()
    sbx.commands.run(HOG, background=True)
    sbx.commands.run(HOG_READY)
    (before,) = sbx.get_metrics()
    assert before.mem_used >= 200 << 20  # what it costs the host (bunshin's accounting)
    live_before = _running_of(served.proc.pid)
    assert sbx.pause() is True and sbx.pause() is False
    live_paused = _running_of(served.proc.pid)
    # Paused: its workspace's parts are gone (memory, processes, mounts returned), only its
    # record is left, paused, and its state is on disk.
    assert live_before - live_paused == {sbx.sandbox_id} and not live_paused - live_before
    assert state.Record.load(sbx.sandbox_id).status is state.Status.PAUSED
    assert sbx.get_metrics() == []
    assert any((served.state_dir / "paused").iterdir())
    same = e2b.Sandbox.connect(sbx.sandbox_id)
    assert ask_hog(same) == str(200 << 20)  # the process is back, with its memory


def test_on_timeout_pause_and_restart(served: support.Served, key_file: Path, cleanup: None) -> None:
    sbx = e2b.Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    sbx.files.write("/tmp/kept.txt", "kept")
    deadline = time.monotonic() + 60
    while sbx.get_info().state != "paused" and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting on the server's deadline, which is the thing under test
    assert sbx.get_info().state == "paused"
    # The next server on the same state directory finds it paused.
    served_port = int(served.url.rsplit(":", 1)[1])
    served.stop()
    restarted = support.start(served.state_dir, key_file, port=served_port)
    served.proc = restarted.proc
    info = e2b.Sandbox.get_info(sbx.sandbox_id)
    assert info.state == "paused"
    same = e2b.Sandbox.connect(sbx.sandbox_id)
    assert same.files.read("/tmp/kept.txt") == "kept"


def test_sigkill_leaves_nothing_the_next_server_cannot_take_back(served: support.Served, key_file: Path,
                                                                 cleanup: None) -> None:
    running = e2b.Sandbox.create()
    paused = e2b.Sandbox.create()
    paused.pause()
    port = int(served.url.rsplit(":", 1)[1])
    old_pid = served.proc.pid
    served.stop(signal.SIGKILL)
    restarted = support.start(served.state_dir, key_file, port=port)
    served.proc = restarted.proc
    # The running sandbox was reaped at start; the paused one stays (its record, paused), and resumes.
    assert [i for i in state.all_ids() if _creator(i) == old_pid] == [paused.sandbox_id]
    listed = {i.sandbox_id: i.state for i in e2b.Sandbox.list().next_items()}
    assert listed == {paused.sandbox_id: "paused"}
    assert e2b.Sandbox.kill(running.sandbox_id) is False
    e2b.Sandbox.connect(paused.sandbox_id).kill()
    # What only the dead process held (its boost of ksmd) is bunshin gc's to take back.
    gc = subprocess.run([sys.executable, "-m", "bunshinfork.cli", "gc"], capture_output=True, text=True,
                        timeout=120)
    assert gc.returncode == 0, gc.stderr


# ---- bad input ----


def test_bad_input(served: support.Served, cleanup: None) -> None:
    for headers in ({}, {"X-API-KEY": "wrong"}):
        r = httpx.get(served.url + "/v2/sandboxes", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json() == {"code": 401, "message": "Invalid API key"}
    r = api(served, "POST", "/v2/sandboxes", content=b'{"templateID": ')
    assert r.status_code == 400 and r.json()["code"] == 400
    for method, path in (("GET", "/sandboxes/nope"), ("DELETE", "/sandboxes/nope"),
                         ("POST", "/sandboxes/nope/timeout"), ("POST", "/sandboxes/nope/pause"),
                         ("POST", "/sandboxes/nope/fork"), ("POST", "/v2/sandboxes/nope/connect"),
                         ("GET", "/sandboxes/nope/metrics"), ("POST", "/sandboxes/nope/snapshots")):
        r = api(served, method, path, json={"timeout": 10})
        assert r.status_code == 404 and r.json()["code"] == 404, (method, path, r.text)
    with pytest.raises(e2b.SandboxException) as no_template:
        e2b.Sandbox.create("no-such-template")
    assert no_template.value.status_code == 404  # type: ignore[attr-defined]
    sbx = e2b.Sandbox.create()
    for count in (0, 1000, "2", True):
        r = api(served, "POST", f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": count})
        assert r.status_code == 400 and "count" in r.json()["message"]
    r = httpx.get(served.url + "/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "x"})
    assert r.status_code == 401
    # A command stream cut halfway: the stream ends, the command and the sandbox do not.
    h = sbx.commands.run("for i in $(seq 100000); do echo $i; sleep 0.01; done", background=True)
    for stdout, _, _ in h:
        if stdout:
            break
    h.disconnect()
    assert sbx.is_running() and h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid)
    assert {i.sandbox_id for i in e2b.Sandbox.list().next_items()} == {sbx.sandbox_id}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.binary(max_size=64), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(
        ["timeout", "count", "templateID", "metadata", "memory", "name", "autoPause"]), c, max_size=4),
    max_leaves=8).map(lambda v: json.dumps(v).encode())),
    route=st.sampled_from(["/sandboxes/nope/timeout", "/sandboxes/nope/fork", "/v2/sandboxes/nope/connect",
                           "/sandboxes/nope/pause", "/sandboxes/nope/snapshots"]))
def test_fuzzed_bodies_get_e2b_errors(served: support.Served, body: bytes, route: str) -> None:
    r = api(served, "POST", route, content=body)
    assert r.status_code in (400, 404) and set(r.json()) == {"code", "message"}
    assert r.json()["code"] == r.status_code


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(params=st.dictionaries(st.sampled_from(["metadata", "state", "limit", "nextToken", "order", "startedAfter",
                                               "template"]), st.text(max_size=12), max_size=4))
def test_fuzzed_list_queries(served: support.Served, params: dict[str, str]) -> None:
    r = api(served, "GET", "/v2/sandboxes", params=params)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["code"] == 400


# ---- load ----


@pytest.mark.slow
def test_load_32_clients(served: support.Served) -> None:
    before = {i for i in state.all_ids() if _creator(i) == served.proc.pid}
    result = support.load(served, clients=32, seconds=15)
    print(result.summary())
    assert not result.errors, result.errors[:5]
    assert result.cycles >= 32
    assert {i for i in state.all_ids() if _creator(i) == served.proc.pid} == before
    assert e2b.Sandbox.list().next_items() == []


# ---- ports ----


def test_ports(served: support.Served, cleanup: None) -> None:
    """get_host(port)'s name, sent as Host, reaches the port in the sandbox (a bridge network
    the test's sandbox made); a sandbox closed to public traffic needs its traffic token."""
    open_sbx = e2b.Sandbox.create(allow_internet_access=True)
    closed = e2b.Sandbox.create(allow_internet_access=True, network={"allow_public_traffic": False})
    for sbx in (open_sbx, closed):
        sbx.files.write("/tmp/www/index.html", f"hello from {sbx.sandbox_id}")
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
        sbx.commands.run("for i in $(seq 200); do python3 -c 'import socket; socket.create_connection("
                         "(\"127.0.0.1\", 8000), 1)' 2>/dev/null && exit 0; sleep 0.05; done; exit 1")
    host = open_sbx.get_host(8000)
    assert host == f"8000-{open_sbx.sandbox_id}.localhost"
    r = httpx.get(served.url + "/index.html", headers={"Host": host}, timeout=30)
    assert r.status_code == 200 and r.text == f"hello from {open_sbx.sandbox_id}"
    closed_host = closed.get_host(8000)
    assert httpx.get(served.url + "/", headers={"Host": closed_host}, timeout=30).status_code == 403
    token = closed.traffic_access_token
    r = httpx.get(served.url + "/index.html", headers={"Host": closed_host, "e2b-traffic-access-token": token},
                  timeout=30)
    assert r.status_code == 200 and r.text == f"hello from {closed.sandbox_id}"
    gone = httpx.get(served.url + "/", headers={"Host": "8000-nope.localhost"}, timeout=30)
    assert gone.status_code == 502 and "was not found" in gone.json()["message"]


# ---- egress rules ----

def test_network_rules_over_http(served: support.Served, cleanup: None) -> None:
    """E2B's SDK's network={...} and update_network against the server: the rules hold in the
    sandbox and its forks, what cannot apply is a 400, and the default sandbox is online."""
    with fake_host(0) as allowed, fake_host(1) as denied:
        sbx = e2b.Sandbox.create(network={"allow_out": [allowed.addr], "deny_out": lambda ctx: [ctx.all_traffic]})
        info = sbx.get_info()
        assert info.allow_internet_access is True
        assert info.network == {"allow_out": [f"{allowed.addr}/32"], "deny_out": ["0.0.0.0/0"],
                                "allow_public_traffic": True}
        (kid,) = sbx.fork(count=1)
        assert not isinstance(kid, Exception), kid
        for s in (sbx, kid):
            assert (_reach(s, allowed), _reach(s, denied)) == ("connected", "ConnectionRefusedError")
        sbx.update_network({"deny_out": [denied.addr]})
        assert sbx.get_info().network["deny_out"] == [f"{denied.addr}/32"]
        e2b.Sandbox.update_network(sbx.sandbox_id, {"allow_internet_access": False})
        assert sbx.get_info().allow_internet_access is False
        assert (_reach(sbx, allowed), _reach(sbx, denied)) == ("ConnectionRefusedError", "ConnectionRefusedError")
        assert (_reach(kid, allowed), _reach(kid, denied)) == ("connected", "ConnectionRefusedError")  # its own
        for bad in ({"rules": {"api.example.com": []}}, {"dns_servers": ["1.1.1.1"]},
                    {"egress_proxy": {"address": "proxy.example.com:1080"}}):
            with pytest.raises(e2b.SandboxException, match="400"):
                sbx.update_network(bad)  # type: ignore[arg-type]
            with pytest.raises(e2b.SandboxException, match="400"):
                e2b.Sandbox.create(network=bad)  # type: ignore[arg-type]
        assert api(served, "PUT", "/sandboxes/nope/network", json={}).status_code == 404
        assert api(served, "PUT", f"/sandboxes/{sbx.sandbox_id}/network", content=b"[]").status_code == 400
        online = e2b.Sandbox.create()
        assert online.get_info().allow_internet_access is True
        assert (_reach(online, allowed), _reach(online, denied)) == ("connected", "connected")
        assert {i.sandbox_id for i in e2b.Sandbox.list().next_items()} == {sbx.sandbox_id, kid.sandbox_id,
                                                                            online.sandbox_id}
