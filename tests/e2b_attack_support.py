"""The attackers of `bunshin serve` that tests/test_containment_attackers.py and
`benchmarks/e2b_server.py --attackers` both run (issue 36's 32-client proof), and the clients
they are measured against:

- a sandbox flooding its output (a command writing `flood_bytes`, read by its client as it comes);
- a client without the key sending a large body to a port-proxy URL (a sandbox's port 8000);
- a client holding `half_open` connections open with a partial request head (half send nothing,
  half stop mid-header), opening another each time the server closes one.

Everything runs in threads of the calling process, over loopback, with the real `e2b` SDK,
httpx and raw sockets; every call has a deadline.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import e2b
import e2b_server_support as support
import httpx

# The output a server holds for one command stream at most (serve/envd.py OUTPUT_QUEUE slices of
# commands.READ_SLICE): there is no cap on a command's total output, which waits in its own file
# in the sandbox; the flood is 4x this.
from bunshinfork.commands import READ_SLICE
from bunshinfork.serve.envd import OUTPUT_QUEUE

OUTPUT_CAP = OUTPUT_QUEUE * READ_SLICE
FLOOD_BYTES = 4 * OUTPUT_CAP
CALL_TIMEOUT = 120.0  # any one call of an attacker or a client

# A sandbox's port 8000 that reads a POST's body and answers its length.
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


def serve_count(sbx: e2b.Sandbox) -> str:
    """Start the counting server on the sandbox's port 8000; the port's proxy host name."""
    sbx.files.write("/tmp/count.py", COUNT_SERVER)
    # timeout=0: E2B's default (60 s) would end the server a minute in.
    sbx.commands.run("python3 /tmp/count.py", background=True, timeout=0)
    # The listener is up when a connect succeeds (polled inside the sandbox, bounded by seq).
    sbx.commands.run("for i in $(seq 400); do python3 -c 'import socket; socket.create_connection("
                     "(\"127.0.0.1\", 8000), 1)' 2>/dev/null && exit 0; sleep 0.05; done; exit 1",
                     timeout=60)
    return sbx.get_host(8000)


def server_addr(served: support.Served) -> tuple[str, int]:
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


@dataclass
class AttackResult:
    floods: int = 0  # commands that wrote flood_bytes, all of it read by their client
    flood_read: int = 0
    bodies: int = 0  # bodies sent without a key, each answered with its length by the sandbox
    body_bytes: int = 0
    half_open_opened: int = 0
    # Seconds from a half-open connection's connect (the instant before it) to the server's
    # close of it: the head deadline runs from the connect, partial bytes do not extend it.
    half_open_closed_after: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Attackers:
    """The three attackers, each in its own thread, until stop(). `once`: each attacker's first
    round only (a flood, a body, `half_open` connections, each until the server closes it)."""

    def __init__(self, served: support.Served, flood_sbx: e2b.Sandbox, target_host: str, *,
                 flood_bytes: int = FLOOD_BYTES, body_bytes: int = 256 << 20, half_open: int = 100,
                 once: bool = False) -> None:
        self.served, self.flood_sbx, self.target_host = served, flood_sbx, target_host
        self.flood_bytes, self.body_bytes, self.half_open = flood_bytes, body_bytes, half_open
        self.once = once
        self.result = AttackResult()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._guard, args=(f,), daemon=True, name=f"attacker-{f.__name__}")
                         for f in (self._flood, self._body, self._hold)]

    def start(self) -> Attackers:
        for t in self._threads:
            t.start()
        return self

    def wait(self, timeout: float) -> bool:
        """Whether every attacker ended (with `once`) within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def stop(self, timeout: float = CALL_TIMEOUT + 10) -> AttackResult:
        self._stop.set()
        if not self.wait(timeout):
            self.result.errors.append("an attacker did not stop in time")
        return self.result

    def _guard(self, attack: Callable[[], None]) -> None:
        try:
            attack()
        except Exception as e:
            with self._lock:
                self.result.errors.append(f"{attack.__name__}: {type(e).__name__}: {e}")

    def _flood(self) -> None:
        while not self._stop.is_set():
            got = 0

            def seen(text: str) -> None:
                nonlocal got
                got += len(text)

            self.flood_sbx.commands.run(f"head -c {self.flood_bytes} /dev/zero | tr '\\0' x", on_stdout=seen,
                                        timeout=CALL_TIMEOUT, request_timeout=CALL_TIMEOUT)
            if got != self.flood_bytes:
                raise AssertionError(f"the flood's client read {got} of {self.flood_bytes} bytes")
            with self._lock:
                self.result.floods += 1
                self.result.flood_read += got
            if self.once:
                return

    def _body(self) -> None:
        chunk = b"x" * (1 << 20)
        while not self._stop.is_set():
            n = self.body_bytes // len(chunk)
            size = n * len(chunk)
            # No X-API-KEY, no access token: what anyone who learns a port's URL can send.
            r = httpx.post(self.served.url + "/", headers={"Host": self.target_host, "Content-Length": str(size)},
                           content=iter([chunk] * n), timeout=CALL_TIMEOUT)
            if r.status_code != 200 or r.text != str(size):
                raise AssertionError(f"the body's answer: {r.status_code} {r.text[:200]!r}")
            with self._lock:
                self.result.bodies += 1
                self.result.body_bytes += size
            if self.once:
                return

    def _hold(self) -> None:
        """Keep `half_open` connections open, each with a partial head or none; a connection the
        server closes is timed (from its connect) and, unless `once`, opened again."""
        addr = server_addr(self.served)
        sel = selectors.DefaultSelector()
        opened = 0

        def open_one() -> None:
            nonlocal opened
            # The server's deadline runs from its accept, which comes after this instant.
            began = time.monotonic()
            s = socket.create_connection(addr, 10)
            if opened % 2:  # half stop mid-header, half send nothing at all
                s.sendall(b"GET /sandboxes HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, began)
            opened += 1

        try:
            for _ in range(self.half_open):
                open_one()
            while sel.get_map() and not self._stop.is_set():
                for key, _ in sel.select(timeout=0.5):
                    s: Any = key.fileobj
                    try:
                        data = s.recv(4096)
                    except (ConnectionResetError, BlockingIOError) as e:
                        data = b"" if isinstance(e, ConnectionResetError) else b"?"
                    if data == b"?":
                        continue
                    sel.unregister(s)
                    s.close()
                    with self._lock:
                        if data:  # an answer instead of a close: a partial head was served
                            self.result.errors.append(f"a half-open connection was answered: {data[:80]!r}")
                        self.result.half_open_closed_after.append(time.monotonic() - key.data)
                    if not self.once and not self._stop.is_set():
                        open_one()
        finally:
            for key in list(sel.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
            sel.close()
            with self._lock:
                self.result.half_open_opened = opened


@dataclass
class ClientsResult:
    run_true: list[float] = field(default_factory=list)  # seconds per commands.run("true")
    per_client: list[int] = field(default_factory=list)  # calls answered, by client
    errors: list[str] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        xs = sorted(self.run_true)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Clients:
    """`n` threads, client i using sandbox i % len(sandbox_ids) through its own SDK object,
    each running commands.run("true") (timed) until stop()."""

    def __init__(self, served: support.Served, sandbox_ids: list[str], n: int) -> None:
        opts = {"api_key": served.key, "api_url": served.url, "sandbox_url": served.url}
        self.sandboxes = [e2b.Sandbox.connect(sandbox_ids[i % len(sandbox_ids)], **opts) for i in range(n)]
        self.result = ClientsResult(per_client=[0] * n)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> Clients:
        self._stop.clear()
        self.result = ClientsResult(per_client=[0] * len(self.sandboxes))
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True, name=f"client-{i}")
                         for i in range(len(self.sandboxes))]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> ClientsResult:
        self._stop.set()
        for t in self._threads:
            t.join(CALL_TIMEOUT + 10)
        if any(t.is_alive() for t in self._threads):
            self.result.errors.append("a client did not stop in time")
        return self.result

    def _client(self, i: int) -> None:
        sbx = self.sandboxes[i]
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                r = sbx.commands.run("true", timeout=CALL_TIMEOUT, request_timeout=CALL_TIMEOUT)
                took = time.perf_counter() - t
                if r.exit_code != 0:
                    raise AssertionError(f"exit code {r.exit_code}")
            except Exception as e:
                with self._lock:
                    self.result.errors.append(f"client {i}: {type(e).__name__}: {e}")
                    if len(self.result.errors) > 100:  # a server gone: say so once, not a spin
                        self._stop.set()
                continue
            with self._lock:
                self.result.run_true.append(took)
                self.result.per_client[i] += 1


@dataclass(frozen=True)
class ServerUse:
    """What the server process holds: its open fds other than client connections, its client
    connections (sockets to its port), its threads."""

    fds: int
    connections: int
    threads: int


def server_use(served: support.Served) -> ServerUse:
    pid = served.proc.pid
    port = server_addr(served)[1]
    conn_inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] != "0A":  # not the listener
                    conn_inodes.add(cols[9])
    fds = conns = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:[") and target[8:-1] in conn_inodes:
                conns += 1
            else:
                fds += 1
    return ServerUse(fds, conns, len(os.listdir(f"/proc/{pid}/task")))


def settle(served: support.Served, within: ServerUse | None = None, timeout: float = 60) -> ServerUse:
    """The server's use once its client connections are gone (closed by the server: by the
    keep-alive after their last response, or the header timeout) and, if `within` is given, its
    fds and threads are back within it; polled, as nothing reports when they are closed."""
    deadline = time.monotonic() + timeout
    while True:
        use = server_use(served)
        ok = use.connections == 0 and (within is None or (use.fds <= within.fds and use.threads <= within.threads))
        if ok or time.monotonic() > deadline:
            return use
        time.sleep(0.1)
