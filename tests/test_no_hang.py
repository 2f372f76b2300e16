"""A fork never hangs and never changes its source (issue: stopped, traced and vDSO-less
processes; sparse deleted files; deadlines on CRIU; the freeze watchdog). Each test that
could hang carries a deadline of its own (pytest-timeout), so a hang fails it in bounded time.

Everything here is real: job-control stops, strace, a process that unmapped its vDSO, CRIU
stuck in PTRACE_SEIZE on a v1-frozen stopped task, a forking process killed with SIGKILL
while its source is frozen.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fork_support import COW, fork_of, own_snapshots, settled_tree
from helpers import run_ok, wait_for

from bunshinfork import deadlines, native, pipeline, process, snapshot, state
from bunshinfork.cgroups import watchdog
from bunshinfork.errors import CriuTimeout, ForkError
from bunshinfork.memory import holders
from bunshinfork.process import criu
from bunshinfork.workspace import Snapshot, Workspace

# ---- stopped processes ----

COUNTER = """import sys, time
n = 0
while True:
    n += 1
    open(sys.argv[1], "w").write(str(n))
    time.sleep(0.02)
"""


def _state(ws: Workspace, pid: int) -> str:
    return run_ok(ws, f"cut -d' ' -f3 /proc/{pid}/stat").stdout.strip()


def _count(ws: Workspace, path: str) -> int:
    return int(str(ws.files.read(path)) or 0)


def _tty(ws: Workspace, keys: str) -> None:
    """Type into the interactive shell's terminal (a pty that `script` runs it on), from inside:
    the files API writes regular files only (a FIFO planted by the sandbox could block the host)."""
    ws.commands.run(["sh", "-c", 'printf %s "$1" > /root/tty.in', "sh", keys])


def _jobs(ws: Workspace) -> str:
    with contextlib.suppress(FileNotFoundError):
        ws.files.remove("/root/jobs.txt")
    _tty(ws, "jobs -l > /root/jobs.tmp; mv /root/jobs.tmp /root/jobs.txt\n")
    wait_for(lambda: ws.files.exists("/root/jobs.txt"))
    return str(ws.files.read("/root/jobs.txt"))


def _assert_stopped_then_resumes(ws: Workspace, plain: int, job: int) -> None:
    """Both processes are stopped and count no more; the shell still lists its job as stopped;
    SIGCONT and the shell's own `bg` make them count again."""
    assert _state(ws, plain) == "T" and _state(ws, job) == "T", ws.id
    assert "Stopped" in _jobs(ws)
    frozen_at = {name: _count(ws, f"/tmp/{name}") for name in ("plain", "job")}
    time.sleep(0.15)
    assert {name: _count(ws, f"/tmp/{name}") for name in ("plain", "job")} == frozen_at
    run_ok(ws, f"kill -CONT {plain}")
    _tty(ws, "bg %1\n")
    for name in frozen_at:
        wait_for(lambda name=name: _count(ws, f"/tmp/{name}") > frozen_at[name], timeout=5)
    assert "Running" in _jobs(ws)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("memory", ["copy", COW])
def test_fork_keeps_stopped_processes_stopped(memory: str) -> None:
    """`kill -STOP`, and an interactive shell's job suspended by Ctrl-Z on its terminal: the v1
    freezer made CRIU wait forever in PTRACE_SEIZE for these (see bunshinfork.cgroups)."""
    with Workspace.create() as ws:
        ws.files.write("/root/counter.py", COUNTER)
        ws.commands.run("exec python3 /root/counter.py /tmp/plain", background=True)
        run_ok(ws, "mkfifo /root/tty.in")
        ws.commands.run("exec sleep 100000 3>/root/tty.in", background=True)  # keeps the fifo open
        ws.commands.run("exec script -qfc 'bash --norc --noprofile -i' /dev/null < /root/tty.in > /root/tty.out",
                        background=True)
        # The shell opens the fifo before it execs script: from then on it has a reader.
        wait_for(lambda: run_ok(ws, "pgrep -x script || true").stdout.strip())
        _tty(ws, "python3 /root/counter.py /tmp/job\n")
        wait_for(lambda: ws.files.exists("/tmp/job") and ws.files.exists("/tmp/plain"))
        _tty(ws, "\x1a")  # Ctrl-Z
        plain = int(run_ok(ws, "pgrep -f 'counter.py /tmp/plain'").stdout)
        job = int(run_ok(ws, "pgrep -f 'counter.py /tmp/job'").stdout)
        run_ok(ws, f"kill -STOP {plain}")
        wait_for(lambda: _state(ws, job) == "T" and _state(ws, plain) == "T")
        before = settled_tree(ws)

        t0 = time.monotonic()
        with fork_of(ws, 2, memory) as clones:
            assert time.monotonic() - t0 < 30
            for c in clones:
                assert settled_tree(c) == before
                _assert_stopped_then_resumes(c, plain, job)
            assert settled_tree(ws) == before
            _assert_stopped_then_resumes(ws, plain, job)


# ---- traced processes ----


@pytest.mark.timeout(60)
def test_fork_refuses_a_traced_process_at_once() -> None:
    with Workspace.create() as ws:
        ws.commands.run("exec strace -f -o /dev/null sleep 1000", background=True)
        wait_for(lambda: run_ok(ws, "grep -l '^TracerPid:[[:space:]]*[1-9]' /proc/[0-9]*/status || true").stdout)
        before = settled_tree(ws)
        snaps = own_snapshots()
        t0 = time.monotonic()
        with pytest.raises(ForkError, match=r"process \d+ \(sleep\) is traced by process \d+ \(strace\)"):
            ws.fork(1, memory="copy")
        assert time.monotonic() - t0 < 5, "a traced process must be refused before CRIU retries"
        assert not ws._cgroup().frozen()
        assert settled_tree(ws) == before
        assert own_snapshots() == snaps
        # Once the tracer is gone the same workspace forks.
        run_ok(ws, "pkill -x strace; sleep 0.2; pkill -x sleep || true")
        with fork_of(ws, 1, "copy") as (c,):
            assert run_ok(c, "echo ok").stdout == "ok\n"


# ---- the vDSO ----

NO_VDSO_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <stdio.h>
#include <unistd.h>
/* argv[1]: unmap the maps whose name starts with it ("[v" = [vdso], [vvar], [vvar_vclock]). */
int main(int argc, char **argv) {
    char line[512];
    unsigned long r[8][2];
    int n = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    while (fgets(line, sizeof line, f) && n < 8) {
        char *name = strchr(line, '[');
        if (name && strncmp(name, argv[1], strlen(argv[1])) == 0 && !strstr(name, "vsyscall")) {
            sscanf(line, "%lx-%lx", &r[n][0], &r[n][1]);
            n++;
        }
    }
    fclose(f);
    for (int i = 0; i < n; i++)
        if (munmap((void *)r[i][0], r[i][1] - r[i][0]))
            return 2;
    int fd = open("/root/unmapped", O_WRONLY | O_CREAT, 0644);
    close(fd);
    for (;;)
        pause();
}
"""


@pytest.fixture(scope="module")
def no_vdso(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("novdso")
    (d / "novdso.c").write_text(NO_VDSO_C)
    subprocess.run(["cc", "-O1", "-o", str(d / "novdso"), str(d / "novdso.c")], check=True)
    return (d / "novdso").read_bytes()


def _start_unmapped(ws: Workspace, binary: bytes, prefix: str) -> None:
    ws.files.write("/root/novdso", binary, mode=0o755)
    ws.commands.run(f"exec /root/novdso '{prefix}'", background=True)
    wait_for(lambda: ws.files.exists("/root/unmapped"))


@pytest.mark.timeout(60)
def test_fork_of_a_process_without_vdso(no_vdso: bytes) -> None:
    with Workspace.create() as ws:
        _start_unmapped(ws, no_vdso, "[v")
        pid = int(run_ok(ws, "pgrep -x novdso").stdout)
        assert "[vdso]" not in run_ok(ws, f"cat /proc/{pid}/maps").stdout
        with fork_of(ws, 1, "copy") as (c,):
            maps = run_ok(c, f"cat /proc/{pid}/maps").stdout
            assert "[vdso]" not in maps and "[vvar" not in maps
            assert _state(c, pid) == "S"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("gone", ["[vdso]", "[vvar"])
def test_fork_refuses_a_half_unmapped_vdso_at_once(no_vdso: bytes, gone: str) -> None:
    """CRIU dumps these, then every clone dies in its restorer: refuse before freezing long."""
    with Workspace.create() as ws:
        _start_unmapped(ws, no_vdso, gone)
        t0 = time.monotonic()
        with pytest.raises(ForkError, match=r"process \d+ \(novdso\) unmapped its \[v"):
            ws.fork(1, memory="copy")
        assert time.monotonic() - t0 < 5
        assert _state(ws, int(run_ok(ws, "pgrep -x novdso").stdout)) == "S"


# ---- the source is never changed: deleted, sparse, open files ----

# Opens, fills, unlinks and keeps open one file per path: a big one (CRIU copies it in chunks,
# by SEEK_DATA/SEEK_HOLE) with holes at its head, in its middle and at its tail, and a small
# one (copied whole) that starts with a hole. It writes their layouts and digests to
# /root/sparse.json at start and whenever /root/sparse.ask appears.
SPARSE = r"""
import hashlib, json, os, sys, time
M = 1 << 20
fds = {}
for d in sys.argv[1:]:
    for kind, chunks, size in (("big", [(2 * M, b"A" * 65536), (4 * M, b"B" * 8192)], 8 * M),
                               ("small", [(4096, b"C" * 4096)], 8192)):
        path = f"{d}/sparse-{kind}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        for off, data in chunks:
            os.pwrite(fd, data, off)
        os.ftruncate(fd, size)
        os.unlink(path)
        fds[path] = fd

def layout(fd):
    out, off, size = [], 0, os.fstat(fd).st_size
    while off < size:
        try:
            data = os.lseek(fd, off, os.SEEK_DATA)
        except OSError:
            break
        off = os.lseek(fd, data, os.SEEK_HOLE)
        out.append([data, off])
    return out

def report():
    r = {p: {"layout": layout(fd), "size": os.fstat(fd).st_size, "links": os.fstat(fd).st_nlink,
             "sha": hashlib.sha256(os.pread(fd, 16 * M, 0)).hexdigest()} for p, fd in fds.items()}
    open("/root/sparse.tmp", "w").write(json.dumps(r))
    os.rename("/root/sparse.tmp", "/root/sparse.json")

report()
while True:
    time.sleep(0.02)
    if os.path.exists("/root/sparse.ask"):
        os.unlink("/root/sparse.ask")
        report()
"""
SPARSE_DIRS = ("/root", "/tmp", "/dev/shm")  # the overlay's upper layer, and two tmpfs mounts


def _sparse_report(ws: Workspace) -> dict:
    """The holder's report, asked for afresh (the first one when it has just started)."""
    if ws.files.exists("/root/sparse.json"):
        ws.files.remove("/root/sparse.json")
        ws.files.write("/root/sparse.ask", "")
    wait_for(lambda: ws.files.exists("/root/sparse.json"), timeout=30)
    return json.loads(str(ws.files.read("/root/sparse.json")))


def _dense_small(report: dict) -> dict:
    return {p: {k: v for k, v in f.items() if k != "layout" or f["size"] >= 12 << 10} for p, f in report.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage_kind", ["tmpfs", "btrfs"])
@pytest.mark.parametrize("memory", ["copy", COW])
def test_fork_keeps_deleted_sparse_files_exactly(storage_kind: str, memory: str, request: pytest.FixtureRequest
                                                 ) -> None:
    spec = {"storage_dir": request.getfixturevalue("btrfs_dir")} if storage_kind == "btrfs" else {}
    with Workspace.create(**spec) as ws:
        ws.files.write("/root/sparse.py", SPARSE)
        ws.commands.run("exec python3 /root/sparse.py " + " ".join(SPARSE_DIRS), background=True)
        want = _sparse_report(ws)
        assert want["/root/sparse-big"]["layout"] == [[2 << 20, (2 << 20) + 65536], [4 << 20, (4 << 20) + 8192]]
        assert want["/tmp/sparse-small"]["layout"] == [[4096, 8192]]
        assert all(f["links"] == 0 for f in want.values())
        with fork_of(ws, 1, memory) as (c,):
            assert _sparse_report(ws) == want, "the fork changed the source's deleted files"
            # CRIU copies a ghost file under 12 KiB whole, so the clone's small files come back
            # dense; their content, and everything about the big ones, is what the source has.
            assert _dense_small(_sparse_report(c)) == _dense_small(want), "the clone's deleted files differ"


# ---- deadlines ----

V1_FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not (V1_FREEZER / "tasks").exists(), reason="needs a cgroup v1 freezer hierarchy")
def test_criu_deadline_kills_a_criu_stuck_in_ptrace_seize(tmp_path: Path) -> None:
    """The original hang, on purpose: a SIGSTOPped task in a v1-frozen cgroup makes CRIU's
    PTRACE_SEIZE wait for ever. The deadline kills it, and the task is left as it was."""
    cg = V1_FREEZER / f"bunshin-test-{os.getpid()}"
    cg.mkdir()
    victim = subprocess.Popen(["sleep", "1000"])
    try:
        (cg / "cgroup.procs").write_text(str(victim.pid))
        os.kill(victim.pid, signal.SIGSTOP)
        wait_for(lambda: Path(f"/proc/{victim.pid}/stat").read_text().split()[2] == "T")
        (cg / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (cg / "freezer.state").read_text().strip() == "FROZEN")
        opts = process.dump_opts(victim.pid, tmp_path, str(cg))
        t0 = time.monotonic()
        with pytest.raises(CriuTimeout, match="did not answer within 2s"):
            criu.request("dump", opts, log=tmp_path / "dump.log", timeout=2)
        assert 2 <= time.monotonic() - t0 < 10
        (cg / "freezer.state").write_text("THAWED")
        wait_for(lambda: Path(f"/proc/{victim.pid}/stat").read_text().split()[2] == "T")
        status = Path(f"/proc/{victim.pid}/status").read_text()
        assert "TracerPid:\t0\n" in status, "the killed CRIU still traces the task"
    finally:
        victim.kill()
        victim.wait()
        with contextlib.suppress(OSError):
            (cg / "freezer.state").write_text("THAWED")
        wait_for(lambda: not (cg / "cgroup.procs").read_text().split())
        cg.rmdir()


def test_deadlines_are_configurable_and_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    d = deadlines.current()
    assert (d.criu, d.inject, d.frozen, d.freeze) == (60.0, 5.0, 60.0, 10.0) or "BUNSHIN_CRIU_TIMEOUT" in os.environ
    try:
        assert deadlines.configure(criu=5).criu == 5
        with pytest.raises(ValueError, match="positive"):
            deadlines.configure(inject=0)
        with pytest.raises(ValueError, match="unknown deadline"):
            deadlines.configure(criuu=1)
    finally:
        deadlines.configure(**{k: getattr(d, k) for k in ("criu", "inject", "frozen", "freeze")})
    monkeypatch.setenv("BUNSHIN_FROZEN_TIMEOUT", "7.5")
    assert deadlines._from_env().frozen == 7.5


# ---- the freeze watchdog ----


def _start_ticker(ws: Workspace) -> None:
    ws.files.write("/root/counter.py", COUNTER)
    ws.commands.run("exec python3 /root/counter.py /tmp/tick", background=True)
    wait_for(lambda: ws.files.exists("/tmp/tick"))


def _stopping_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop CRIU (SIGSTOP) as soon as the freeze's watchdog is given it: a CRIU stuck mid-dump,
    the source frozen meanwhile."""
    real = watchdog.Watchdog.register

    def register(self: watchdog.Watchdog, pid: int) -> None:
        real(self, pid)
        os.kill(pid, signal.SIGSTOP)

    monkeypatch.setattr(watchdog.Watchdog, "register", register)


@pytest.mark.timeout(60)
def test_watchdog_kills_a_stuck_criu_and_thaws_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our own deadline on CRIU is put past the watchdog's here, so that the watchdog is what acts:
    at `frozen` it kills the CRIU it was given and thaws the source."""
    with Workspace.create() as ws:
        _start_ticker(ws)
        before = settled_tree(ws)
        saved = deadlines.current()
        deadlines.configure(frozen=2.0)
        monkeypatch.setattr(snapshot, "FREEZE_MARGIN", -20.0)
        _stopping_criu(monkeypatch)
        try:
            t0 = time.monotonic()
            with pytest.raises(ForkError):
                Snapshot.take(ws, "copy")
            elapsed = time.monotonic() - t0
        finally:
            deadlines.configure(frozen=saved.frozen)
        assert elapsed < 15
        (event,) = watchdog.events(ws.id)
        assert event["reason"] == "deadline" and event["helpers_killed"] == 1
        assert 1.9 <= event["frozen_seconds"] < 3.5
        assert not ws._cgroup().frozen()
        tick = _count(ws, "/tmp/tick")
        wait_for(lambda: _count(ws, "/tmp/tick") > tick)
        assert settled_tree(ws) == before


# Forks a workspace it connected to and hangs at one stage: `frozen` (cgroup frozen, CRIU not
# started yet), `criu` (CRIU started, and stopped by SIGSTOP) or `fs` (the dump done, the
# file-system layer being copied, still frozen).
FORKER = textwrap.dedent("""
    import os, signal, sys, time
    from bunshinfork.cgroups import watchdog
    from bunshinfork.fs import frozen
    from bunshinfork.process import forkcheck
    from bunshinfork.workspace import Snapshot, Workspace
    ws = Workspace.connect(sys.argv[1])
    def stuck(*a, **kw):
        print("stuck", flush=True)
        time.sleep(1000)
    if sys.argv[2] == "frozen":
        forkcheck.check = stuck
    elif sys.argv[2] == "criu":
        real = watchdog.Watchdog.register
        def register(self, pid):
            real(self, pid)
            os.kill(pid, signal.SIGSTOP)
            stuck()
        watchdog.Watchdog.register = register
    else:
        frozen.freeze = stuck
    Snapshot.take(ws, "copy")
""")


def _snapshots_of(ws_id: str) -> list[str]:
    out = []
    for name in state.snapshot_ids():
        with contextlib.suppress(OSError, ValueError):
            if json.loads((state.snapshots_root() / name / "snapshot.json").read_text())["source"] == ws_id:
                out.append(name)
    return out


def _untraced(ws: Workspace) -> bool:
    return all("TracerPid:\t0\n" in Path(f"/proc/{p}/status").read_text() for p in ws._cgroup().pids())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", ["frozen", "criu", "fs"])
def test_watchdog_thaws_the_source_when_the_forking_process_is_killed(stage: str) -> None:
    """The forker dies by SIGKILL mid-freeze: its watchdog thaws the source at once. A CRIU it
    left behind (stage `criu`) is kept from freezing the source again and killed at `frozen`."""
    frozen = 4.0
    with Workspace.create() as ws:
        _start_ticker(ws)
        before = settled_tree(ws)
        env = {**os.environ, "BUNSHIN_FROZEN_TIMEOUT": str(frozen)}
        forker = subprocess.Popen([sys.executable, "-c", FORKER, ws.id, stage], stdout=subprocess.PIPE,
                                  text=True, env=env)
        try:
            assert forker.stdout is not None and forker.stdout.readline() == "stuck\n"
            assert ws._cgroup().frozen()
            forker.kill()
            t_killed = time.monotonic()
            forker.wait()
            (event,) = wait_for(lambda: watchdog.events(ws.id), timeout=frozen + 5)
            wait_for(lambda: _untraced(ws) and not ws._cgroup().frozen(), timeout=10)
            assert time.monotonic() - t_killed < frozen + 5
        finally:
            if forker.poll() is None:
                forker.kill()
                forker.wait()
        assert event["reason"] == "owner died"
        assert event["helpers_killed"] == (1 if stage == "criu" else 0)
        tick = _count(ws, "/tmp/tick")
        wait_for(lambda: _count(ws, "/tmp/tick") > tick)
        assert settled_tree(ws) == before
        assert len(_snapshots_of(ws.id)) == 1, "the killed forker's snapshot is gc's to remove"
        pipeline.gc()
        assert not _snapshots_of(ws.id)
        with fork_of(ws, 1, "copy") as (c,):
            assert settled_tree(c) == before


@pytest.mark.timeout(30)
def test_inject_deadline_restores_the_process() -> None:
    """An injected syscall that blocks (pause) is interrupted at its deadline; the process
    then runs on exactly as before, its code and registers restored."""
    echo = "import sys\nfor line in sys.stdin: print(line.strip()[::-1], flush=True)"
    p = subprocess.Popen([sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdin and p.stdout
        tids = holders.seize_all([p.pid])
        holders.wait_all(tids)
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                native.inject_syscall(p.pid, 34, timeout=0.3)  # pause()
            assert 0.3 <= time.monotonic() - t0 < 2
        finally:
            holders.detach_all(tids)
        p.stdin.write("olleh\n")
        p.stdin.flush()
        assert p.stdout.readline() == "hello\n"
    finally:
        p.kill()
        p.wait()
