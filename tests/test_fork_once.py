"""What a fork does once per snapshot rather than once per clone, and clones forked together
restoring at the same time: read from each clone's own CRIU log and restore window."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fork_support import fork_of

from bunshinfork import Workspace, state
from bunshinfork.process import cgyard

# A listener and a connection to it over 127.0.0.1 inside the workspace: loopback is up.
LOOPBACK = ("python3 -c \"import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "c=socket.create_connection(s.getsockname(), timeout=5); a, _=s.accept(); c.sendall(b'ok'); "
            "print(a.recv(2).decode())\"")


@pytest.fixture(scope="module")
def src() -> Iterator[Workspace]:
    with Workspace.create() as ws:
        # A connection between two of its processes over loopback, open across the fork.
        ws.commands.run("python3 -c \"import socket, os, time; s=socket.socket(); s.bind(('127.0.0.1', 7070)); "
                        "s.listen(); os.fork() or (socket.create_connection(('127.0.0.1', 7070)), "
                        "time.sleep(1e6)); a, _=s.accept(); time.sleep(1e6)\" >/dev/null 2>&1 &")
        deadline = time.monotonic() + 10
        while not _established(ws):
            assert time.monotonic() < deadline, "the workspace's loopback connection never came up"
            time.sleep(0.05)
        yield ws


def _established(ws: Workspace) -> bool:
    """Both ends of the connection to port 7070 (0x1B9E) are ESTABLISHED (01)."""
    rows = [ln.split() for ln in ws.commands.run("cat /proc/net/tcp").stdout.splitlines()[1:]]
    ends = [r for r in rows if r[3] == "01" and (r[1].endswith(":1B9E") or r[2].endswith(":1B9E"))]
    return len(ends) == 2


def _restore_log(ws: Workspace) -> str:
    return (state.RUN_ROOT / ws.id / "criu" / "restore.log").read_text(errors="replace")


def test_one_cgroup_yard_serves_every_snapshot_of_the_host(src: Workspace) -> None:
    with src.snapshot("copy") as snap, src.snapshot("copy") as second, fork_of(snap, 2) as clones:
        # Nothing is made per snapshot (no stage after the thaw): the host's yard serves both.
        yard = cgyard.of(snap.dir, snap.images_dir)
        assert yard is not None and yard == cgyard.of(second.dir, second.images_dir)
        assert yard.parent.name == cgyard.HOST_YARDS and not (snap.dir / cgyard.YARD).exists()
        assert "cgyard" not in snap.timing.stages
        for c in clones:
            log = _restore_log(c)
            # Each clone's CRIU used the snapshot's yard and mounted no hierarchy of its own ...
            assert f"Opening {yard} as cg yard" in log
            assert "Making controller dir" not in log
            assert "cgyard" not in {k for k in c.info().timings if not k.startswith("snapshot.")}
            # ... and its tasks still went into the clone's own cgroup.
            assert c.id in Path(f"/proc/{c.init_pid}/cgroup").read_text()


def test_an_unprivileged_clone_gets_a_fresh_netns_with_loopback(src: Workspace) -> None:
    with src.snapshot("copy") as snap, fork_of(snap) as (c,):
        log = _restore_log(c)
        assert "Running ip " not in log and "iptables-restore" not in log
        assert c.commands.run(LOOPBACK).stdout.strip() == "ok"
        # The connection open across the fork was restored over the new loopback.
        assert _established(c)


def test_a_privileged_clone_has_its_netns_restored_by_criu() -> None:
    with Workspace.create(privileged=True) as ws, ws.snapshot("copy") as snap, fork_of(snap) as (c,):
        assert "ip addr dump replayed: done" in _restore_log(c)  # CRIU patch 0014
        assert c.commands.run(LOOPBACK).stdout.strip() == "ok"


def test_clones_forked_together_restore_at_the_same_time(src: Workspace) -> None:
    with src.snapshot("copy") as snap, fork_of(snap, 3) as clones:
        windows = [c.info().restore_window for c in clones]
        assert all(w is not None and w[0] < w[1] for w in windows), windows
        # Every restore had started before any had ended: no lock serialised them.
        assert max(w[0] for w in windows) < min(w[1] for w in windows), windows  # type: ignore[index]
