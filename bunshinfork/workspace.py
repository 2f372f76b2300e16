"""Workspace lifecycle and the public SDK object (E2B style)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import control, native, network, rootfs, seccomp_profile, state, storage
from .cgroups import Cgroup
from .commands import Commands
from .errors import (
    BunshinError,
    CgroupError,
    KernelFeatureError,
    PrivilegeError,
    SpecError,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from .files import Files
from .memory import ksm
from .reaper import reaper
from .snapshot import Snapshot
from .spec import WorkspaceSpec

INIT_BINARY = Path(__file__).resolve().parent / "_bin" / "bunshin-init"
NS_FLAGS = (
    native.CLONE_NEWPID | native.CLONE_NEWNS | native.CLONE_NEWNET | native.CLONE_NEWIPC | native.CLONE_NEWUTS
    | native.CLONE_NEWCGROUP
)
READY_TIMEOUT = 15.0


@dataclass(frozen=True)
class WorkspaceInfo:
    id: str
    hostname: str
    state: str  # running | paused | dead
    init_pid: int
    created_at: float
    rootfs: str
    rootfs_digest: str
    storage: str
    network: dict[str, Any]
    cgroup_version: str
    memory_limit: int | None
    pids_limit: int | None
    parent: str | None = None


@dataclass(frozen=True)
class MemoryStats:
    """Memory of the whole workspace, summed over its processes' smaps_rollup."""

    rss: int
    pss: int
    uss: int
    shared: int
    cgroup_usage: int
    processes: int
    per_process: dict[int, dict[str, int]] = field(default_factory=dict, repr=False)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise PrivilegeError("bunshinfork needs root (namespaces, mounts, cgroups); run it as root")


def _smaps_rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


class Workspace:
    """A running, isolated container workspace.

    Create with Workspace.create(spec); attach from any process with Workspace.connect(id).
    """

    def __init__(self, record: state.Record, pidfd: int | None = None) -> None:
        self._rec = record
        self._pidfd = pidfd
        self._lock = threading.Lock()
        self._shell_path: str | None = None
        self.commands = Commands(self)
        self.files = Files(self)

    # ---- construction ----

    @classmethod
    def create(cls, spec: WorkspaceSpec | None = None, **overrides: Any) -> Workspace:
        """Create and start a workspace. Keyword overrides are WorkspaceSpec fields."""
        base = spec or WorkspaceSpec()
        if overrides:
            try:
                base = WorkspaceSpec(**{**base.to_dict(), **overrides})
            except TypeError as e:
                raise SpecError(str(e)) from e
        spec = base.validate()
        _require_root()
        if not INIT_BINARY.exists():
            raise KernelFeatureError(f"{INIT_BINARY} is missing; reinstall bunshin (scripts/setup.sh)")
        root_fs = rootfs.resolve(spec.rootfs)
        run_root = state.run_root()
        ws_id = state.new_id()
        rec = state.Record(
            id=ws_id, status="creating", creator_pid=os.getpid(), created_at=time.time(),
            hostname=spec.hostname or ws_id, rootfs=root_fs.to_dict(), spec=spec.to_dict(),
        )
        (run_root / ws_id).mkdir(mode=0o700)
        rec.save()
        try:
            return cls._start(rec, spec, root_fs)
        except BaseException:
            _cleanup(rec)
            raise

    @classmethod
    def _start(cls, rec: state.Record, spec: WorkspaceSpec, root_fs: rootfs.Rootfs) -> Workspace:
        layer = storage.create_layer(rec.id, spec.storage_dir)
        rec.storage = layer.to_dict()
        rec.save()
        _seed_upper(Path(layer.upper), rec.hostname, root_fs)
        cg = Cgroup.create(rec.id, memory_limit=spec.memory_limit, pids_limit=spec.pids_limit,
                           version=spec.cgroup)
        rec.cgroup = {"version": cg.version, "paths": cg.paths}
        rec.save()
        mountpoint = rec.dir / "rootfs"
        mountpoint.mkdir()
        opts = f"lowerdir={':'.join(root_fs.lowerdirs)},upperdir={layer.upper},workdir={layer.work}"
        sp = native.spawn(native.SpawnConfig(
            ns_flags=NS_FLAGS, root=str(mountpoint), overlay_opts=opts, hostname=rec.hostname,
            mount_sysfs=spec.mount_sysfs, ksm_merge=spec.ksm, privileged=spec.privileged,
            seccomp_bpf=b"" if spec.privileged else seccomp_profile.bpf(),
        ))
        rec.init_pid = sp.pid
        rec.init_starttime = state.proc_starttime(sp.pid) or 0
        rec.save()
        reaper.watch(sp.pid, sp.pidfd)
        ws = cls(rec, sp.pidfd)
        try:
            cg.add(sp.pid)
        except CgroupError:
            os.kill(sp.pid, signal.SIGKILL)
            os.close(sp.sync_fd)
            os.close(sp.err_fd)
            raise
        failure = native.release(sp)
        if failure:
            raise _classify_spawn_failure(failure)
        ws._wait_ready()
        rec.network = network.setup(rec.id, sp.pid, spec.network, nat=spec.nat)
        rec.status = "running"
        rec.save()
        return ws

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        delay = 0.001
        while not control.ping(self._rec.init_pid):
            if not self._rec.init_alive():
                raise WorkspaceStateError(f"workspace {self.id}: init exited during start-up")
            if time.monotonic() > deadline:
                raise WorkspaceStateError(f"workspace {self.id}: init did not answer within {READY_TIMEOUT}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    @classmethod
    def connect(cls, ws_id: str) -> Workspace:
        """Attach to a workspace created by this or another process."""
        try:
            rec = state.Record.load(ws_id)
        except FileNotFoundError:
            raise WorkspaceNotFound(f"no workspace {ws_id!r} under {state.RUN_ROOT}; see 'bunshin ls'") from None
        if rec.status != "running" or not rec.init_alive():
            raise WorkspaceStateError(
                f"workspace {ws_id} is {rec.status if rec.status != 'running' else 'dead'}; "
                "'bunshin gc' removes what is left of it"
            )
        return cls(rec)

    @staticmethod
    def list() -> list[WorkspaceInfo]:
        out = []
        for ws_id in state.all_ids():
            with contextlib.suppress(FileNotFoundError, ValueError, TypeError, BunshinError):
                rec = state.Record.load(ws_id)
                if rec.status == "running":
                    out.append(Workspace(rec).info())
        return out

    # ---- queries ----

    @property
    def id(self) -> str:
        return self._rec.id

    @property
    def init_pid(self) -> int:
        """The init's pid on the host."""
        return self._rec.init_pid

    def _cgroup(self) -> Cgroup:
        return Cgroup(version=self._rec.cgroup["version"], paths=self._rec.cgroup["paths"])

    def _live_init_pid(self) -> int:
        if self._rec.status != "running" or not self._rec.init_alive():
            raise WorkspaceStateError(f"workspace {self.id} is not running (destroyed, or its init died)")
        return self._rec.init_pid

    def _shell(self) -> str:
        if self._shell_path is None:
            self._shell_path = "/bin/bash" if self.files.exists("/bin/bash") else "/bin/sh"
        return self._shell_path

    def spec_env(self) -> dict[str, str]:
        return dict(self._rec.spec.get("env") or {})

    def is_running(self) -> bool:
        return self._rec.status == "running" and self._rec.init_alive()

    def info(self) -> WorkspaceInfo:
        alive = self.is_running()
        st = "dead"
        if alive:
            st = "paused" if self._cgroup().frozen() else "running"
        spec = self._rec.spec
        return WorkspaceInfo(
            id=self.id, hostname=self._rec.hostname, state=st, init_pid=self._rec.init_pid,
            created_at=self._rec.created_at, rootfs=self._rec.rootfs.get("source", ""),
            rootfs_digest=self._rec.rootfs.get("digest", ""), storage=self._rec.storage.get("kind", ""),
            network=dict(self._rec.network), cgroup_version=self._rec.cgroup.get("version", ""),
            memory_limit=spec.get("memory_limit"), pids_limit=spec.get("pids_limit"), parent=self._rec.parent,
        )

    def memory(self) -> MemoryStats:
        """rss, pss, uss and shared bytes of every process, plus the cgroup's charged usage."""
        self._live_init_pid()
        cg = self._cgroup()
        totals = {"rss": 0, "pss": 0, "uss": 0, "shared": 0}
        per: dict[int, dict[str, int]] = {}
        for pid in cg.pids():
            try:
                r = _smaps_rollup(pid)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # exited between listing and reading
            row = {
                "rss": r.get("Rss", 0), "pss": r.get("Pss", 0),
                "uss": r.get("Private_Clean", 0) + r.get("Private_Dirty", 0),
                "shared": r.get("Shared_Clean", 0) + r.get("Shared_Dirty", 0),
            }
            per[pid] = row
            for k in totals:
                totals[k] += row[k]
        return MemoryStats(cgroup_usage=cg.memory_usage(), processes=len(per), per_process=per, **totals)

    # ---- lifecycle ----

    def pause(self) -> None:
        """Freeze every process of the workspace (cgroup freezer)."""
        self._live_init_pid()
        self._cgroup().freeze()

    def resume(self) -> None:
        self._live_init_pid()
        self._cgroup().thaw()

    def snapshot(self, memory: str = "auto") -> Snapshot:
        """Freeze briefly, capture the whole workspace, resume it; the Snapshot can fork many times.

        memory="cow" (the default where /dev/bunshin exists) keeps the anonymous memory in
        holders shared copy-on-write with the source; otherwise it goes into CRIU images.
        """
        return Snapshot.take(self, memory)

    def fork(self, count: int = 1, memory: str = "auto") -> list[Workspace | Exception]:
        """Live-fork into `count` running clones (E2B semantics: each entry is a Workspace or the
        Exception that clone failed with; the source keeps running unchanged either way).

        memory: "copy" (private copies), "ksm" (merged after the fact), "cow" (kernel module),
        or "auto" (cow when /dev/bunshin exists, else ksm on Linux >= 6.4, else copy).
        """
        with self.snapshot(memory) as snap:
            return snap.fork(count, memory)

    def destroy(self) -> None:
        """Kill every process and remove mounts, cgroups, network, layers and state. Idempotent."""
        # Concurrent destroys of one object must not close the pidfd twice: the second close
        # could hit a descriptor another thread has been handed since.
        with self._lock:
            pidfd, self._pidfd = self._pidfd, None
            _cleanup(self._rec, pidfd)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"<Workspace {self.id} init={self._rec.init_pid} {self._rec.status}>"


def _seed_upper(upper: Path, hostname: str, root_fs: rootfs.Rootfs | None = None) -> None:
    """Files every workspace gets in its private layer: the init binary, its identity, a home."""
    bdir = upper / ".bunshin"
    bdir.mkdir(mode=0o700)
    shutil.copy2(INIT_BINARY, bdir / "init")
    write_identity(upper, hostname)
    # Commands start in /root and relative file paths resolve under it, so a directory rootfs
    # without one would refuse every command; a rootfs that has it keeps its own.
    if root_fs and not any(os.path.lexists(Path(lower, "root")) for lower in root_fs.lowerdirs):
        (upper / "root").mkdir(mode=0o700)


def write_identity(upper: Path, hostname: str) -> None:
    """/etc/hostname and /etc/hosts naming this workspace (a clone gets its own)."""
    etc = upper / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "hostname").write_text(hostname + "\n")
    (etc / "hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )


def _classify_spawn_failure(msg: str) -> BunshinError:
    if "Operation not permitted" in msg:
        return PrivilegeError(f"workspace set-up failed at {msg}; run as root with CAP_SYS_ADMIN")
    if "mount overlay" in msg:
        return KernelFeatureError(f"workspace set-up failed at {msg}; is overlayfs available? see 'bunshin doctor'")
    return WorkspaceStateError(f"workspace set-up failed at {msg}")


def _kill_tree(rec: state.Record, pidfd: int | None) -> None:
    cg = Cgroup(version=rec.cgroup["version"], paths=rec.cgroup["paths"]) if rec.cgroup else None
    if cg is not None and cg.exists():
        # v1 freezer: a frozen task cannot act on SIGKILL until thawed.
        with contextlib.suppress(CgroupError, OSError):
            if cg.frozen():
                cg.thaw()
    if rec.init_pid and rec.init_alive():
        # Killing a pid namespace's init kills every process in it.
        with contextlib.suppress(ProcessLookupError):
            if pidfd is not None:
                native.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(rec.init_pid, signal.SIGKILL)
    if rec.init_pid:
        deadline = time.monotonic() + 10
        while rec.init_alive() and time.monotonic() < deadline:
            if rec.creator_pid == os.getpid():
                reaper.reap_now(rec.init_pid)
            time.sleep(0.002)
    if cg is not None and cg.exists():
        deadline = time.monotonic() + 10
        while cg.pids() and time.monotonic() < deadline:
            for pid in cg.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)


def _cleanup(rec: state.Record, pidfd: int | None = None) -> None:
    """Remove everything a (possibly half-created, possibly crashed) workspace holds."""
    if rec.status == "destroyed":
        return
    errors: list[str] = []
    _kill_tree(rec, pidfd)
    if pidfd is not None:
        with contextlib.suppress(OSError):
            os.close(pidfd)
    steps = [
        ("network", lambda: network.teardown(rec.id, rec.network)),
        ("cgroup", lambda: rec.cgroup and Cgroup(rec.cgroup["version"], rec.cgroup["paths"]).remove()),
        # A mount left under the state dir may still use the layer as its upper: detach first.
        ("mounts", lambda: storage.unmount_below(rec.dir)),
        ("layer", lambda: rec.storage and storage.remove_layer(rec.storage)),
        ("state", lambda: shutil.rmtree(rec.dir, ignore_errors=False) if rec.dir.exists() else None),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as e:
            errors.append(f"{name}: {e}")
    rec.status = "destroyed"
    if errors:
        raise WorkspaceStateError(f"workspace {rec.id} cleanup incomplete: {'; '.join(errors)}")


def gc() -> list[str]:
    """Remove what crashed creators left behind: records whose init is gone, orphan cgroups and layers."""
    removed = []
    for ws_id in state.all_ids():
        try:
            rec = state.Record.load(ws_id)
        except (FileNotFoundError, ValueError, TypeError):
            rec = None
        if rec is None:
            # No readable record: a creator died before writing one. Nothing else can be known.
            shutil.rmtree(state.RUN_ROOT / ws_id, ignore_errors=True)
            removed.append(ws_id)
            continue
        stale = (rec.status == "creating" and not rec.creator_alive()) or (
            rec.status == "running" and not rec.init_alive()
        )
        if stale:
            with contextlib.suppress(BunshinError):
                _cleanup(rec)
            removed.append(ws_id)
    # A creator killed mid-burst cannot relax ksmd itself.
    ksm.reconcile()
    return removed
