"""Forking workspaces that have a network (paper §4.6): internal connections kept, external
ones closed in the clones and alive in the source, each clone online on its own.

The outside peer is a fake internet host in a namespace the test makes (fake_internet.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_internet import PORT, FakeHost, fake_host
from fork_support import COW, WORKLOADS, forked
from helpers import run_ok, wait_for

from bunshinfork.commands import CommandHandle
from bunshinfork.network import clones
from bunshinfork.workspace import Workspace

AGENT = "/root/netagent.py"
CLONES = 4

# Run inside a clone: a new connection to the fake host, one byte echoed.
CONNECT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(sys.argv[3].encode())
print(s.recv(64).decode())
"""


@pytest.fixture
def internet() -> Iterator[FakeHost]:
    with fake_host(0) as h:
        yield h


def netstate(ws: Workspace) -> tuple[int, str]:
    def probe() -> tuple[int, str] | None:
        raw = run_ok(ws, "cat /tmp/netstate 2>/dev/null || true").stdout.split(maxsplit=1)
        return (int(raw[0]), raw[1]) if len(raw) == 2 else None
    return wait_for(probe, timeout=10)


def start(ws: Workspace, host: FakeHost) -> None:
    ws.files.write(AGENT, (WORKLOADS / "netagent.py").read_text())
    ip = ws.info().network["ip"]
    h = ws.commands.run(f"exec python3 {AGENT} {ip} {host.addr} {PORT}", background=True)
    assert isinstance(h, CommandHandle)
    wait_for(lambda: netstate(ws)[1].startswith("alive") and netstate(ws)[0] > 5, timeout=15)


def advances(ws: Workspace) -> bool:
    first = netstate(ws)[0]
    return bool(wait_for(lambda: netstate(ws)[0] > first, timeout=10))


def check_family(src: Workspace, kids: list[Workspace], host: FakeHost) -> None:
    inside = run_ok(src, "ip -4 -o addr show eth0; ip -4 route; cat /etc/resolv.conf 2>/dev/null || true").stdout
    flows_before = len(host.seen())
    for ws in [src, *kids]:
        assert advances(ws), ws.id  # the internal pair, through eth0's address, survived
        assert run_ok(ws, "ip -4 -o addr show eth0; ip -4 route; cat /etc/resolv.conf 2>/dev/null || true"
                      ).stdout == inside
    # The source's external connection is alive and still carries traffic.
    ext_n = int(netstate(src)[1].split()[1])
    wait_for(lambda: netstate(src)[1].startswith("alive") and int(netstate(src)[1].split()[1]) > ext_n + 3,
             timeout=10)
    for ws in kids:
        # Closed at the first use after the fork, by a reset or EOF, never by a timeout.
        state = wait_for(lambda ws=ws: netstate(ws)[1] if netstate(ws)[1].startswith("closed") else None,
                         timeout=5)
        assert state in ("closed:ConnectionAbortedError", "closed:ConnectionResetError", "closed:EOF"), state
    # Nothing of an inherited flow reached the fake host: no new flow yet, only the echo of the
    # source's own bytes.
    assert len(host.seen()) == flows_before
    for i, ws in enumerate(kids):
        tag = f"clone{i}"
        assert run_ok(ws, ["python3", "-c", CONNECT, host.addr, str(PORT), tag], timeout=20).stdout.strip() == tag
    new = host.seen()[flows_before:]
    assert len(set(new)) == len(kids), new


@pytest.mark.parametrize("memory", ["copy", "ksm", COW])
@pytest.mark.parametrize("nat", [False, True], ids=["routed", "nat"])
def test_fork_keeps_internal_closes_external(internet: FakeHost, memory: str, nat: bool) -> None:
    with Workspace.create(network="bridge", nat=nat) as src:
        start(src, internet)
        kids = forked(src.fork(CLONES, memory))
        try:
            check_family(src, kids, internet)
            # A fork of a fork behaves the same.
            grand = forked(kids[0].fork(1, memory))
            try:
                state = wait_for(lambda: netstate(grand[0])[1], timeout=5)
                assert advances(grand[0])
                assert state.startswith("closed"), state
            finally:
                for g in grand:
                    g.destroy()
        finally:
            for k in kids:
                k.destroy()
    assert clones.table_rules() == []


def test_fork_of_a_saved_snapshot(internet: FakeHost, tmp_path: object) -> None:
    with Workspace.create(network="bridge") as src:
        start(src, internet)
        snap = src.snapshot("copy")
        try:
            path = snap.save(str(tmp_path) + "/saved").result(timeout=120)  # type: ignore[operator]
        finally:
            snap.release()
        from bunshinfork import Snapshot
        loaded = Snapshot.load(path)
        kids = forked(loaded.fork(2))
        try:
            check_family(src, kids, internet)
        finally:
            for k in kids:
                k.destroy()


def test_clone_rules_go_with_a_failed_fork(internet: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    from bunshinfork.process import restore

    def fail(_session: object) -> None:
        raise RuntimeError("injected restore failure")

    with Workspace.create(network="bridge") as src:
        start(src, internet)
        monkeypatch.setattr(restore, "RESTORE_HOOK", fail)
        results = src.fork(2, "copy")
        assert all(isinstance(r, Exception) for r in results), results
        assert clones.table_rules() == []
        assert clones.leftover_rules() == set()
        monkeypatch.setattr(restore, "RESTORE_HOOK", None)
        assert netstate(src)[1].startswith("alive")
