"""Causes of issue 39 in envd's process service and uploads, through `bunshin serve` with the
e2b SDK, as E2B's envd does them: a PTY reconnect streams `pty` events (and only what comes
after it, as envd's Process/Connect); a sandbox killed during a command ends the command's
stream as a lost connection, which the SDK's /health probe then names; the client's
Connect-Timeout-Ms kills a started process and ends its stream with DEADLINE_EXCEEDED, for
async clients too (a Connect's only ends the stream); a gzip upload is held to the server's
--max-upload-bytes once decompressed, on a thread, so the loop keeps answering meanwhile."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import e2b
import e2b_server_support as support
import httpx
import pytest

from bunshinfork.serve import envd

SLEEPER = "sleep 77"  # a command line no other process of the sandbox has


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[support.Served]:
    with support.serving(tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture
def sandbox(served: support.Served) -> Iterator[e2b.Sandbox]:
    sbx = e2b.Sandbox.create(timeout=120)
    try:
        yield sbx
    finally:
        sbx.kill()


def _sleepers(sbx: e2b.Sandbox) -> list[int]:
    return [p.pid for p in sbx.commands.list() if SLEEPER in " ".join(p.args)]


def _until(check: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_pty_reconnect_streams_pty_events(sandbox: e2b.Sandbox) -> None:
    terminal = sandbox.pty.create(e2b.PtySize(rows=24, cols=80), envs={"FOO": "bar"})
    sandbox.pty.send_stdin(terminal.pid, b"echo $FOO\n")
    terminal.disconnect()
    again = sandbox.pty.connect(terminal.pid)
    sandbox.pty.send_stdin(terminal.pid, b"echo x${FOO}x\nexit\n")
    out: list[bytes] = []
    result = again.wait(on_pty=out.append)
    assert (again.pid, result.exit_code) == (terminal.pid, 0)
    assert b"xbarx" in b"".join(out)  # before the fix, Connect streamed no pty event at all


def test_connect_streams_only_what_comes_after_it(sandbox: e2b.Sandbox) -> None:
    h = sandbox.commands.run("echo first; read line; echo second", background=True, stdin=True)
    for out, _, _ in h:  # "first" is in the command's output before the reconnect
        if out and "first" in out:
            break
    h.disconnect()
    again = sandbox.commands.connect(h.pid)
    sandbox.commands.send_stdin(h.pid, "go\n")
    assert again.wait().stdout == "second\n"  # envd's Connect: a fork of the events from now on


def test_a_sandbox_killed_during_a_command_is_named_by_the_health_probe(served: support.Served) -> None:
    sbx = e2b.Sandbox.create(timeout=60)
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(e2b.SandboxNotRunningException) as ei:
        cmd.wait()
    # The stream ended as a lost connection (before: "The sandbox was not found (it ended)"
    # straight from the stream, which the SDK never probed).
    assert "sandbox was killed or reached its end of life while the request was in flight" in str(ei.value)
    assert envd.CONNECTION_LOST.format(sbx.sandbox_id) in str(ei.value)
    r = httpx.get(f"{sbx.envd_api_url}/health", headers=sbx.connection_config.sandbox_headers, timeout=10)
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_the_clients_timeout_kills_the_process(sandbox: e2b.Sandbox) -> None:
    # The sync client ends its own stream at the timeout; envd kills the process all the same
    # (before the fix it ran on, for the rest of its 77 s).
    with pytest.raises(e2b.TimeoutException):
        sandbox.commands.run(SLEEPER, timeout=1)
    _until(lambda: not _sleepers(sandbox), 10, "the process outlived the client's timeout")


def test_async_clients_time_out_and_a_connects_timeout_spares_the_process(served: support.Served) -> None:
    async def main() -> None:
        sbx = await e2b.AsyncSandbox.create(timeout=120)
        try:
            started = time.monotonic()
            with pytest.raises(e2b.TimeoutException, match=envd.DEADLINE_EXCEEDED):
                await sbx.commands.run(SLEEPER, timeout=1)  # before the fix: ran the whole 77 s
            assert time.monotonic() - started < 10
            deadline = time.monotonic() + 10
            while [p for p in await sbx.commands.list() if SLEEPER in " ".join(p.args)]:
                assert time.monotonic() < deadline, "the process outlived the client's timeout"
                await asyncio.sleep(0.1)
            # A Connect's timeout ends its stream; the process it followed runs on.
            h = await sbx.commands.run(SLEEPER, background=True, timeout=0)
            again = await sbx.commands.connect(h.pid, timeout=1)
            with pytest.raises(e2b.TimeoutException, match=envd.DEADLINE_EXCEEDED):
                await again.wait()
            assert h.pid in [p.pid for p in await sbx.commands.list()]
        finally:
            await sbx.kill()

    asyncio.run(main())


# ---- gzip uploads: the decompressed bytes under --max-upload-bytes, off the event loop ----


def test_gunzipped_is_sliced_bounded_and_checked() -> None:
    data = bytes(range(256)) * 20_000  # 5 MB: several slices
    assert b"".join(envd.gunzipped(gzip.compress(data), len(data))) == data
    assert max(len(c) for c in envd.gunzipped(gzip.compress(data), len(data))) <= envd.GUNZIP_SLICE
    with pytest.raises(envd.UploadTooLarge):
        envd.check_gzip(gzip.compress(data), len(data) - 1)


def _bomb(decompressed: int) -> bytes:
    """A gzip stream of `decompressed` zero bytes and no trailer (the cap trips first), made
    of one fully flushed deflate block repeated: the same bytes each time, as a full flush
    resets the compressor's history."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH) == block
    return first + block * (decompressed // len(zeros))


@pytest.fixture
def served_small(tmp_path: Path) -> Iterator[support.Served]:
    """A server of its own, for this test only (its exports are the environment's while it runs)."""
    with support.serving(tmp_path, ("--max-upload-bytes", str(1 << 20))) as s:
        yield s


def _opts(s: support.Served) -> dict[str, str]:
    return {"api_key": s.key, "api_url": s.url, "sandbox_url": s.url}


def test_gzip_uploads_are_held_to_the_servers_upload_cap(served_small: support.Served) -> None:
    sbx = e2b.Sandbox.create(timeout=60, **_opts(served_small))
    try:
        sbx.files.write("/home/user/small.txt", "s" * (512 << 10), gzip=True)
        assert sbx.files.get_info("/home/user/small.txt").size == 512 << 10
        # 4 MiB of zeros is a few KiB of gzip, well under the 1 MiB body cap: before the fix it
        # was written, as only a fixed 256 MiB held the decompressed bytes.
        with pytest.raises(e2b.SandboxException, match="decompresses to more than 1048576 bytes"):
            sbx.files.write("/home/user/big.bin", bytes(4 << 20), gzip=True)
        assert not sbx.files.exists("/home/user/big.bin")  # nothing of a refused upload is written
    finally:
        sbx.kill()


def test_a_gzip_bomb_is_413_and_the_loop_keeps_answering(served: support.Served) -> None:
    """256 MiB (the default cap) and a little more of zeros: decompressing it took the event
    loop for the whole time, so that every other request waited; now a thread does it."""
    sbx = e2b.Sandbox.create(timeout=60, **_opts(served))
    try:
        body = _bomb((256 << 20) + (8 << 20))
        headers = dict(sbx.connection_config.sandbox_headers)
        latencies: list[float] = []
        uploading = threading.Event()
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=60) as c:
                uploading.wait(30)
                while not done.is_set():
                    t = time.perf_counter()
                    assert c.get(f"{sbx.envd_api_url}/health", headers=headers).status_code == 204
                    latencies.append(time.perf_counter() - t)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            with httpx.Client(timeout=120) as c:
                uploading.set()
                t = time.perf_counter()
                r = c.post(f"{sbx.envd_api_url}/files", params={"path": "/home/user/bomb.bin"}, content=body,
                           headers={**headers, "Content-Type": "application/octet-stream",
                                    "Content-Encoding": "gzip"})
                took = time.perf_counter() - t
        finally:
            done.set()
            prober.join(60)
        assert r.status_code == 413 and "decompresses to more than" in r.json()["message"], r.text
        assert latencies, "no /health request was answered during the upload"
        # Relative to the upload's own time, so that a loaded host slows both alike: on the loop,
        # one /health waited for nearly the whole decompression.
        assert max(latencies) < took / 3, (max(latencies), took, len(latencies))
        assert not sbx.files.exists("/home/user/bomb.bin")
    finally:
        sbx.kill()
