"""Live-fork correctness on real CRIU forks: topology, carried kernel state, an X server,
repeated forks, snapshot durability, failure injection, btrfs layers and KSM merging.

Most tests fork one 512 MiB source (the agent workload, tests/workloads/agent.py) shared by
the module, because building and hashing it is the expensive part; each test destroys its
own clones, and the module's leak check runs after every test.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import btrfsutil  # type: ignore[import-not-found]
import pytest
from fork_support import (
    COW,
    WORKLOADS,
    XCLIENT,
    agent,
    fork_of,
    forked,
    host_pid,
    ksm_merging_pages,
    own_snapshots,
    report,
    settled_tree,
    start_agent,
)
from helpers import run_ok, wait_for
from workloads import agent as workload
from workloads import xclient

from bunshinfork import native
from bunshinfork.commands import CommandHandle
from bunshinfork.errors import BunshinError, ForkError, WorkspaceStateError
from bunshinfork.memory import ksm
from bunshinfork.process import criu, restore
from bunshinfork.workspace import Snapshot, Workspace

# The guest (qemu TCG, 10-30x slower than here) runs the cow parameters on a smaller source.
BIG_MIB = int(os.environ.get("BUNSHIN_TEST_BIG_MIB", "512"))
PAGE = 4096


@pytest.fixture(scope="module")
def big() -> Iterator[tuple[Workspace, dict[str, Any]]]:
    """The 512 MiB agent and what it reported when ready (its pattern's sha256 among it), next
    to a topology with more to get wrong: a session of its own whose leader was reparented to
    init, job-control process groups with a pipeline, and an unreaped zombie."""
    ws = Workspace.create()
    try:
        ready = start_agent(ws, BIG_MIB)
        ws.commands.run("setsid bash -c 'set -m; sleep 100000 | sleep 100000 & sleep 100000 & wait'",
                        background=True)
        # The subshell exits once its parent has become `sleep`, which never reaps it.
        ws.commands.run("(sleep 0.2; exit 3) & exec sleep 100000", background=True)
        wait_for(lambda: zombies(ws), timeout=10)
        yield ws, ready
    finally:
        ws.destroy()


def zombies(ws: Workspace) -> list[str]:
    """Zombies, as `ps` in the workspace shows them: they have left the cgroup's process list.

    Control shims (comm "init") that finished a request are zombies for the moment until the
    init reaps them; like tree(), this leaves those transient ones out.
    """
    rows = run_ok(ws, ["ps", "-eo", "pid=,ppid=,pgid=,sid=,stat=,comm="]).stdout.splitlines()
    return sorted(r.strip() for r in rows if r.split()[4].startswith("Z") and r.split()[5] != "init")


@pytest.fixture
def small() -> Iterator[Workspace]:
    """An agent with 8 MiB: everything the big one carries, cheap enough to fork 20 times."""
    ws = Workspace.create()
    try:
        start_agent(ws, 8)
        yield ws
    finally:
        ws.destroy()


def _our_children() -> set[int]:
    """Our child processes, less the idle CRIU started ahead for the next request (prestart.py)."""
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        out.update(int(p) for p in (task / "children").read_text().split())
    return out - {s.pid for s in criu.PRESTARTED.idle()}


def assert_state(ws: Workspace, ready: dict[str, Any], src: dict[str, Any], sha: bool = True) -> None:
    """Everything the agent set up before the fork is still there and still working in `ws`."""
    r = report(ws, sha=sha)
    if sha:
        assert r["big_sha"] == ready["big_sha"], "the 512 MiB pattern changed across the fork"
    assert r["big_len"] == ready["big_len"]
    assert r["threads"] == src["threads"]
    assert all(r["workers_advancing"]), f"a worker thread stopped: {r['workers_advancing']}"
    assert (r["pipe_pending"], r["pipe_data"]) == (len(workload.PIPE_DATA), workload.PIPE_DATA.decode())
    assert r["sockpair_data"] == workload.SOCKPAIR_DATA.decode()
    assert r["epoll_ready"] == [True], "epoll no longer reports the readable eventfd"
    assert r["eventfd"] == workload.EVENTFD_VALUE
    assert r["timer_expirations"] > 0, "the periodic timerfd stopped firing"
    assert r["disarmed_timer_expirations"] == 0, "a disarmed timerfd fired"
    assert r["signalfd_readable"] and r["sigusr1_pending"], "the blocked SIGUSR1 is no longer pending"
    assert r["sysv_ok"] and r["posix_ok"], "shared memory contents changed"
    assert (r["offset"], r["offset_bytes_ok"]) == (workload.OFFSET, True)
    assert r["ghost_ok"] and r["ghost_link"].endswith("(deleted)") and not r["ghost_path_exists"]
    # The very same TCP connection: a reconnect would have a new local port.
    assert (r["tcp_local"], r["tcp_peer"]) == (src["tcp_local"], src["tcp_peer"])


def peek_shm(ws: Workspace) -> dict[str, str]:
    return dict(json.loads(run_ok(ws, ["python3", "/root/agent.py", "--peek-shm"]).stdout))


# ---- 1 + 2: topology and state, private copies or copy-on-write ----


@pytest.mark.parametrize("memory", ["copy", COW])
def test_fork_keeps_topology_and_state(big: tuple[Workspace, dict[str, Any]], memory: str) -> None:
    ws, ready = big
    before = settled_tree(ws)
    agent_row = [p for p in before if p[5] == "python3"]
    assert len(agent_row) == 1 and agent_row[0][4] == 2 + workload.WORKERS  # main, tcp server, workers
    assert len({p[2] for p in before}) >= 2 and len({p[3] for p in before}) >= 4, before
    dead = zombies(ws)
    assert len(dead) == 1
    src = report(ws)
    base = agent(ws, "tcp", n=2)[-1]
    shm_before = peek_shm(ws)
    ws.files.write("/root/before-fork.txt", "shared history\n")

    with fork_of(ws, 2, memory) as clones:
        assert len({c.id for c in clones} | {ws.id}) == 3
        for c in clones:
            assert c.info().parent == ws.id
            if memory == "cow":
                # The pattern is mapped from the snapshot, not copied: most of it is not private.
                assert c.memory().uss < (BIG_MIB << 20) // 2, c.memory()
            # pid, ppid, sid, pgid, thread count and command of every process, as seen inside.
            assert settled_tree(c) == before
            assert zombies(c) == dead
            assert_state(c, ready, src)
        assert settled_tree(ws) == before
        assert zombies(ws) == dead

        # Each member counts on over its own copy of the one connection, from the fork's value.
        assert agent(clones[0], "tcp", n=3) == [base + 1, base + 2, base + 3]
        assert agent(clones[1], "tcp", n=1) == [base + 1]
        assert agent(ws, "tcp", n=2) == [base + 1, base + 2]

        # Shared memory is per clone: a write in one is seen by its own processes only.
        mark = agent(clones[0], "poke_shm", tag=clones[0].id)
        assert peek_shm(clones[0]) == {"sysv": mark, "posix": mark}
        assert peek_shm(clones[1]) == shm_before
        assert peek_shm(ws) == shm_before

        clones[1].files.write("/root/clone-only.txt", "mine\n")
        assert clones[0].files.read("/root/before-fork.txt") == "shared history\n"
        assert not clones[0].files.exists("/root/clone-only.txt")
        assert not ws.files.exists("/root/clone-only.txt")

    assert_state(ws, ready, src, sha=False)


# ---- 2 + 8: the KSM engine carries the same state and merges the copies ----


@pytest.mark.skipif(not ksm.available(), reason="kernel without KSM")
def test_ksm_fork_keeps_state_and_merges(big: tuple[Workspace, dict[str, Any]]) -> None:
    ws, ready = big
    before = settled_tree(ws)
    src = report(ws)
    base = agent(ws, "tcp", n=1)[-1]
    with fork_of(ws, 2, "ksm") as clones:
        for c in clones:
            assert settled_tree(c) == before
            assert_state(c, ready, src, sha=False)
            assert agent(c, "tcp", n=1) == [base + 1]
        pids = [host_pid(c, "python3") for c in clones]
        # Every page of the pattern differs from every other, so a process can only merge it
        # with another copy of it: more than half merged means the clones share their memory.
        pattern_pages = (BIG_MIB << 20) // PAGE
        wait_for(lambda: all(ksm_merging_pages(p) > pattern_pages // 2 for p in pids),
                 timeout=180, interval=0.5)
        # Other workspaces on the host may keep ksmd busy; settling is bounded, merging is not undone.
        ksm.tuner.wait_settled(timeout=20)
        for c, pid in zip(clones, pids, strict=True):
            assert "ksm_merge_any: yes" in Path(f"/proc/{pid}/ksm_stat").read_text()
            assert ksm_merging_pages(pid) > pattern_pages // 2
            assert c.memory().shared >= (BIG_MIB << 20) // 2
            assert agent(c, "big_sha") == ready["big_sha"], "merging changed a clone's memory"


# ---- 3: an X server and a connected client ----


@pytest.mark.parametrize("memory", ["copy", "ksm", COW])
def test_fork_x_server_with_client(memory: str) -> None:
    with Workspace.create() as ws:
        ws.files.write(XCLIENT, (WORKLOADS / "xclient.py").read_text())
        ws.commands.run("exec Xvfb :1 -nolisten tcp -screen 0 640x480x24", background=True)
        wait_for(lambda: ws.files.exists("/tmp/.X11-unix/X1"), timeout=15)
        ws.commands.run(f"exec python3 {XCLIENT} 1", background=True)
        wait_for(lambda: _xcount(ws) > 5, timeout=15)
        before = settled_tree(ws)
        assert [p[5] for p in before].count("Xvfb") == 1 and [p[5] for p in before].count("python3") == 1
        with fork_of(ws, 2, memory) as clones:
            for c in clones:
                assert settled_tree(c) == before
                # The client's connection, opened before the fork, keeps making round trips.
                first = _xcount(c)
                wait_for(lambda c=c, first=first: _xcount(c) > first + 3, timeout=10)
                # The server kept its windows, and takes new clients.
                info = run_ok(c, ["xwininfo", "-display", ":1", "-name", xclient.WINDOW_NAME.decode()])
                assert xclient.WINDOW_NAME.decode() in info.stdout
                assert "X.Org" in run_ok(c, ["xdpyinfo", "-display", ":1"]).stdout
            first = _xcount(ws)
            wait_for(lambda: _xcount(ws) > first + 3, timeout=10)
            run_ok(ws, ["xdpyinfo", "-display", ":1"])


def _xcount(ws: Workspace) -> int:
    try:
        return int(str(ws.files.read(xclient.COUNT_FILE)).strip() or 0)
    except BunshinError:
        return 0


# ---- the host process ----


_libc = ctypes.CDLL(None)
_ATFORK = ctypes.CFUNCTYPE(None)(("rand", _libc))
_atfork_registered: list[bool] = []


@pytest.mark.parametrize("memory", ["copy", "ksm", COW])
def test_fork_never_forks_the_host_process(memory: str) -> None:
    """fork() in this multi-threaded process runs every library's atfork handlers in it (numpy's
    OpenBLAS deadlocked parallel clones that way), so clones must be built without it.

    libc's rand() serves as the atfork handler: pure C, so no handler can itself deadlock on
    the GIL, and its sequence shows whether it ran. It stays registered (glibc cannot remove
    one) and is harmless: nothing in Python draws on libc's rand().
    """
    if not _atfork_registered:
        assert _libc.__register_atfork(_ATFORK, None, None, None) == 0
        _atfork_registered.append(True)
    _libc.srand(7)
    first = _libc.rand()
    with Workspace.create() as ws:
        _libc.srand(7)
        with fork_of(ws, 2, memory) as clones:
            assert _libc.rand() == first, "a fork() ran atfork handlers in the host process"
            for c in clones:
                # A clone keeps its source's hostname (CRIU restores the UTS namespace), set
                # without a fork() of the host.
                assert run_ok(c, "hostname").stdout.strip() == ws.id
                assert c.files.read("/etc/hostname") == ws.id + "\n"


# ---- 4: repeatability ----


@pytest.mark.parametrize("memory", ["copy", "ksm", COW])
def test_fork_of_a_fork(small: Workspace, memory: str) -> None:
    before = settled_tree(small)
    src = report(small)
    with fork_of(small, 1, memory) as (child,):
        agent(child, "set", k="generation", v="1")
        child.files.write("/root/generation", "1")
        with fork_of(child, 1, memory) as (grandchild,):
            assert grandchild.info().parent == child.id
            assert settled_tree(grandchild) == before
            assert_state(grandchild, {"big_len": 8 << 20}, src, sha=False)
            assert agent(grandchild, "state")["kv"] == {"generation": "1"}
            assert grandchild.files.read("/root/generation") == "1"
            agent(grandchild, "set", k="generation", v="2")
            assert agent(child, "state")["kv"] == {"generation": "1"}
    assert agent(small, "state")["kv"] == {}
    assert not small.files.exists("/root/generation")


# ---- identity: one rule for every engine and entrance ----

IDENTITY = "hostname; cat /etc/hostname /proc/sys/kernel/random/boot_id; uname -n; grep -c . /etc/hosts"


def test_clones_and_resumes_keep_their_sources_identity_and_a_create_gets_a_new_one() -> None:
    """A clone, a clone of that clone, and a workspace resumed from disk restore their source's
    memory, so each keeps its hostname and boot id: a tool whose output names the host says
    the same in a recording and its replay. A create (a cold boot) gets new ones. The id stays
    each workspace's own, in info()."""
    with Workspace.create() as src, Workspace.create() as other:
        seen = run_ok(src, IDENTITY).stdout
        host_boot_id = Path("/proc/sys/kernel/random/boot_id").read_text()
        name, _, boot_id, *_ = seen.splitlines()
        assert name == src.id and boot_id + "\n" != host_boot_id
        fresh = run_ok(other, IDENTITY).stdout.splitlines()
        assert fresh[:2] == [other.id, other.id] and fresh[2] not in (boot_id, host_boot_id.strip())
        # Read-only, as the kernel's is.
        assert src.commands.run("echo x > /proc/sys/kernel/random/boot_id").exit_code != 0
        with fork_of(src, 1, "copy") as (child,), fork_of(child, 1, "copy") as (grandchild,):
            for clone in (child, grandchild):
                assert run_ok(clone, IDENTITY).stdout == seen
                info = clone.info()
                assert (info.id, info.hostname) == (clone.id, src.id) and clone.id != src.id
            assert grandchild.info().parent == child.id
        src.pause_to_disk()
        src.resume_from_disk()
        assert run_ok(src, IDENTITY).stdout == seen
        assert src.info().id == src.id


def test_userns_and_sandbox_clones_keep_their_sources_identity() -> None:
    """The same rule through the other entrances: a user-namespace workspace's clone (its
    boot id a bind CRIU restores inside a user namespace) and an E2B Sandbox's fork."""
    from bunshinfork import Sandbox

    with Workspace.create(rootfs="debian", userns=True) as src:
        seen = run_ok(src, IDENTITY).stdout
        with fork_of(src, 1, "copy") as (clone,):
            assert run_ok(clone, IDENTITY).stdout == seen
    with Sandbox.create(timeout=60) as sbx:
        seen = sbx.commands.run(IDENTITY).stdout
        (child,) = sbx.fork(timeout=60)
        assert not isinstance(child, Exception), child
        with child:
            assert child.commands.run(IDENTITY).stdout == seen
            assert child.sandbox_id != sbx.sandbox_id


@pytest.mark.parametrize("memory", ["ksm", COW])
def test_fork_while_background_command_runs(memory: str) -> None:
    # Numbered lines until a go-file appears: the fork surely lands mid-command, each member
    # finishes only when told, and any line lost or doubled across the fork breaks the count.
    cmd = "i=0; until [ -e /root/go ]; do i=$((i+1)); echo line-$i; sleep 0.02; done; echo finished $i"
    with Workspace.create() as ws:
        h = ws.commands.run(cmd, background=True)
        assert isinstance(h, CommandHandle)
        out = f"/.bunshin/cmd/{h.cmd_id}"
        wait_for(lambda: "line-3\n" in str(ws.files.read(f"{out}/stdout")), timeout=10)
        with fork_of(ws, 2, memory) as clones:
            for i, c in enumerate(clones):
                c.files.write("/root/go", "")
                # No handle in the clone: the init records the exit status next to the output.
                wait_for(lambda c=c: c.files.exists(f"{out}/exit"), timeout=20)
                assert int(str(c.files.read(f"{out}/exit"))) == 0
                _assert_numbered(str(c.files.read(f"{out}/stdout")))
                for other in [ws, *clones[i + 1:]]:
                    assert not other.files.exists(f"{out}/exit"), "a go-file reached another member"
        ws.files.write("/root/go", "")
        r = h.wait(timeout=20)
        assert r.exit_code == 0
        _assert_numbered(r.stdout)


def _assert_numbered(stdout: str) -> None:
    *lines, last = stdout.splitlines()
    n = len(lines)
    assert n >= 3 and lines == [f"line-{i}" for i in range(1, n + 1)] and last == f"finished {n}", stdout


# cow in the guest: 8 forks (20 took 151 s of CI's 6.12 line under TCG); test_cow.py's sixteen
# clones from one snapshot cover the module at that count.
@pytest.mark.parametrize("memory,count", [pytest.param("copy", 20, id="copy"),
                                          pytest.param("cow", 8, marks=COW.marks, id="cow")])
def test_twenty_forks_from_one_snapshot(small: Workspace, memory: str, count: int) -> None:
    base = agent(small, "tcp", n=1)[-1]
    agent(small, "set", k="at-snapshot", v="yes")
    snaps_before = own_snapshots()
    with small.snapshot(memory) as snap:
        agent(small, "set", k="after-snapshot", v="source only")
        for i in range(count):
            (c,) = forked(snap.fork(1, memory))
            try:
                # Every clone starts from the snapshot, untouched by the clones before it.
                assert agent(c, "tcp", n=1) == [base + 1], f"fork {i}"
                assert agent(c, "state")["kv"] == {"at-snapshot": "yes"}, f"fork {i}"
                agent(c, "set", k="clone", v=str(i))
                c.files.write("/root/clone-was-here", str(i))
            finally:
                c.destroy()
    assert own_snapshots() == snaps_before
    assert agent(small, "state")["kv"] == {"at-snapshot": "yes", "after-snapshot": "source only"}
    assert not small.files.exists("/root/clone-was-here")


@pytest.mark.parametrize("memory", ["copy", COW])
def test_snapshot_save_and_load(big: tuple[Workspace, dict[str, Any]], tmp_path: Path, memory: str) -> None:
    """A cow snapshot's save reads its holders' memory into complete images: it loads as one
    that any engine but cow can fork."""
    ws, ready = big
    src = report(ws)
    base = agent(ws, "tcp", n=1)[-1]
    dest = tmp_path / "saved"
    with ws.snapshot(memory) as snap:
        if memory == "copy":
            # Kept in images, the snapshot costs at least what they hold.
            assert snap.retained_bytes() >= snap.image_bytes() >= (BIG_MIB << 20)
        assert snap.save(dest).result(timeout=300) == str(dest)
    try:
        loaded = Snapshot.load(dest)
        assert agent(ws, "tcp", n=1) == [base + 1]  # the source moved on after the snapshot
        with fork_of(loaded) as (c,):
            assert_state(c, ready, src)
            assert agent(c, "tcp", n=1) == [base + 1]
        loaded.release()
        assert (dest / "snapshot.json").exists(), "release() must not delete a loaded snapshot"
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def test_a_loaded_copy_never_releases_its_original(tmp_path: Path) -> None:
    """A saved snapshot loaded on the host where its original still lives carries the original's
    id. Its release marked the original released, and the next release beside it (a clone's
    destroy) removed the original's layer: the original's forks then failed with 'mount
    .../rootfs: No such file or directory'. Either order of release leaves the other whole."""
    with Workspace.create() as ws:
        ws.files.write("/root/mark", "kept")
        for first in ("loaded", "original"):
            original = ws.snapshot()
            [live] = original.fork(1)  # a clone of the original, destroyed after the copy's release
            dest = tmp_path / f"saved-{first}"
            original.save(dest).result(timeout=120)
            loaded = Snapshot.load(dest)
            with fork_of(loaded) as (c,):
                assert c.files.read("/root/mark") == "kept"
            keep, drop = (original, loaded) if first == "loaded" else (loaded, original)
            drop.release()
            live.destroy()
            [again] = keep.fork(1)
            try:
                assert isinstance(again, Workspace) and again.files.read("/root/mark") == "kept"
            finally:
                again.destroy()
                keep.release()


# ---- 6: failures ----


@pytest.mark.timeout(240)  # a criu death that goes unnoticed hangs the fork: fail, do not wait 10 min
@pytest.mark.parametrize("memory", ["copy", COW])
def test_criu_killed_mid_restore(big: tuple[Workspace, dict[str, Any]], memory: str) -> None:
    """One of three restores loses its CRIU while the tasks are already rebuilding memory."""
    ws, ready = big
    before = settled_tree(ws)
    src = report(ws)
    children = _our_children()
    snaps_before = own_snapshots()
    killed: list[int] = []
    seen_marker: list[bool] = []
    lock = threading.Lock()

    def kill_when_restoring_memory(session: criu.Session) -> None:
        # restore.log is found through criu's own descriptors; "Opening 0x...vma" lines mean
        # the namespaces, mounts, cgroup and tasks exist and memory is being restored.
        deadline = time.monotonic() + 60
        log: str | None = None
        while time.monotonic() < deadline:
            if log is None:
                log = _fd_target(session.pid, "/criu/restore.log")
            elif re.search(r"Opening 0x[0-9a-f]+-0x[0-9a-f]+ .* vma", Path(log).read_text(errors="replace")):
                seen_marker.append(True)
                break
            time.sleep(0.002)
        session.kill()

    def hook(session: criu.Session) -> None:
        with lock:
            if killed:
                return
            killed.append(session.pid)
        threading.Thread(target=kill_when_restoring_memory, args=(session,), daemon=True).start()

    restore.RESTORE_HOOK = hook
    try:
        results = ws.fork(3, memory=memory)
    finally:
        restore.RESTORE_HOOK = None
    try:
        assert seen_marker == [True], "criu was not caught mid-restore"
        failed = [r for r in results if isinstance(r, Exception)]
        assert len(failed) == 1 and isinstance(failed[0], ForkError), results
        assert "died without answering" in str(failed[0]) or "exited without answering" in str(failed[0])
        survivors = [r for r in results if isinstance(r, Workspace)]
        assert len(survivors) == 2
        for c in survivors:
            assert settled_tree(c) == before
            assert agent(c, "big_sha") == ready["big_sha"]
        assert settled_tree(ws) == before
        assert_state(ws, ready, src)
    finally:
        for r in results:
            if isinstance(r, Workspace):
                r.destroy()
    # The half-restored init was our child: it must be neither running nor a zombie.
    wait_for(lambda: _our_children() <= children, timeout=10)
    assert own_snapshots() == snaps_before


def _fd_target(pid: int, suffix: str) -> str | None:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith(suffix):
            return target
    return None


@pytest.fixture
def small_tmpfs() -> Iterator[str]:
    """A 64 MiB tmpfs of our own, as a workspace's storage_dir, so its disk can be filled."""
    mp = "/var/tmp/bunshin-fork-enospc"
    os.makedirs(mp, exist_ok=True)
    native.mount("tmpfs", mp, "tmpfs", 0, "size=64m,mode=0700")
    try:
        yield mp
    finally:
        native.umount2(mp, native.MNT_DETACH)
        os.rmdir(mp)


@pytest.mark.parametrize("memory", ["copy", COW])
def test_fork_with_full_disk(small_tmpfs: str, memory: str) -> None:
    snaps_before = own_snapshots()
    with Workspace.create(storage_dir=small_tmpfs) as ws:
        ws.files.write("/root/keep.txt", "precious\n")
        h = ws.commands.run("exec sleep 1000", background=True)
        assert isinstance(h, CommandHandle)
        r = ws.commands.run("dd if=/dev/zero of=/root/fill bs=1M")
        assert r.exit_code != 0 and "No space left on device" in r.stderr
        before = settled_tree(ws)

        # Storage that cannot copy-on-write copies the layer once, at the snapshot: that fails.
        with pytest.raises(ForkError, match="No space left on device"):
            ws.fork(1, memory=memory)

        assert ws.is_running() and settled_tree(ws) == before
        assert ws.files.read("/root/keep.txt") == "precious\n"
        assert run_ok(ws, "cat /root/keep.txt; echo alive").stdout == "precious\nalive\n"
        layers = Path(small_tmpfs, "bunshin-layers")
        assert sorted(os.listdir(layers)) == sorted([ws.id, "snapshots"]), "the failed fork left a layer"
        assert os.listdir(layers / "snapshots") == [], "the failed snapshot left its copy"

        # Room again: the same workspace forks fine.
        ws.files.remove("/root/fill")
        with fork_of(ws, 1, memory) as (c,):
            assert c.files.read("/root/keep.txt") == "precious\n"
            assert settled_tree(c) == before
    assert own_snapshots() == snaps_before


def test_fork_destroyed_workspace_is_typed_error() -> None:
    ws = Workspace.create()
    ws.destroy()
    with pytest.raises(WorkspaceStateError, match="not running"):
        ws.fork(1, memory="copy")
    with pytest.raises(WorkspaceStateError):
        ws.snapshot()


def test_released_snapshot_cannot_fork(small: Workspace) -> None:
    snap = small.snapshot()
    snap.release()
    with pytest.raises(WorkspaceStateError, match="released"):
        snap.fork(1, "copy")


# ---- 7: btrfs layers ----


def test_fork_on_btrfs(btrfs_dir: str) -> None:
    with Workspace.create(storage_dir=btrfs_dir) as ws:
        ws.files.write("/root/base.txt", "base\n")
        ws.commands.run("exec sleep 1000", background=True)
        before = settled_tree(ws)
        with fork_of(ws, 2) as clones:
            for c in clones:
                layer = c._rec.fs.layer
                assert layer.kind == "btrfs"
                assert btrfsutil.is_subvolume(layer.path)
                assert not btrfsutil.get_subvolume_read_only(layer.path)
                assert Path(layer.path).parent == Path(btrfs_dir, "bunshin-layers")
                assert settled_tree(c) == before
                assert c.files.read("/root/base.txt") == "base\n"
            clones[0].files.write("/root/base.txt", "changed in clone 0\n")
            run_ok(clones[1], "echo from-clone-1 > /root/only-1.txt")
            ws.files.write("/root/after.txt", "source after the fork\n")
            assert clones[1].files.read("/root/base.txt") == "base\n"
            assert ws.files.read("/root/base.txt") == "base\n"
            assert not clones[0].files.exists("/root/only-1.txt")
            assert not ws.files.exists("/root/only-1.txt")
            assert not any(c.files.exists("/root/after.txt") for c in clones)
            paths = [c._rec.fs.layer.path for c in clones]
        assert not any(os.path.exists(p) for p in paths), "destroy left a subvolume"
