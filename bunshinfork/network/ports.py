"""Published ports: a workspace's TCP port reached from the host (podman's -p, E2B's get_host).

The forwarder listens on the host and, for each connection, opens a socket inside the
workspace's own network namespace (nsock.socket_in) and connects to the port there, on
127.0.0.1 first and then on eth0's address (a server bound to only one of them). So it works
for network="none" as for "bridge", and for each clone separately although clones share one
inside address: no route into the workspace is needed.

Forwarders are threads of the process that published them: they end with it, and with the
workspace (Workspace.destroy releases them). Each is also written into the workspace's
directory (ports.json, with the publishing pid), so that `bunshin gc` drops the entries of a
publisher that died and the leak census sees every forwarder still listening.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import NetworkError, SpecError
from .nsock import socket_in

PORTS_FILE = "ports.json"
_CONNECT_TIMEOUT = 5.0
_lock = threading.Lock()
_active: dict[str, list[Forwarder]] = {}  # ws id -> its forwarders in this process


class Forwarder:
    def __init__(self, ws_id: str, netns_pid: int, inside: list[str], port: int, host: str, host_port: int) -> None:
        self.ws_id, self.netns_pid, self.inside, self.port = ws_id, netns_pid, inside, port
        self._conns: set[socket.socket] = set()
        self._closed = threading.Event()
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host, host_port))
            lsock.listen(64)
        except OSError as e:
            lsock.close()
            if e.errno == errno.EADDRINUSE:
                raise NetworkError(f"host port {host}:{host_port} is taken; publish on another or on 0 (any)") from None
            raise NetworkError(f"cannot listen on {host}:{host_port} for workspace port {port}: {e}") from None
        self._listener = lsock
        self.address: tuple[str, int] = lsock.getsockname()[:2]
        threading.Thread(target=self._accept, name=f"bunshin-port-{ws_id}-{port}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _dial(self) -> socket.socket | None:
        for addr in self.inside:
            try:
                s = socket_in(self.netns_pid, socket.AF_INET, socket.SOCK_STREAM)
            except (OSError, NetworkError):
                return None  # the workspace is gone
            s.settimeout(_CONNECT_TIMEOUT)
            try:
                s.connect((addr, self.port))
                s.settimeout(None)
                return s
            except OSError:
                s.close()
        return None

    def _serve(self, client: socket.socket) -> None:
        inner = self._dial()
        if inner is None:
            client.close()  # nothing listens inside: the client sees EOF, never a hang
            return
        with _lock:
            if self._closed.is_set():
                client.close()
                inner.close()
                return
            self._conns |= {client, inner}
        t = threading.Thread(target=_pump, args=(inner, client), daemon=True)
        t.start()
        _pump(client, inner)
        t.join()
        with _lock:
            self._conns -= {client, inner}
        client.close()
        inner.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        with _lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def _check_port(port: object, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise SpecError(f"{what} must be a TCP port number (0-65535), got {port!r}")
    return port


def publish(ws_id: str, ws_dir: Path, netns_pid: int, inside: list[str], port: int,
            host: str = "127.0.0.1", host_port: int = 0) -> tuple[str, int]:
    """Forward host:host_port (0: any free port) to the workspace's `port`; returns (host, port)."""
    if _check_port(port, "port") == 0:
        raise SpecError("port must name the workspace's port (1-65535), got 0")
    _check_port(host_port, "host_port")
    with _lock:
        if any(f.port == port for f in _active.get(ws_id, [])):
            raise NetworkError(f"port {port} of {ws_id} is already published; unpublish it first")
    fw = Forwarder(ws_id, netns_pid, inside, port, host, host_port)
    with _lock:
        _active.setdefault(ws_id, []).append(fw)
        _write(ws_id, ws_dir)
    return fw.address


def published(ws_id: str) -> dict[int, tuple[str, int]]:
    with _lock:
        return {f.port: f.address for f in _active.get(ws_id, [])}


def unpublish(ws_id: str, ws_dir: Path | None, port: int) -> bool:
    with _lock:
        mine = _active.get(ws_id, [])
        hit = [f for f in mine if f.port == port]
        _active[ws_id] = [f for f in mine if f.port != port]
        if ws_dir is not None:
            _write(ws_id, ws_dir)
    for f in hit:
        f.close()
    return bool(hit)


def release(ws_id: str) -> None:
    """Close every forwarder of the workspace (its destroy, a failed build)."""
    with _lock:
        mine = _active.pop(ws_id, [])
    for f in mine:
        f.close()


def _write(ws_id: str, ws_dir: Path) -> None:
    entries = [{"port": f.port, "host": f.address[0], "host_port": f.address[1], "pid": os.getpid()}
               for f in _active.get(ws_id, [])]
    with contextlib.suppress(FileNotFoundError):
        tmp = ws_dir / (PORTS_FILE + ".tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, ws_dir / PORTS_FILE)


def active() -> set[str]:
    """Every forwarder listening in this process (the leak census)."""
    with _lock:
        return {f"{f.ws_id}:{f.port}->{f.address[0]}:{f.address[1]}" for fs in _active.values() for f in fs}


def gc(ws_dirs: list[Path], live: set[str]) -> list[str]:
    """Drop the published-port entries whose publisher died or whose workspace is gone; a live
    publisher's forwarders of a dead workspace are closed. Returns what went."""
    removed = []
    for d in ws_dirs:
        f = d / PORTS_FILE
        try:
            entries = json.loads(f.read_text())
        except (FileNotFoundError, ValueError):
            continue
        keep = [e for e in entries if d.name in live and _pid_alive(int(e.get("pid", 0)))]
        if len(keep) != len(entries):
            removed += [f"{d.name}:{e.get('port')}" for e in entries if e not in keep]
            if keep:
                f.write_text(json.dumps(keep))
            else:
                f.unlink(missing_ok=True)
    with _lock:
        dead = [w for w in _active if w not in live]
    for w in dead:
        release(w)
        removed.append(f"{w}:forwarders")
    return removed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Ports:
    """A workspace's published ports (Workspace.ports)."""

    def __init__(self, ws_id: str, ws_dir: Path, init_pid: Callable[[], int], inside: Callable[[], list[str]]) -> None:
        self._id, self._dir, self._pid, self._inside = ws_id, ws_dir, init_pid, inside

    def publish(self, port: int, host_port: int = 0, host: str = "127.0.0.1") -> tuple[str, int]:
        """Reach the workspace's TCP `port` at the returned (host, port) of this machine, until
        unpublish() or the workspace's destroy. host_port 0 picks a free port."""
        return publish(self._id, self._dir, self._pid(), self._inside(), port, host, host_port)

    def unpublish(self, port: int) -> bool:
        return unpublish(self._id, self._dir, port)

    def list(self) -> dict[int, tuple[str, int]]:
        return published(self._id)
