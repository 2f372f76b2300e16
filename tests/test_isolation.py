"""Isolation between two workspaces and the host (pid, mount, UTS, IPC and network namespaces),
and the PID-1 init every workspace runs."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_tcp_port, host_fd_targets, host_proc_state, run_ok, wait_for, ws_processes

from bunshinfork import native
from bunshinfork.commands import CommandHandle
from bunshinfork.errors import CommandTimeout
from bunshinfork.process import protocol
from bunshinfork.workspace import Workspace


@pytest.fixture
def pair() -> Iterator[tuple[Workspace, Workspace]]:
    a = Workspace.create()
    try:
        b = Workspace.create(hostname="box-b")
        try:
            yield a, b
        finally:
            b.destroy()
    finally:
        a.destroy()


def _background(ws: Workspace, cmd: str) -> CommandHandle:
    h = ws.commands.run(cmd, background=True)
    assert isinstance(h, CommandHandle)
    return h


def _ns_pid_to_host(ws: Workspace, ns_pid: int) -> int:
    """The host pid of a process known by its pid inside the workspace (NSpid's last field)."""
    for pid in ws._cgroup().pids():
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        nspid = next(line.split()[1:] for line in lines if line.startswith("NSpid:"))
        if int(nspid[-1]) == ns_pid:
            return pid
    raise AssertionError(f"no process with pid {ns_pid} inside {ws.id}")


# ---- two workspaces and the host ----


def test_pid_namespace(pair: tuple[Workspace, Workspace]) -> None:
    a, b = pair
    marker = f"sleep {4000 + secrets.randbelow(1000)}"
    h = _background(a, marker)
    wait_for(lambda: marker in ws_processes(a))
    assert run_ok(a, "cat /proc/1/comm").stdout == "init\n"
    assert run_ok(a, "echo $$").stdout.strip() != "1"
    pids_in_a = run_ok(a, ["ps", "-eo", "pid=,args="]).stdout
    assert f"{h.pid} {marker}" in " ".join(pids_in_a.split())
    # B sees only its own init, the shim serving the request, and ps itself.
    assert marker not in "\n".join(ws_processes(b))
    assert len(ws_processes(b)) == 3
    # On the host the same process has a different pid, one level up.
    host_pid = _ns_pid_to_host(a, h.pid)
    assert host_pid != h.pid
    status = Path(f"/proc/{host_pid}/status").read_text().splitlines()
    nspid = next(line for line in status if line.startswith("NSpid:"))
    assert nspid.split()[1:] == [str(host_pid), str(h.pid)]


def test_files_are_private(pair: tuple[Workspace, Workspace]) -> None:
    a, b = pair
    name = f"only-a-{secrets.token_hex(4)}"
    paths = [f"/root/{name}", f"/tmp/{name}", f"/usr/local/{name}", f"/etc/{name}"]
    run_ok(a, " && ".join(f"echo a > {p}" for p in paths))
    for p in paths:
        assert a.files.read(p) == "a\n"
        assert b.commands.run(["test", "-e", p]).exit_code == 1, f"{p} leaked into B"
        assert not b.files.exists(p)
        assert not os.path.exists(p), f"{p} leaked onto the host"


def test_hostnames(pair: tuple[Workspace, Workspace]) -> None:
    a, b = pair
    host_name = socket.gethostname()
    assert run_ok(a, "hostname").stdout == f"{a.id}\n"
    assert run_ok(a, "cat /etc/hostname").stdout == f"{a.id}\n"
    assert run_ok(b, "uname -n").stdout == "box-b\n"
    assert b.info().hostname == "box-b"
    assert "127.0.1.1\tbox-b" in run_ok(b, "cat /etc/hosts").stdout
    # Root inside lacks CAP_SYS_ADMIN, so it cannot rename the workspace itself ...
    assert a.commands.run("hostname renamed-a").exit_code != 0
    # ... but a name set in its UTS namespace (as fork does for clones) stays inside.
    native.set_hostname_in(a.init_pid, "renamed-a")
    assert run_ok(a, "hostname").stdout == "renamed-a\n"
    assert run_ok(b, "hostname").stdout == "box-b\n"
    assert socket.gethostname() == host_name


def test_sysv_ipc(pair: tuple[Workspace, Workspace]) -> None:
    a, b = pair
    created = run_ok(a, "ipcmk -M 4096").stdout
    assert "Shared memory id" in created
    rows = [line.split() for line in run_ok(a, "ipcs -m").stdout.splitlines() if line.startswith("0x")]
    assert len(rows) == 1 and rows[0][4] == "4096"
    key = rows[0][0]
    assert not [line for line in run_ok(b, "ipcs -m").stdout.splitlines() if line.startswith("0x")]
    host = subprocess.run(["ipcs", "-m"], capture_output=True, text=True, check=True).stdout
    assert key not in host


def test_network_is_loopback_only(ws: Workspace) -> None:
    assert run_ok(ws, "ls /sys/class/net").stdout.split() == ["lo"]
    links = run_ok(ws, "ip -o link show").stdout.splitlines()
    assert len(links) == 1 and ": lo:" in links[0]
    flags = links[0].split("<", 1)[1].split(">", 1)[0].split(",")
    assert "UP" in flags and "LOWER_UP" in flags
    assert "inet 127.0.0.1/8" in run_ok(ws, "ip -o addr show lo").stdout
    # Loopback works inside.
    run_ok(ws, ["python3", "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()"])


_SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", {port}))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(b"hello-from-a")
    c.close()
"""
_CLIENT = """
import socket
s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
print(s.recv(100).decode())
"""


def test_loopback_tcp_is_private(pair: tuple[Workspace, Workspace]) -> None:
    a, b = pair
    port = free_tcp_port()
    _background(a, f"exec python3 -c '{_SERVER.format(port=port)}'")
    client = ["python3", "-c", _CLIENT.format(port=port)]
    wait_for(lambda: a.commands.run(client).stdout == "hello-from-a\n")  # type: ignore[union-attr]
    r = b.commands.run(client)
    assert r.exit_code != 0 and "ConnectionRefusedError" in r.stderr
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# ---- the PID-1 init ----


def test_init_is_a_session_leader(ws: Workspace) -> None:
    fields = run_ok(ws, "cat /proc/1/stat").stdout.rsplit(")", 1)[1].split()
    # state ppid pgrp session
    assert (fields[1], fields[2], fields[3]) == ("0", "1", "1")
    assert os.getsid(ws.init_pid) == ws.init_pid


def test_init_holds_no_inherited_fds(ws: Workspace) -> None:
    targets = host_fd_targets(ws.init_pid)
    assert sorted(t for t in targets if not t.startswith(("socket:", "anon_inode:"))) == ["/dev/null"] * 3
    sockets = [t for t in targets if t.startswith("socket:")]
    assert len(sockets) == 1
    assert [t for t in targets if t.startswith("anon_inode:")] == ["anon_inode:[signalfd]"]
    assert len(targets) == 5
    # /dev/null is the workspace's own device node, and the socket is the control listener.
    st = os.stat(f"/proc/{ws.init_pid}/fd/0")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    inode = sockets[0][len("socket:["):-1]
    unix = Path(f"/proc/{ws.init_pid}/net/unix").read_text().splitlines()[1:]
    row = next(line.split() for line in unix if line.split()[6] == inode)
    assert row[7] == protocol.CTL_SOCK
    # The same view from inside.
    inside = run_ok(ws, "ls /proc/1/fd").stdout.split()
    assert inside == ["0", "1", "2", "3", "4"]


def test_orphans_are_reaped(ws: Workspace) -> None:
    # Each subshell exits at once, so its waiter is orphaned and adopted by PID 1; the waiters
    # exit together once /tmp/go appears, and only PID 1 can reap them.
    waiter = "while [ ! -e /tmp/go ]; do sleep 0.2; done"
    r = run_ok(ws, f"for i in $(seq 10); do ( ({waiter}) & echo $! ); done")
    orphans = [int(p) for p in r.stdout.split()]
    assert len(orphans) == 10
    ppids = run_ok(ws, " ".join(["cat"] + [f"/proc/{p}/stat" for p in orphans])).stdout.splitlines()
    assert [line.rsplit(")", 1)[1].split()[1] for line in ppids] == ["1"] * 10
    ws.files.write("/tmp/go", "")

    def all_gone() -> bool:
        states = run_ok(ws, "ps -eo stat=").stdout.split()
        alive = run_ok(ws, "; ".join(f"test -e /proc/{p} && echo {p}" for p in orphans) + "; true").stdout
        return not any(s.startswith("Z") for s in states) and not alive

    wait_for(all_gone, timeout=5)
    assert all(host_proc_state(p) != "Z" for p in ws._cgroup().pids())


def test_background_command_descends_from_init(ws: Workspace) -> None:
    h = _background(ws, "sleep 100")
    chain_script = (
        f"p={h.pid}; while [ $p -ne 1 ]; do "
        "p=$(awk '/^PPid/{print $2}' /proc/$p/status); echo $p $(cat /proc/$p/comm); done"
    )
    chain = [line.split() for line in run_ok(ws, chain_script).stdout.splitlines()]
    # sleep <- shim (a forked init) <- PID 1
    assert chain[-1] == ["1", "init"]
    assert len(chain) == 2 and chain[0][1] == "init"
    # On the host the whole chain is in the workspace's cgroup.
    assert _ns_pid_to_host(ws, h.pid) in ws._cgroup().pids()


def test_background_server_outlives_the_call(ws: Workspace) -> None:
    port = free_tcp_port()
    h = _background(ws, f"exec python3 -m http.server {port} --bind 127.0.0.1")
    fetch = ["python3", "-c",
             f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/').status)"]
    wait_for(lambda: ws.commands.run(fetch).stdout == "200\n")  # type: ignore[union-attr]
    for _ in range(3):
        run_ok(ws, "true")
    time.sleep(0.3)
    assert run_ok(ws, fetch).stdout == "200\n"
    assert any("http.server" in p for p in ws_processes(ws))
    # Still running: wait() times out, and carries the request log written so far.
    with pytest.raises(CommandTimeout) as ei:
        h.wait(timeout=0.2)
    assert '"GET / HTTP/1.1" 200' in ei.value.stderr


def _unix_rows(init_pid: int) -> list[list[str]]:
    return [line.split() for line in Path(f"/proc/{init_pid}/net/unix").read_text().splitlines()[1:]]


def _sockets_held(ws: Workspace) -> dict[int, list[str]]:
    out = {}
    for pid in ws._cgroup().pids():
        try:
            socks = [t for t in host_fd_targets(pid) if t.startswith("socket:")]
        except FileNotFoundError:
            continue  # exited meanwhile
        if socks:
            out[pid] = socks
    return out


def test_no_connection_to_the_host_between_calls(ws: Workspace) -> None:
    run_ok(ws, "echo foreground")
    _background(ws, "sleep 100")
    _background(ws, "sleep 200 > /tmp/out 2>&1 < /dev/null")
    # The workspace's network namespace holds one unix socket: the control listener.
    (row,) = _unix_rows(ws.init_pid)
    # Flags __SO_ACCEPTCON, state unconnected.
    assert row[3] == "00010000" and row[5] == "01" and row[7] == protocol.CTL_SOCK
    # A connection's server end belongs to the client's (the host's) namespace, so only the fds
    # tell: no process inside may hold any socket but the init's listener. A spawn's reply arrives
    # just before its shim closes the connection; allow it that moment.
    listener = {ws.init_pid: [f"socket:[{row[6]}]"]}
    wait_for(lambda: _sockets_held(ws) == listener, timeout=2)


def test_root_inside_cannot_reach_the_host() -> None:
    """Docker's default capabilities and masked /proc: no mounts, devices, modules or sysrq."""
    with Workspace.create() as ws:
        r = ws.commands.run(
            "grep CapEff /proc/self/status;"
            "echo b > /proc/sysrq-trigger 2>/dev/null; echo sysrq=$?;"
            "echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; echo procsys=$?;"
            "mknod /tmp/blk b 8 0 2>/dev/null; echo mknod=$?;"
            "mount -t tmpfs x /mnt 2>/dev/null; echo mount=$?;"
            "touch /tmp/f && chown nobody /tmp/f && echo chown=0"
        )
        lines = dict(line.split("=", 1) for line in r.stdout.split()[2:])
        eff = int(r.stdout.split()[1], 16)
        assert not eff & (1 << 21), "CAP_SYS_ADMIN must be dropped"
        assert not eff & (1 << 16), "CAP_SYS_MODULE must be dropped"
        assert eff & (1 << 0), "CAP_CHOWN is kept for package managers"
        assert lines["sysrq"] != "0" and lines["procsys"] != "0"
        assert lines["mknod"] != "0" and lines["mount"] != "0"
        assert lines["chown"] == "0"
    with Workspace.create(privileged=True) as ws:
        eff = int(ws.commands.run("grep CapEff /proc/self/status").stdout.split()[1], 16)
        assert eff & (1 << 21)
