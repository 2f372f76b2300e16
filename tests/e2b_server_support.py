"""`bunshin serve` as a child process on loopback, and the load the test and the benchmark
put on it (clients of the real e2b SDK, each creating, running, forking and killing)."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Served:
    url: str
    key: str
    proc: subprocess.Popen[str]
    state_dir: Path
    log: list[str] = field(default_factory=list)
    domain: str | None = None  # served with TLS: clients set only E2B_DOMAIN

    @property
    def env(self) -> dict[str, str]:
        if self.domain is not None:
            return {"E2B_DOMAIN": self.domain, "E2B_API_KEY": self.key}
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.key}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Stop the server; its exit status (0 after a clean shutdown on SIGTERM)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def start(state_dir: Path, key_file: Path, port: int = 0, extra: tuple[str, ...] = ()) -> Served:
    """Start the server; it prints its exports, E2B_API_KEY last, once it accepts."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bunshinfork.cli", "serve", "--port", str(port), "--state-dir", str(state_dir),
         "--api-key-file", str(key_file), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while not lines or not lines[-1].startswith("export E2B_API_KEY="):
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"bunshin serve did not start: {lines!r} {proc.stdout.read()}")
        lines.append(line)
    exports = dict(line.removeprefix("export ").strip().split("=", 1) for line in lines)
    domain = exports.get("E2B_DOMAIN")
    url = exports["E2B_API_URL"] if domain is None else f"https://api.{domain}"
    # A key read from --api-key-file is not printed: the line reads the file back.
    key = exports["E2B_API_KEY"]
    key = key_file.read_text().strip() if key.startswith('"$(cat ') else key
    served = Served(url, key, proc, state_dir, log=list(lines), domain=domain)

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            served.log.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return served


@contextlib.contextmanager
def serving(workdir: Path, extra: tuple[str, ...] = ()) -> Iterator[Served]:
    """A server with a key file of its own under `workdir`, its exports in the environment while
    it runs (the SDKs read them), stopped cleanly at the end."""
    key_file = workdir / "key"
    key_file.write_text("test-key-" + os.urandom(8).hex() + "\n")
    (workdir / "state").mkdir()
    s = start(workdir / "state", key_file, extra=extra)
    try:
        with env(s):
            yield s
    finally:
        assert s.stop() == 0, "".join(s.log)


@contextlib.contextmanager
def env(served: Served) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in served.env}
    os.environ.update(served.env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class LoadResult:
    cycles: int
    errors: list[str]
    run_true: list[float]  # seconds per commands.run("true")

    def percentile(self, q: float) -> float:
        xs = sorted(self.run_true)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def summary(self) -> str:
        med = statistics.median(self.run_true) if self.run_true else float("nan")
        return (f"{self.cycles} cycles, {len(self.errors)} errors, commands.run('true') x{len(self.run_true)}: "
                f"p50 {med * 1000:.1f} ms, p99 {self.percentile(0.99) * 1000:.1f} ms")


def load(served: Served, clients: int, seconds: float, runs_per_cycle: int = 5) -> LoadResult:
    """`clients` threads, each with its own e2b client calls, until `seconds` have passed:
    create, run "true" a few times (timed), fork one child, run in it, kill both."""
    from e2b import Sandbox

    opts = {"api_key": served.key, "api_url": served.url, "sandbox_url": served.url}
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()
    result = LoadResult(0, [], [])

    def client(i: int) -> None:
        while time.monotonic() < stop_at:
            made = []
            try:
                sbx = Sandbox.create(timeout=120, metadata={"load": str(i)}, **opts)
                made.append(sbx)
                times = []
                for _ in range(runs_per_cycle):
                    t = time.perf_counter()
                    sbx.commands.run("true")
                    times.append(time.perf_counter() - t)
                (child,) = sbx.fork(count=1)
                if isinstance(child, Exception):
                    raise child
                made.append(child)
                assert child.commands.run("echo forked").stdout == "forked\n"
                for s in made:
                    assert s.kill() is True
                made.clear()
                with lock:
                    result.cycles += 1
                    result.run_true.extend(times)
            except Exception as e:
                with lock:
                    result.errors.append(f"client {i}: {type(e).__name__}: {e}")
            finally:
                for s in made:
                    with contextlib.suppress(Exception):
                        s.kill()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)
    return result
