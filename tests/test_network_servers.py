"""Real servers (redis, nginx, memcached) in a bridged workspace, forked 4 ways: the client
inside keeps its connections in every clone, and a client outside reaches each clone's own
servers through that clone's published ports."""

from __future__ import annotations

import shutil
import socket

import pytest
from fork_support import WORKLOADS, forked
from helpers import run_ok, wait_for

from bunshinfork.commands import CommandHandle
from bunshinfork.workspace import Workspace

pytestmark = pytest.mark.skipif(not all(shutil.which(p) for p in ("redis-server", "memcached", "nginx")),
                                reason="needs redis-server, memcached and nginx (scripts/setup.sh installs them)")

NGINX_CONF = """
daemon off; pid /tmp/nginx.pid; error_log /tmp/nginx.err; worker_processes 1;
events { worker_connections 64; }
http { access_log off; client_body_temp_path /tmp; proxy_temp_path /tmp; fastcgi_temp_path /tmp;
       uwsgi_temp_path /tmp; scgi_temp_path /tmp;
       server { listen 8080; root /tmp/www; keepalive_requests 1000000; keepalive_timeout 600; } }
"""
SERVERS = {
    "redis": "exec redis-server --bind 0.0.0.0 --port 6379 --save '' --appendonly no --protected-mode no",
    "memcached": "exec memcached -u root -l 0.0.0.0 -p 11211",
    "nginx": "exec nginx -c /tmp/nginx.conf",
}
PORTS = {"redis": 6379, "memcached": 11211, "nginx": 8080}


def _bg(ws: Workspace, cmd: str) -> None:
    assert isinstance(ws.commands.run(cmd, background=True), CommandHandle)


def _state(ws: Workspace) -> tuple[int, int, int]:
    def probe() -> tuple[int, int, int] | None:
        raw = run_ok(ws, "cat /tmp/srvstate 2>/dev/null || true").stdout.split()
        return (int(raw[0]), int(raw[1]), int(raw[2])) if len(raw) == 3 else None
    return wait_for(probe, timeout=10)


def _talk(addr: tuple[str, int], payload: bytes, until: bytes) -> bytes:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(payload)
        got = b""
        while until not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        return got


def _outside(ws: Workspace, who: str) -> None:
    """Through this workspace's published ports: write `who` and read it back from each server."""
    addrs = {name: ws.ports.publish(port) for name, port in PORTS.items()}
    n = len(who)
    assert _talk(addrs["redis"], f"*3\r\n$3\r\nSET\r\n$3\r\nwho\r\n${n}\r\n{who}\r\n".encode(), b"\r\n") == b"+OK\r\n"
    assert who.encode() in _talk(addrs["redis"], b"*2\r\n$3\r\nGET\r\n$3\r\nwho\r\n", who.encode())
    assert _talk(addrs["memcached"], f"set who 0 0 {n}\r\n{who}\r\n".encode(), b"\r\n") == b"STORED\r\n"
    assert who.encode() in _talk(addrs["memcached"], b"get who\r\n", b"END\r\n")
    reply = _talk(addrs["nginx"], b"GET /who HTTP/1.0\r\n\r\n", who.encode())
    assert reply.startswith(b"HTTP/1.1 200") and reply.rstrip().endswith(who.encode()), reply


def test_real_servers_fork_four_ways() -> None:
    with Workspace.create(network="bridge") as src:
        ip = src.info().network["ip"]
        src.files.write("/tmp/nginx.conf", NGINX_CONF)
        run_ok(src, "mkdir -p /tmp/www && echo source > /tmp/www/who")
        for cmd in SERVERS.values():
            _bg(src, cmd)
        for port in PORTS.values():
            run_ok(src, ["python3", "-c", "import socket,sys,time\nfor _ in range(500):\n try:\n"
                         "  socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close(); break\n"
                         " except OSError: time.sleep(0.02)\nelse: sys.exit(1)", ip, str(port)], timeout=20)
        src.files.write("/root/srvclient.py", (WORKLOADS / "srvclient.py").read_text())
        _bg(src, f"exec python3 /root/srvclient.py {ip}")
        wait_for(lambda: _state(src)[0] > 5, timeout=15)
        kids = forked(src.fork(4, "copy"))
        try:
            for ws in [src, *kids]:
                before = _state(ws)
                wait_for(lambda ws=ws, b=before: all(x > y for x, y in zip(_state(ws), b, strict=True)), timeout=10)
            for ws in kids:
                run_ok(ws, f"echo {ws.id} > /tmp/www/who")
                _outside(ws, ws.id)
            _outside(src, "source")
        finally:
            for k in kids:
                k.destroy()


def test_a_server_with_connections_waiting_to_be_accepted_forks() -> None:
    """CRIU refuses to dump a connection still in a listener's accept queue unless told to skip
    it (--skip-in-flight); a server under load always has some, so a fork failed one time in
    five to fifteen (benchmarks/fork_workloads.py). The clone's listener keeps listening and
    takes a new connection; the queued one stays the source's, which still accepts it."""
    probe = ("import socket; s = socket.create_connection(('127.0.0.1', 7070), timeout=5); "
             "print('connected')")
    with Workspace.create() as ws:
        ws.files.write("/root/backlog.py", "import socket, time\n"
                       "srv = socket.socket(); srv.bind(('127.0.0.1', 7070)); srv.listen(8)\n"
                       "cli = socket.create_connection(('127.0.0.1', 7070)); cli.sendall(b'queued')\n"
                       "open('/tmp/queued', 'w').write('1')\n"
                       "time.sleep(3600)\n")
        _bg(ws, "exec python3 /root/backlog.py")
        wait_for(lambda: ws.files.exists("/tmp/queued"), timeout=10)
        (clone,) = forked(ws.fork(1))
        try:
            assert run_ok(clone, f"python3 -c \"{probe}\"").stdout.strip() == "connected"
            assert run_ok(clone, "pgrep -f backlog.py").stdout.strip()
        finally:
            clone.destroy()
        # The source runs on with its queue: the queued connection is still there to accept.
        queued = run_ok(ws, "ss -Htln sport = :7070").stdout.split()
        assert queued and int(queued[1]) >= 1, queued  # Recv-Q of a listener: connections queued
