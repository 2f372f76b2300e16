"""Workspace lifecycle (info, memory, pause/resume, destroy, connect, list), limits, typed spec
errors, storage layers, the cgroup v2 path, and many workspaces at once."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import btrfsutil  # type: ignore[import-not-found]
import pytest
from helpers import host_proc_state, init_gone, read_counter, run_ok, wait_for, ws_processes

from bunshinfork import state
from bunshinfork.cgroups import Cgroup
from bunshinfork.cgroups import cgroup as cgroups
from bunshinfork.commands import CommandHandle, CommandResult
from bunshinfork.errors import (
    BunshinError,
    CgroupError,
    CommandTimeout,
    RootfsError,
    SpecError,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from bunshinfork.fs import layers as storage
from bunshinfork.fs import store
from bunshinfork.process import control
from bunshinfork.spec import WorkspaceSpec
from bunshinfork.workspace import MemoryStats, Workspace

UNIFIED = Path("/sys/fs/cgroup/unified")
MiB = 1 << 20
COUNTER_LOOP = "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.02; done"


def _bg(ws: Workspace, cmd: str) -> CommandHandle:
    h = ws.commands.run(cmd, background=True)
    assert isinstance(h, CommandHandle)
    return h


def _advances(ws: Workspace, path: str = "/tmp/counter", window: float = 0.3) -> bool:
    first = read_counter(ws, path)
    time.sleep(window)
    return read_counter(ws, path) > first


# ---- queries ----


def test_info(ws: Workspace) -> None:
    info = ws.info()
    assert info.id == ws.id and info.id.startswith("ws-")
    assert info.hostname == ws.id
    assert info.state == "running"
    assert info.init_pid == ws.init_pid and Path(f"/proc/{info.init_pid}/comm").read_text() == "init\n"
    assert abs(info.created_at - time.time()) < 60
    assert info.rootfs == "host" and info.rootfs_digest.startswith("host-")
    assert info.storage == ("btrfs" if store.mounted() else "dir")
    assert info.network == {"mode": "none"}
    assert info.cgroup_version == cgroups.detect()
    assert (info.memory_limit, info.pids_limit, info.parent) == (None, None, None)
    with Workspace.create(memory_limit="128M", pids_limit=64, hostname="limited") as lw:
        li = lw.info()
        assert (li.memory_limit, li.pids_limit, li.hostname) == (128 * MiB, 64, "limited")
        assert lw._cgroup().memory_limit() == 128 * MiB


def test_memory_accounting(ws: Workspace) -> None:
    baseline = ws.memory()
    assert baseline.processes >= 1 and baseline.rss > 0
    # Random bytes: ksmd (boosted by earlier forks in the suite) would merge a uniform fill away.
    _bg(ws, "exec python3 -c 'import os, time; b = os.urandom(50 << 20); time.sleep(300)'")
    # The 50 MiB are private to python once written: wait for that, not for rss (libraries count there).
    # The cgroup's counters come from the kernel's per-cpu statistics, flushed every two seconds or
    # so, and can trail smaps by a few dozen pages (CI once read 73 fewer): wait for them too.
    def settled() -> MemoryStats | None:
        s = ws.memory()
        return s if min(s.uss, s.cgroup_usage, s.host.anon) >= 50 * MiB else None

    m = wait_for(settled, timeout=10)
    assert m.pss >= m.uss and m.shared > 0
    assert m.rss >= m.uss
    # init, the spawn shim, python
    assert m.processes >= 3
    assert set(m.per_process) == set(ws._cgroup().pids())
    assert sum(row["rss"] for row in m.per_process.values()) == m.rss


def test_pause_and_resume(ws: Workspace) -> None:
    _bg(ws, COUNTER_LOOP)
    wait_for(lambda: _advances(ws))
    ws.pause()
    assert ws.info().state == "paused"
    # Files still work while nothing inside can run.
    frozen_at = read_counter(ws, "/tmp/counter")
    time.sleep(0.4)
    assert read_counter(ws, "/tmp/counter") == frozen_at
    assert all(host_proc_state(p) in ("S", "D") for p in ws._cgroup().pids())
    ws.resume()
    assert ws.info().state == "running"
    wait_for(lambda: read_counter(ws, "/tmp/counter") > frozen_at, timeout=3)
    assert run_ok(ws, "echo back").stdout == "back\n"


def test_destroy_while_paused() -> None:
    w = Workspace.create()
    _bg(w, "sleep 100")
    w.pause()
    w.destroy()
    # v1 freezer: a frozen task acts on SIGKILL only once thawed; destroy must see to that.
    assert init_gone(w)
    assert not w.is_running()


# ---- lifecycle ----


def test_destroy_is_idempotent_and_final() -> None:
    w = Workspace.create()
    ws_id = w.id
    w.destroy()
    w.destroy()
    assert init_gone(w)
    assert not w.is_running() and w.info().state == "dead"
    assert not (state.RUN_ROOT / ws_id).exists()
    for op in (lambda: w.commands.run("true"), lambda: w.commands.run("true", background=True),
               lambda: w.files.read("/etc/hostname"), lambda: w.files.write("/tmp/x", "x"), w.pause,
               w.resume, w.memory):
        with pytest.raises(WorkspaceStateError):
            op()
    with pytest.raises(WorkspaceNotFound):
        Workspace.connect(ws_id)


def test_context_manager_destroys_even_on_error() -> None:
    with Workspace.create() as w:
        assert w.is_running()
    assert not w.is_running() and init_gone(w)
    with pytest.raises(RuntimeError, match="boom"), Workspace.create() as w2:
        run_ok(w2, "true")
        raise RuntimeError("boom")
    assert not w2.is_running()


def test_create_overrides() -> None:
    with Workspace.create(WorkspaceSpec(hostname="base"), env={"X": "1"}) as w:
        assert run_ok(w, "hostname; echo $X").stdout == "base\n1\n"
    with pytest.raises(SpecError, match="bogus"):
        Workspace.create(bogus=1)


_OTHER_PROCESS = textwrap.dedent("""
    import sys
    from bunshinfork.workspace import Workspace
    ws = Workspace.connect(sys.argv[1])
    print(ws.files.read("/root/from-creator").strip())
    print(ws.commands.run("cat /etc/hostname; echo from-other > /root/from-other").stdout.strip())
    if sys.argv[2] == "destroy":
        ws.destroy()
        print("destroyed")
""")


def _other_process(ws_id: str, action: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, ws_id, action], capture_output=True,
                       text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_connect_from_another_process(ws: Workspace) -> None:
    ws.files.write("/root/from-creator", "hello")
    assert _other_process(ws.id, "keep") == ["hello", ws.id]
    assert ws.files.read("/root/from-other") == "from-other\n"
    assert ws.is_running()


def test_another_process_destroys() -> None:
    w = Workspace.create()
    w.files.write("/root/from-creator", "hello")
    assert _other_process(w.id, "destroy") == ["hello", w.id, "destroyed"]
    # The init was this process's child; it must not linger as a zombie here either.
    wait_for(lambda: init_gone(w))
    assert not w.is_running()
    with pytest.raises(WorkspaceStateError):
        w.commands.run("true")
    w.destroy()  # nothing left to do, and no error for it


def test_list(ws: Workspace) -> None:
    with Workspace.create() as other:
        listed = {i.id: i for i in Workspace.list()}
        assert {ws.id, other.id} <= set(listed)
        assert listed[ws.id] == ws.info()
    assert other.id not in {i.id for i in Workspace.list()}
    assert ws.id in {i.id for i in Workspace.list()}


def test_connect_unknown() -> None:
    with pytest.raises(WorkspaceNotFound) as ei:
        Workspace.connect("ws-000000000000")
    assert isinstance(ei.value, LookupError)


# ---- limits ----


def test_memory_limit_kills_only_the_offender() -> None:
    with Workspace.create(memory_limit="64M") as w:
        assert w._cgroup().memory_limit() == 64 * MiB
        r = w.commands.run(["python3", "-c", "b = b'\\x01' * (256 << 20); print('survived')"], timeout=60)
        assert isinstance(r, CommandResult)
        assert (r.exit_code, r.signal, r.stdout) == (137, 9, "")
        assert w._cgroup().oom_kills() >= 1
        assert w.is_running()
        assert run_ok(w, "echo still-here").stdout == "still-here\n"
        assert w.memory().cgroup_usage <= 64 * MiB


_FORK_LOOP = textwrap.dedent("""
    import os, signal, time
    kids = []
    err = None
    for _ in range(200):  # a hard cap, so a broken limit cannot take the host down
        try:
            pid = os.fork()
        except OSError as e:
            err = e.errno
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        kids.append(pid)
    for pid in kids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(len(kids), err)
""")


def test_pids_limit_bounds_a_fork_bomb() -> None:
    with Workspace.create(pids_limit=32) as w:
        n, err = run_ok(w, ["python3", "-c", _FORK_LOOP], timeout=60).stdout.split()
        # init, the shim and python itself count too.
        assert int(n) <= 29
        assert err == "11"  # EAGAIN
        assert subprocess.run(["true"]).returncode == 0  # the host still forks
        assert run_ok(w, "echo fine").stdout == "fine\n"
        if w.info().cgroup_version == "v1":
            assert Path(w._cgroup().paths["pids"], "pids.max").read_text().strip() == "32"


_BUSY = "import os, time\nt = time.time()\nwhile time.time() - t < 2: pass\nc = os.times()\nprint(c.user + c.system)"


def test_cpu_limit_holds_the_workspace_and_its_fork() -> None:
    """cpu_limit=0.25: a busy loop for 2 s of wall clock gets about half a second of CPU, in the
    source and in its fork (CRIU restores the clone into a cgroup with the same quota). The
    kernel's throttle count shows the quota acted, not the other load of a busy host."""
    with Workspace.create(cpu_limit=0.25) as w:
        assert w.info().cpu_limit == 0.25
        [clone] = w.fork(1)
        try:
            for ws in (w, clone):
                used = float(run_ok(ws, ["python3", "-c", _BUSY], timeout=60).stdout)
                assert used < 0.25 * 2 * 1.5 + 0.1, f"{ws.id} used {used:.2f} s of CPU in 2 s under a 0.25 cap"
                d = Path(ws._cgroup().paths.get("cpu") or ws._cgroup().paths["unified"])
                stat = dict(line.split() for line in (d / "cpu.stat").read_text().splitlines())
                assert int(stat["nr_throttled"]) > 0
        finally:
            clone.destroy()


def test_a_clone_makes_no_cgroup_of_another_workspace() -> None:
    """CRIU's dump records the subtree of each cgroup a task is in, and its restore makes what is
    missing. A workspace without a CPU limit once sat in the cpu hierarchy's root, so its
    snapshot recorded every CPU-limited workspace's directory, and a clone made them again after
    those workspaces had gone (the E2B suite leaked nine). Every workspace has its own now."""
    with Workspace.create() as plain:
        other = Workspace.create(cpu_limit=1.0)
        dirs = [Path(d) for d in other._cgroup().paths.values()]
        with plain.snapshot() as snap:
            other.destroy()
            assert not any(d.exists() for d in dirs)
            [clone] = snap.fork(1)
            clone.destroy()
        assert not any(d.exists() for d in dirs), [str(d) for d in dirs if d.exists()]


# ---- typed spec errors ----


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"rootfs": "/nonexistent/bunshin-rootfs"}, RootfsError, "does not exist"),
        ({"rootfs": "relative/rootfs"}, RootfsError, "absolute path"),
        ({"rootfs": ""}, SpecError, "rootfs"),
        ({"memory_limit": "abc"}, SpecError, "not a size"),
        ({"memory_limit": -1}, SpecError, "positive"),
        ({"memory_limit": "1K"}, SpecError, "below"),
        ({"memory_limit": True}, SpecError, "memory_limit"),
        ({"pids_limit": 0}, SpecError, "pids_limit"),
        ({"pids_limit": "10"}, SpecError, "pids_limit"),
        ({"cpu_limit": 0}, SpecError, "cpu_limit"),
        ({"cpu_limit": "2"}, SpecError, "cpu_limit"),
        ({"cpu_limit": True}, SpecError, "cpu_limit"),
        ({"network": "wifi"}, SpecError, "unknown network mode"),
        ({"nat": True}, SpecError, "bridge"),
        ({"hostname": "bad_name!"}, SpecError, "host name"),
        ({"hostname": "-leading"}, SpecError, "host name"),
        ({"hostname": "a" * 64}, SpecError, "host name"),
        ({"hostname": "box\n"}, SpecError, "host name"),
        ({"cgroup": "v3"}, SpecError, "unknown cgroup layout"),
        ({"env": {"A=B": "x"}}, SpecError, "env"),
        ({"storage_dir": "/nonexistent/bunshin-storage"}, SpecError, "storage_dir"),
    ],
)
def test_bad_spec(overrides: dict[str, Any], error: type[BunshinError], match: str) -> None:
    layers = storage.storage_root(None)
    before = set(os.listdir(layers)) if layers.is_dir() else set()
    with pytest.raises(error, match=match) as ei:
        Workspace.create(**overrides)
    after = set(os.listdir(layers)) if layers.is_dir() else set()
    assert after == before
    assert isinstance(ei.value, ValueError) == (error is SpecError)


@pytest.mark.skipif(cgroups._is_cgroup2(cgroups.CGROUP_ROOT), reason="needs a cgroup v1 host")
def test_cgroup_v2_on_a_v1_host() -> None:
    # /sys/fs/cgroup is a tmpfs there: nothing may be created in it.
    before = set(os.listdir(cgroups.CGROUP_ROOT))
    with pytest.raises(CgroupError, match="not a cgroup v2 hierarchy"):
        Workspace.create(cgroup="v2")
    assert set(os.listdir(cgroups.CGROUP_ROOT)) == before


# ---- storage ----


def test_default_storage_is_the_layer_store(ws: Workspace) -> None:
    """Where the set-up step made the btrfs layer store, each workspace's layer is a subvolume
    of it (one qgroup each); elsewhere a directory on the state root's tmpfs."""
    layer = Path(ws._rec.fs.layer.path)
    assert layer.parent == storage.storage_root(None)
    if store.mounted():
        assert ws.info().storage == "btrfs" and layer.parent == store.STORE
        assert btrfsutil.is_subvolume(str(layer))
    else:
        assert ws.info().storage == "dir" and layer.parent == store.fallback_root()
    run_ok(ws, "echo data > /root/file")
    assert (layer / "upper/root/file").read_text() == "data\n"
    ws.destroy()
    assert not layer.exists()


def test_without_a_store_layers_are_directories(no_store: None) -> None:
    with Workspace.create() as ws:
        layer = Path(ws._rec.fs.layer.path)
        assert ws.info().storage == "dir" and layer.parent == store.fallback_root()
        assert layer.is_dir() and not storage.is_btrfs(layer)


def test_btrfs_storage_is_a_subvolume(btrfs_dir: str) -> None:
    with Workspace.create(storage_dir=btrfs_dir) as a, Workspace.create(storage_dir=btrfs_dir) as b:
        paths = [Path(w._rec.fs.layer.path) for w in (a, b)]
        assert a.info().storage == "btrfs"
        assert paths[0] != paths[1]
        for p in paths:
            assert p.parent == Path(btrfs_dir) / "bunshin-layers"
            assert btrfsutil.is_subvolume(str(p))
        run_ok(a, "echo data > /root/file")
        assert (paths[0] / "upper/root/file").read_text() == "data\n"
        assert b.commands.run("test -e /root/file").exit_code == 1
    for p in paths:
        assert not p.exists()


# ---- the cgroup v2 code path (this host's unified hierarchy has no controllers) ----


needs_unified = pytest.mark.skipif(not cgroups._is_cgroup2(UNIFIED), reason=f"no cgroup2 mount at {UNIFIED}")


@needs_unified
def test_workspace_on_cgroup_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", UNIFIED)
    with Workspace.create(cgroup="v2") as w:
        cg_dir = Path(w._rec.cgroups.paths["unified"])
        assert w.info().cgroup_version == "v2"
        assert cg_dir == UNIFIED / cgroups.PARENT / w.id
        assert str(w.init_pid) in (cg_dir / "cgroup.procs").read_text().split()
        assert f"0::/{cgroups.PARENT}/{w.id}" in Path(f"/proc/{w.init_pid}/cgroup").read_text()
        _bg(w, COUNTER_LOOP)
        wait_for(lambda: _advances(w))
        w.pause()
        assert w.info().state == "paused"
        frozen_at = read_counter(w, "/tmp/counter")
        time.sleep(0.3)
        assert read_counter(w, "/tmp/counter") == frozen_at
        w.resume()
        wait_for(lambda: read_counter(w, "/tmp/counter") > frozen_at, timeout=3)
        # No memory controller in this hierarchy: usage reads as 0, the per-process sums still work.
        m = w.memory()
        assert m.cgroup_usage == 0 and m.rss > 0
    assert not cg_dir.exists()


@needs_unified
def test_workspace_limits_need_v2_controllers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", UNIFIED)
    if "memory" in (UNIFIED / "cgroup.controllers").read_text().split():
        pytest.skip("this host's v2 hierarchy has a memory controller")
    with pytest.raises(CgroupError, match="memory controller"):
        Workspace.create(cgroup="v2", memory_limit="64M")


@pytest.mark.guest
def test_cgroup_v2_accounts_memory_without_a_limit() -> None:
    """On a cgroup v2 host (the guest) the memory controller is enabled for accounting even when
    no limit asks for it: without it memory.stat is absent and a workspace reads as costing 0."""
    root = cgroups.CGROUP_ROOT
    if not cgroups._is_cgroup2(root) or "memory" not in (root / "cgroup.controllers").read_text().split():
        pytest.skip("needs a cgroup v2 root with the memory controller (the guest)")
    with Workspace.create() as w:
        assert w.info().memory_limit is None
        _bg(w, "exec python3 -c 'import os, time; b = os.urandom(50 << 20); time.sleep(300)'")
        m = wait_for(lambda: (s := w.memory()).host.anon >= 50 * MiB and s, timeout=30)
        assert m.cgroup_usage >= 50 * MiB


@pytest.fixture
def counter_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    out = tmp_path / "counter"
    p = subprocess.Popen(["bash", "-c", f"i=0; while :; do i=$((i+1)); echo $i > {out}; sleep 0.02; done"])
    try:
        yield p, out
    finally:
        p.kill()
        p.wait()


def _host_counter(path: Path) -> int:
    deadline = time.monotonic() + 5
    while True:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return int(text)
        assert time.monotonic() < deadline
        time.sleep(0.01)


@needs_unified
def test_cgroup_v2_directly(counter_process: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, out = counter_process
    name = f"test-{secrets.token_hex(4)}"
    cg = Cgroup.create(name, version="v2", root=UNIFIED)
    try:
        d = Path(cg.paths["unified"])
        assert d == UNIFIED / cgroups.PARENT / name and d.is_dir()
        cg.add(proc.pid)
        assert proc.pid in cg.pids()
        wait_for(lambda: _host_counter(out) > 0)
        cg.freeze()
        assert cg.frozen()
        assert "frozen 1" in (d / "cgroup.events").read_text()
        value = _host_counter(out)
        time.sleep(0.3)
        assert _host_counter(out) == value
        cg.thaw()
        assert not cg.frozen()
        wait_for(lambda: _host_counter(out) > value, timeout=3)
        # A live member keeps the directory busy.
        with pytest.raises(CgroupError, match="cannot remove"):
            cg.remove(timeout=0.1)
    finally:
        # Children forked after the move belong to it too; kill them all before removing.
        cg.thaw()
        proc.kill()
        proc.wait()
        for pid in cg.pids():
            os.kill(pid, 9)
        wait_for(lambda: not cg.pids())
        cg.remove()
    assert not cg.exists()


@needs_unified
@pytest.mark.parametrize("limits", [{"memory_limit": 64 * MiB}, {"pids_limit": 32}])
def test_cgroup_v2_limits_without_controllers(limits: dict[str, int]) -> None:
    available = (UNIFIED / "cgroup.controllers").read_text().split()
    controller = "memory" if "memory_limit" in limits else "pids"
    if controller in available:
        pytest.skip(f"this host's v2 hierarchy has the {controller} controller")
    name = f"test-{secrets.token_hex(4)}"
    with pytest.raises(CgroupError, match=f"the {controller} controller"):
        Cgroup.create(name, version="v2", root=UNIFIED, **limits)  # type: ignore[arg-type]
    assert not (UNIFIED / cgroups.PARENT / name).exists()


def test_cgroup_v2_refuses_a_v1_root() -> None:
    if cgroups._is_cgroup2(cgroups.CGROUP_ROOT):
        pytest.skip("the default root is cgroup v2 here")
    with pytest.raises(CgroupError, match="not a cgroup v2 hierarchy"):
        Cgroup.create(f"test-{secrets.token_hex(4)}", version="v2")
    assert not (cgroups.CGROUP_ROOT / cgroups.PARENT).exists()


# ---- many at once ----


def _one(i: int) -> tuple[str, str]:
    with Workspace.create(env={"N": str(i)}) as w:
        r = run_ok(w, "echo $N $(hostname)")
        assert ws_processes(w)  # ps works in each
        return w.id, r.stdout


def test_32_concurrent_workspaces() -> None:
    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(_one, range(32)))
    assert len({ws_id for ws_id, _ in results}) == 32
    for i, (ws_id, out) in enumerate(results):
        assert out == f"{i} {ws_id}\n"


def test_32_concurrent_workspaces_alive_together() -> None:
    # All 32 exist at the same time (the other test may serialise by accident): create in
    # parallel, run in parallel, then destroy in parallel.
    with ThreadPoolExecutor(max_workers=32) as pool:
        created = list(pool.map(lambda i: Workspace.create(hostname=f"par-{i}"), range(32)))
        try:
            assert len({w.init_pid for w in created}) == 32
            outs = list(pool.map(lambda w: run_ok(w, "hostname; ps -e --no-headers | wc -l").stdout, created))
            for i, out in enumerate(outs):
                host, count = out.split()
                assert host == f"par-{i}"
                assert int(count) <= 5  # init, shim, bash, ps, wc: each sees only its own
        finally:
            list(pool.map(lambda w: w.destroy(), created))
    assert not any(w.is_running() for w in created)


def test_requests_to_a_paused_workspace_fail_typed(ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    # A frozen init cannot answer: each call must end with a typed error, not hang or raise a
    # bare socket timeout.
    monkeypatch.setattr(control, "REPLY_TIMEOUT", 0.5)
    h = _bg(ws, "sleep 100")
    ws.pause()
    try:
        with pytest.raises(CommandTimeout):
            ws.commands.run("true", timeout=0.5)
        with pytest.raises(WorkspaceStateError, match="paused"):
            ws.commands.run("true", background=True)
        with pytest.raises(WorkspaceStateError, match="paused"):
            h.kill()
        with pytest.raises(WorkspaceStateError, match="paused"):
            ws.commands.run("touch /tmp/ran-after-resume", background=True)
    finally:
        ws.resume()
    # Requests whose callers gave up are dropped, not carried out once the init thaws: the
    # kill above did not happen, and neither does the command.
    assert h.kill() is True
    assert run_ok(ws, "echo ok").stdout == "ok\n"
    time.sleep(0.5)
    assert not ws.files.exists("/tmp/ran-after-resume")


def test_destroy_detaches_mounts_a_crashed_fork_left_in_the_state_dir() -> None:
    """A creator killed mid-restore leaves the clone's --root overlay mounted under its state
    directory; destroy (and so gc) must detach it rather than fail on a busy directory."""
    from bunshinfork import native

    ws = Workspace.create()
    leftover = ws._rec.dir / "rootfs"
    leftover.mkdir(exist_ok=True)
    native.mount("tmpfs", str(leftover), "tmpfs", 0, None)
    ws.destroy()
    assert not ws._rec.dir.exists()
    assert str(leftover) not in Path("/proc/self/mountinfo").read_text()
