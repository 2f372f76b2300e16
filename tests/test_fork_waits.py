"""What issue 40 took off the fork path by not waiting, and what it must not lose.

- CRIU started ahead (prestart.py): a dump and a restore run in CRIU processes that were idle
  before the call; idle ones end with their process, even one killed without its atexit; one
  that died while idle is never handed out.
- A CRIU that answered is reaped off its caller's path (criu.py), its record kept until then.
- CRIU patch 0011: the netfilter socket of a restore's network unlock stays open until CRIU
  exits (releasing it at the unlock waited out an RCU grace period).
- cgroup2's favordynmods (cgroups/dynmods.py) is turned on by the first workspace, unless the
  host opted out; a loaded snapshot's clones (serve's sandboxes) restore through a host yard
  (cgyard.host_yard), so their CRIU mounts no cgroup2 of its own, which reset the option.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import wait_for

from bunshinfork import Snapshot, Workspace, WorkspaceSpec
from bunshinfork.cgroups import cgroup, dynmods
from bunshinfork.process import cgyard, criu, sessions

ROOT = Path(__file__).resolve().parent.parent
NETLINK_NETFILTER = 12


def _stocked(n: int = 2) -> set[int]:
    wait_for(lambda: len(criu.PRESTARTED.idle()) >= n, timeout=30)
    return {s.pid for s in criu.PRESTARTED.idle()}  # type: ignore[attr-defined]


def _fork_and_answer(ws: Workspace) -> None:
    (c,) = ws.fork(1, memory="copy")
    assert not isinstance(c, Exception), c
    try:
        assert c.commands.run("echo hi").stdout == "hi\n"
    finally:
        c.destroy()


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return status.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_fork_runs_in_criu_started_before_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    with Workspace.create(WorkspaceSpec()) as ws:
        ws.fork(1, memory="copy")[0].destroy()  # asks for both kinds: from now on they are kept stocked
        idle = _stocked()
        hits = criu.PRESTARTED.stats.hits
        used: list[int] = []
        call = criu.Session.call

        def recording(self: criu.Session, *a: object, **k: object) -> object:
            used.append(self.pid)
            return call(self, *a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(criu.Session, "call", recording)
        _fork_and_answer(ws)
        assert len(used) == 2 and set(used) <= idle, (used, idle)  # the dump's and the restore's
        assert criu.PRESTARTED.stats.hits == hits + 2


def test_an_idle_criu_that_died_is_not_handed_out() -> None:
    with Workspace.create(WorkspaceSpec()) as ws:
        ws.fork(1, memory="copy")[0].destroy()
        for pid in _stocked():
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not any(s.alive() for s in criu.PRESTARTED.idle()), timeout=10)  # type: ignore[attr-defined]
        misses = criu.PRESTARTED.stats.misses
        _fork_and_answer(ws)
        assert criu.PRESTARTED.stats.misses >= misses + 1


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)"])
def test_idle_criu_end_with_their_process(exit_call: str) -> None:
    """os._exit skips atexit: the restore's idle CRIU dies by its parent-death signal, the dump's
    reads EOF on its socket."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from bunshinfork import Workspace, WorkspaceSpec
        from bunshinfork.process import criu
        with Workspace.create(WorkspaceSpec()) as ws:
            ws.fork(1, memory="copy")[0].destroy()
        deadline = time.monotonic() + 30
        while len(criu.PRESTARTED.idle()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        print(" ".join(str(s.pid) for s in criu.PRESTARTED.idle()), flush=True)
        {exit_call}
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2, r.stdout
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=10)


def test_an_answered_criu_is_reaped_off_the_callers_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """request() returns while CRIU's reaping is held up; the record stays until it is done."""
    release = threading.Event()
    held: list[int] = []
    close = criu.Session.close

    def slow_close(self: criu.Session) -> None:
        held.append(self.pid)
        assert release.wait(60)
        close(self)

    with Workspace.create(WorkspaceSpec()) as ws:
        monkeypatch.setattr(criu.Session, "close", slow_close)
        try:
            snap = ws.snapshot("copy")  # returns although its CRIU's close waits for `release`
            snap.release()
            wait_for(lambda: bool(held), timeout=10)
            assert (sessions._dir() / str(held[0])).exists()
        finally:
            release.set()
            criu.settle()
            monkeypatch.setattr(criu.Session, "close", close)
    assert not (sessions._dir() / str(held[0])).exists()
    assert not _alive(held[0])


def _netfilter_inodes(pid: int) -> set[str]:
    """Inodes of the NETLINK_NETFILTER sockets of `pid`'s network namespace."""
    out = set()
    for line in Path(f"/proc/{pid}/net/netlink").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1]) == NETLINK_NETFILTER:
            out.add(f[-1])
    return out


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_the_restores_unlock_socket_stays_open_until_criu_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """At post-resume, after the network unlock, CRIU still holds the netfilter socket it
    deleted the lock table through, in the clone's namespace (patch 0011)."""
    seen: dict[str, bool] = {}
    call = criu.Session.call

    def watching(self: criu.Session, req: object, on_notify: criu.Notify | None = None,
                 timeout: float | None = None) -> object:
        init: list[int] = []

        def notify(script: str, pid: int) -> None:
            if script == "setup-namespaces":
                init.append(pid)
            if script == "post-resume" and init:
                seen["held"] = bool(_netfilter_inodes(init[0]) & _socket_inodes(self.pid))
            if on_notify is not None:
                on_notify(script, pid)

        return call(self, req, notify, timeout)  # type: ignore[arg-type]

    with Workspace.create(WorkspaceSpec()) as ws:
        snap = ws.snapshot("copy")
        try:
            monkeypatch.setattr(criu.Session, "call", watching)
            (c,) = snap.fork(1)
            assert not isinstance(c, Exception), c
            c.destroy()
        finally:
            snap.release()
    assert seen == {"held": True}


MS_REMOUNT = 32


def _clear_favordynmods(mount_point: Path) -> None:
    """The kernel's remount sets exactly the options it is given (util-linux's merges them)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if fields[4] == str(mount_point) and tail[0] == "cgroup2":
            break
    else:
        pytest.skip(f"no cgroup2 mount at {mount_point}")
    flags = MS_REMOUNT
    for opt, bit in (("ro", 1), ("nosuid", 2), ("nodev", 4), ("noexec", 8), ("noatime", 1024),
                     ("nodiratime", 2048), ("relatime", 1 << 21)):
        if opt in fields[5].split(","):
            flags |= bit
    keep = ",".join(o for o in tail[2].split(",") if o not in ("rw", "ro", dynmods.OPTION))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(None, str(mount_point).encode(), None, flags, keep.encode()) != 0:
        pytest.skip(f"cannot remount {mount_point}: {os.strerror(ctypes.get_errno())}")
    assert dynmods.enabled(mount_point) is False


def test_the_first_workspace_turns_favordynmods_on(monkeypatch: pytest.MonkeyPatch) -> None:
    base = cgroup.cgroup2_root(cgroup.CGROUP_ROOT)
    _clear_favordynmods(base)
    try:
        monkeypatch.setattr(dynmods, "_tried", {})
        monkeypatch.setenv(dynmods.OPT_OUT_ENV, "0")
        with Workspace.create(WorkspaceSpec()):
            assert dynmods.enabled(base) is False  # the host opted out: left as it is
        monkeypatch.setattr(dynmods, "_tried", {})
        monkeypatch.delenv(dynmods.OPT_OUT_ENV)
        with Workspace.create(WorkspaceSpec()):
            assert dynmods.enabled(base) is True
    finally:
        monkeypatch.setattr(dynmods, "_tried", {})
        dynmods.ensure(base)  # the host as bunshin keeps it


def test_a_loaded_snapshots_clone_leaves_favordynmods_on(tmp_path: Path) -> None:
    """A snapshot loaded from disk has no yard of its own: without the host's, its clone's CRIU
    made one, and its cgroup2 mount without options cleared favordynmods host-wide (the kernel
    applies a cgroup2 mount's options to the hierarchy), so every later move waited again."""
    base = cgroup.cgroup2_root(cgroup.CGROUP_ROOT)
    if not dynmods.ensure(base):
        pytest.skip("favordynmods is not on here")
    with Workspace.create(WorkspaceSpec()) as ws:
        snap = ws.snapshot("copy")
        try:
            saved = snap.save(str(tmp_path / "saved")).result(timeout=120)  # type: ignore[union-attr]
        finally:
            snap.release()
    loaded = Snapshot.load(saved)
    try:
        assert cgyard.of(loaded.dir) is None  # nothing written into the saver's directory
        assert cgyard.of(loaded.dir, loaded.images_dir) == cgyard.host_yard(loaded.images_dir) is not None
        (c,) = loaded.fork(1)
        assert not isinstance(c, Exception), c
        try:
            log = (c.record.dir / "criu" / "restore.log").read_text(errors="replace")
            assert f"Opening {cgyard.host_yard(loaded.images_dir)} as cg yard" in log
            assert "Making controller dir" not in log
            assert c.id in Path(f"/proc/{c.init_pid}/cgroup").read_text()
        finally:
            c.destroy()
    finally:
        loaded.release()
    assert dynmods.enabled(base) is True


def test_a_host_yard_links_only_hierarchies() -> None:
    """A loaded snapshot's images are not ours: a name in its cgroup image that is a mount
    option (`rw`) or a path passes for no hierarchy, and gives no yard (CRIU makes its own)."""
    assert cgyard._links([["rw"]]) == {} and cgyard._links([["name=../x"]]) == {}
    mounted = [c for c in ("pids", "memory", "cpu") if any(c in o for o, _ in cgyard._host_mounts())]
    if mounted:
        assert cgyard._links([[mounted[0]]])


def test_a_forked_child_process_reaps_its_own_workspaces() -> None:
    """A process that forks after using bunshinfork: the child's inits are reaped by a reaper of
    its own (the copied poll object raised 'concurrent poll() invocation' in the child's reaper
    thread, so a child's init that died was left a zombie), and its CRIU work (started ahead,
    reaped off the path) has pools of its own."""
    script = textwrap.dedent("""
        import os, signal, time
        from bunshinfork import Workspace, WorkspaceSpec
        from bunshinfork.process import criu
        w = Workspace.create(WorkspaceSpec())
        w.fork(1)[0].destroy()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                c = Workspace.create(WorkspaceSpec())
                (k,) = c.fork(1)
                ok = k.commands.run("echo hi").stdout == "hi\\n"
                k.destroy()
                criu.settle(10)
                init = c.init_pid
                os.kill(init, signal.SIGKILL)  # dies on its own: only the reaper reaps it
                deadline = time.monotonic() + 10
                while os.path.exists(f"/proc/{init}") and time.monotonic() < deadline:
                    time.sleep(0.05)
                code = 0 if ok and not os.path.exists(f"/proc/{init}") else 2
                c.destroy()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        w.destroy()
        raise SystemExit(os.waitstatus_to_exitcode(status))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "concurrent poll()" not in r.stderr
