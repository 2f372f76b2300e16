"""Retained snapshots of a running workspace, and forking clones from them.

A snapshot is taken during one short freeze: CRIU dumps the process tree (leaving it
running) and, from CRIU's post-dump notification while the tree is still stopped, the
private file-system layer is snapshotted. The source resumes before any clone is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import control, criu, deadlines, forkcheck, native, process, rootfs, state, storage, watchdog
from . import memory as memory_engines
from .cgroups import Cgroup
from .errors import (
    BunshinError,
    CgroupError,
    CriuError,
    DeadlineExceeded,
    ForkError,
    ForkTimeout,
    SpecError,
    WorkspaceStateError,
)
from .memory import holders, ksm, materialize
from .reaper import reaper

if TYPE_CHECKING:
    from .workspace import Workspace

MAX_PARALLEL_RESTORES = 8
# Our own steps inside a freeze end this long before the watchdog's `frozen` deadline, so that
# the watchdog acts only when we cannot (killed, stuck).
FREEZE_MARGIN = 1.0
# criu/patches/0001: a cow dump writes no anonymous private pages; the holders keep them.
PAGE = os.sysconf("SC_PAGE_SIZE")
COW_DUMP_ENV = {"CRIU_BUNSHIN_NO_ANON_PAGES": "1"}
# Called with each restore's live criu.Session right after it starts; failure-injection tests use
# it to kill a real CRIU mid-restore. None in normal operation.
RESTORE_HOOK: Callable[[criu.Session], None] | None = None
_saver = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bunshin-save")


def snapshots_root() -> Path:
    return state.run_root() / "snapshots"


@dataclass
class Timing:
    frozen_seconds: float
    dump_seconds: float


class Snapshot:
    """The frozen, retained state of a workspace. fork() may be called any number of times."""

    def __init__(self, meta: dict, directory: Path, owned: bool = True) -> None:
        self._meta = meta
        self.dir = directory
        self._owned = owned
        self._released = False
        # cow snapshots: the memory of each process, keyed by its pid inside the namespace.
        self._holders: dict[int, holders.Holder] = {}
        self._fixed_bytes: int | None = None

    # ---- taking ----

    @classmethod
    def take(cls, ws: Workspace, memory: str = "auto") -> Snapshot:
        """memory: "cow" (or "auto" where /dev/bunshin exists) keeps anonymous memory in
        holders shared copy-on-write with the source; any other engine dumps it into images."""
        rec = ws._rec
        kind = "cow" if memory_engines.resolve(memory) == "cow" else "image"
        ws._live_init_pid()
        if rec.network.get("mode", "none") != "none":
            raise ForkError(
                f"workspace {rec.id} uses network={rec.network.get('mode')!r}; forking supports "
                "network='none' workspaces (their internal TCP connections survive)"
            )
        snap_id = "snap-" + secrets.token_hex(6)
        d = snapshots_root() / snap_id
        images = d / "images"
        images.mkdir(parents=True)
        fs_dest = (
            str(storage.storage_root(rec.spec.get("storage_dir")) / "snapshots" / snap_id)
            if rec.storage.get("kind") == "btrfs" else str(d / "fs")
        )
        meta = {
            "id": snap_id, "source": rec.id, "created_at": time.time(), "owner_pid": os.getpid(),
            "rootfs": rec.rootfs, "spec": rec.spec, "cgroup_version": rec.cgroup["version"],
            "layer": None, "hostname": rec.hostname, "kind": kind,
        }
        snap = cls(meta, d)
        snap._write_meta()  # owner recorded first, so gc never takes a snapshot still being made
        cg = ws._cgroup()
        layer_box: list[storage.Layer] = []

        def on_notify(script: str, _pid: int) -> None:
            # post-dump runs while CRIU still holds every task stopped.
            if script == "post-dump":
                layer_box.append(storage.snapshot_layer(rec.storage, fs_dest))

        freezer = cg.freezer_dir
        dl = deadlines.current()
        # A workspace the user paused stays paused, and its freeze is not ours to watch.
        was_paused = cg.frozen()
        t0 = time.monotonic()
        until = t0 + dl.frozen - FREEZE_MARGIN  # our own steps end before the watchdog acts
        try:
            with _watched(freezer, dl.frozen, rec.id, was_paused) as wd:
                cg.freeze(dl.freeze)
                try:
                    forkcheck.check(cg.pids(), rec.id)
                    criu.request("dump", process.dump_opts(rec.init_pid, images, freezer), on_notify,
                                 log=images / "dump.log", env=COW_DUMP_ENV if kind == "cow" else None,
                                 session_hook=lambda s: wd.register(s.pid) if wd else None,
                                 timeout=max(0.1, min(dl.criu, until - time.monotonic())))
                    if kind == "cow":
                        # Still frozen (CRIU leaves a cgroup frozen that it found frozen): the holders
                        # image exactly the state the dump describes.
                        snap._holders = holders.capture_tree(cg.pids(), cg.freeze, cg.thaw, until=until)
                finally:
                    t_dump = time.monotonic()
                    if not was_paused:
                        cg.thaw(dl.freeze)
        except BaseException as e:
            snap._meta["layer"] = layer_box[0].to_dict() if layer_box else None
            snap.release()
            if isinstance(e, DeadlineExceeded):
                raise ForkTimeout(f"snapshot of {rec.id} ran past its deadline; the workspace was thawed and "
                                  f"keeps running: {e}") from e
            if isinstance(e, (CriuError, CgroupError)):
                raise ForkError(f"snapshot of {rec.id} failed; the workspace keeps running: {e}") from e
            raise
        t_thawed = time.monotonic()
        process.rearm_expired_timerfds(images)
        if not layer_box:
            snap.release()
            raise ForkError("CRIU finished the dump without a post-dump notification; "
                            "no file-system snapshot")
        meta["layer"] = layer_box[0].to_dict()
        meta["timing"] = {"frozen_seconds": t_thawed - t0, "dump_seconds": t_dump - t0}
        snap._write_meta()
        return snap

    def _write_meta(self) -> None:
        (self.dir / "snapshot.json").write_text(json.dumps(self._meta, indent=1, sort_keys=True))

    # ---- properties ----

    @property
    def id(self) -> str:
        return str(self._meta["id"])

    @property
    def source_id(self) -> str:
        return str(self._meta["source"])

    @property
    def timing(self) -> Timing:
        t = self._meta.get("timing") or {"frozen_seconds": 0.0, "dump_seconds": 0.0}
        return Timing(float(t["frozen_seconds"]), float(t["dump_seconds"]))

    @property
    def images_dir(self) -> Path:
        return self.dir / "images"

    @property
    def rootfs_digest(self) -> str:
        return str(self._meta["rootfs"].get("digest", ""))

    def image_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.images_dir.iterdir() if f.is_file())

    def retained_bytes(self) -> int:
        """What keeping this snapshot costs now: its images and saved file-system layer, plus,
        for a cow snapshot, the anonymous pages only its holders still map.

        A cow snapshot shares every page with its source at first, so it starts near its images'
        size and grows by the pages the source writes afterwards; a cache bounding its memory
        should measure it again before it decides what to evict.
        """
        self._check_live()
        if self._fixed_bytes is None:
            layer = self._meta.get("layer") or {}
            paths = [self.dir] + ([Path(layer["path"])] if layer.get("path") else [])
            self._fixed_bytes = sum(_apparent_bytes(p) for p in paths)
        return self._fixed_bytes + sum(h.stats()[1] for h in self._holders.values()) * PAGE

    def _check_live(self) -> None:
        if self._released:
            raise WorkspaceStateError(f"snapshot {self.id} was released")

    # ---- forking ----

    def fork(self, count: int = 1, memory: str = "auto") -> list[Workspace | Exception]:
        """Start `count` running clones. Each succeeds or fails on its own (E2B semantics):
        a failed clone is an Exception in the list and leaves nothing behind."""
        self._check_live()
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise SpecError(f"count must be a positive integer, got {count!r}")
        engine = self._engine_for(memory)
        use_ksm = engine == "ksm"
        if use_ksm:
            ksm.tuner.boost()
        try:
            if count == 1:
                return [self._fork_one(use_ksm)]
            with ThreadPoolExecutor(max_workers=min(count, MAX_PARALLEL_RESTORES),
                                    thread_name_prefix="bunshin-restore") as pool:
                return list(pool.map(lambda _: self._fork_one(use_ksm), range(count)))
        finally:
            if use_ksm:
                ksm.tuner.release()

    @property
    def kind(self) -> str:
        """"cow" (memory held by holders, forks share it) or "image" (memory in CRIU images)."""
        return str(self._meta.get("kind", "image"))

    def _engine_for(self, memory: str) -> str:
        if self.kind == "cow":
            if memory not in ("auto", "cow"):
                raise SpecError(f"snapshot {self.id} keeps its memory for the cow engine; fork it with "
                                f"memory='cow' or 'auto', or take the snapshot with memory={memory!r}")
            if not self._holders:
                raise ForkError(f"snapshot {self.id} has no memory holders left (released, or loaded from disk)")
            return "cow"
        if memory == "cow":
            raise SpecError(f"snapshot {self.id} holds its memory in images; take it with memory='cow' to fork "
                            "copy-on-write")
        engine = memory_engines.resolve(memory)
        return "ksm" if engine == "cow" else engine

    def _fork_one(self, use_ksm: bool) -> Workspace | Exception:
        from .workspace import Workspace, _cleanup, write_identity

        spec = self._meta["spec"]
        rec = state.Record(
            id=state.new_id(), status="creating", creator_pid=os.getpid(), created_at=time.time(),
            hostname="", rootfs=self._meta["rootfs"], spec=spec, parent=self.source_id,
        )
        rec.hostname = rec.id
        try:
            rec.dir.mkdir(mode=0o700)
            rec.save()
            layer = storage.clone_layer(self._meta["layer"], rec.id, spec.get("storage_dir"))
            rec.storage = layer.to_dict()
            rec.save()
            write_identity(Path(layer.upper), rec.hostname)
            cg = Cgroup.create(rec.id, memory_limit=spec.get("memory_limit"),
                               pids_limit=spec.get("pids_limit"), version=self._meta["cgroup_version"])
            rec.cgroup = {"version": cg.version, "paths": cg.paths}
            rec.save()
            pid = self._restore(rec, layer, cg, use_ksm)
            rec.init_pid = pid
            rec.init_starttime = state.proc_starttime(pid) or 0
            rec.save()
            pidfd = native.pidfd_open(pid)
            reaper.watch(pid, pidfd)
            native.set_hostname_in(pid, rec.hostname)
            if not control.ping(pid):
                raise ForkError(f"clone {rec.id} was restored but its init does not answer")
            rec.network = {"mode": "none"}
            rec.status = "running"
            rec.save()
            return Workspace(rec, pidfd)
        except BaseException as e:
            with contextlib.suppress(BunshinError):
                _cleanup(rec)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(e, ForkError):
                return e
            err = (ForkTimeout if isinstance(e, DeadlineExceeded) else ForkError)(
                f"fork of {self.source_id} into {rec.id} failed: {e}")
            err.__cause__ = e
            return err

    def _restore(self, rec: state.Record, layer: storage.Layer, cg: Cgroup, use_ksm: bool) -> int:
        mountpoint = rec.dir / "rootfs"
        mountpoint.mkdir()
        work = rec.dir / "criu"
        work.mkdir()
        lower = ":".join(self._meta["rootfs"]["lowerdirs"])
        native.mount("overlay", str(mountpoint), "overlay", 0,
                     f"lowerdir={lower},upperdir={layer.upper},workdir={layer.work}")
        wfd = os.open(work, os.O_DIRECTORY | os.O_RDONLY)
        restored_init: list[int] = []
        share_failed: list[BaseException] = []

        def on_notify(script: str, pid: int) -> None:
            # setup-namespaces names the restored init. rst_sibling made it our child, so if the
            # restore fails from here on (criu killed, a later step failing) only we can reap it.
            if script == "setup-namespaces" and pid > 0:
                restored_init.append(pid)
            elif script == "pre-resume" and self.kind == "cow":
                # Every thread is stopped under CRIU's ptrace at its final sigreturn: share the
                # anonymous memory in now. A SIGSTOP/SIGCONT round (CRIU's leave_stopped) would
                # be seen by the clone's parents (a job-control shell's `wait` returns on it).
                try:
                    holders.share_tree(self._holders, cg.pids())
                except BaseException as e:
                    # CRIU resumes the tasks whatever this hook says; they must not run on
                    # empty memory. SIGKILL reaches traced tasks.
                    share_failed.append(e)
                    for p in cg.pids():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGKILL)

        try:
            roots = [(ctrl, "/" + os.path.relpath(p, _controller_mount(ctrl, p)))
                     for ctrl, p in cg.paths.items()]
            opts = process.restore_opts(self.images_dir, wfd, str(mountpoint), roots)
            try:
                resp = criu.request("restore", opts, on_notify, keep_fds=(wfd,), ksm_merge=use_ksm,
                                    log=work / "restore.log", session_hook=RESTORE_HOOK)
            except BunshinError as e:
                # Tasks killed for a failed share can fail CRIU's detach: name the first cause.
                if share_failed:
                    raise _share_error(share_failed[0]) from e
                raise
            if share_failed:
                raise _share_error(share_failed[0]) from share_failed[0]
            return int(resp.restore.pid)
        except BaseException:
            _abandon_restore(restored_init, cg, work)
            raise
        finally:
            os.close(wfd)
            # The clone's mount namespace holds its own reference; the host needs none.
            with contextlib.suppress(OSError):
                native.umount2(str(mountpoint), native.MNT_DETACH)

    # ---- durability ----

    def save(self, path: str | os.PathLike[str]) -> Future[str]:
        """Write a durable copy to `path` (a new directory) in the background; the source has
        long resumed. The future's result is the path."""
        self._check_live()
        dest = Path(path)
        if dest.exists():
            raise SpecError(f"{dest} already exists; save() writes a new directory")

        def write() -> str:
            tmp = dest.with_name(dest.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                if self.kind == "cow":
                    # Holders die with this process: read their memory into complete images.
                    materialize.complete_images(self.images_dir, tmp / "images", self._holders)
                else:
                    shutil.copytree(self.images_dir, tmp / "images")
                layer = storage.Layer(**{k: self._meta["layer"][k] for k in ("kind", "path")})
                storage.copy_tree(layer.path, str(tmp / "fs"))
                meta = {**self._meta, "layer": {"kind": "dir", "path": "fs"}, "kind": "image"}
                (tmp / "snapshot.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
                os.rename(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return str(dest)

        return _saver.submit(write)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Snapshot:
        """Open a snapshot written by save(). It is used in place and never deleted by release()."""
        d = Path(path)
        try:
            meta = json.loads((d / "snapshot.json").read_text())
        except FileNotFoundError:
            raise SpecError(f"{d} holds no saved snapshot (snapshot.json missing)") from None
        current = rootfs.resolve(meta["rootfs"]["source"])
        if current.digest != meta["rootfs"]["digest"]:
            raise ForkError(
                f"the root file system {meta['rootfs']['source']!r} changed since snapshot {meta['id']} was "
                f"saved ({meta['rootfs']['digest']} -> {current.digest}); clones would see different files"
            )
        meta["rootfs"] = current.to_dict()
        meta["layer"] = {"kind": "dir", "path": str(d / "fs")}
        return cls(meta, d, owned=False)

    def release(self) -> None:
        """Drop the retained state (images and file-system snapshot). Idempotent."""
        if self._released:
            return
        self._released = True
        for h in self._holders.values():
            with contextlib.suppress(OSError):
                h.release()
        self._holders = {}
        if not self._owned:
            return
        layer = self._meta.get("layer")
        if layer:
            with contextlib.suppress(Exception):
                storage.remove_layer(layer)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.source_id}>"


@contextlib.contextmanager
def _watched(freezer_dir: str, deadline: float, label: str, skip: bool) -> Iterator[watchdog.Watchdog | None]:
    if skip:
        yield None
        return
    with watchdog.guard(freezer_dir, deadline, label) as wd:
        yield wd


def _share_error(cause: BaseException) -> ForkError:
    return ForkError(f"sharing the snapshot's memory into the clone failed: {cause}")


def _abandon_restore(restored_init: list[int], cg: Cgroup, work: Path) -> None:
    """Undo what a CRIU that died or failed mid-restore could not.

    rst_sibling made its half-restored init our child: unless we kill and reap it, it waits
    forever for a criu that is gone, or stays a zombie. It is known from setup-namespaces, or
    before that recognised as our child in the clone's cgroup or holding criu's descriptors
    into this clone's work directory. Its cgroup yard, mounted in our mount namespace under
    the work directory, would keep the clone's state directory busy.
    """
    in_cgroup = set(cg.pids())
    orphans = set(restored_init)
    for pid in _children():
        if pid in in_cgroup or _holds_fd_under(pid, work):
            orphans.add(pid)
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a pid namespace's init: takes every task with it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    storage.unmount_below(work)


def _children() -> set[int]:
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            out.update(int(p) for p in (task / "children").read_text().split())
    return out


def _holds_fd_under(pid: int, directory: Path) -> bool:
    prefix = str(directory) + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
    return False


def _controller_mount(ctrl: str, path: str) -> str:
    """The hierarchy's mount point, so CRIU gets a path relative to the hierarchy root."""
    p = Path(path)
    while p.parent != p:
        if os.path.ismount(p):
            return str(p)
        p = p.parent
    raise CriuError(f"cgroup {path} of controller {ctrl} is on no cgroup mount")


def _apparent_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def leftover_snapshots() -> list[str]:
    root = state.RUN_ROOT / "snapshots"
    return sorted(os.listdir(root)) if root.is_dir() else []


def gc() -> list[str]:
    """Remove retained snapshots whose owning process has died."""
    removed = []
    for name in leftover_snapshots():
        d = state.RUN_ROOT / "snapshots" / name
        try:
            meta = json.loads((d / "snapshot.json").read_text())
            owner = int(meta.get("owner_pid", 0))
        except (FileNotFoundError, ValueError):
            meta, owner = {}, 0
        if owner and state.proc_starttime(owner) is not None:
            continue
        Snapshot(meta or {"id": name, "layer": None}, d).release()
        removed.append(name)
    return removed
