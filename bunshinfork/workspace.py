"""The SDK's two objects (E2B style): a running Workspace, and a retained Snapshot of one.

Both are thin: building a workspace is pipeline.create or pipeline.fork, a capture is
snapshot.take, and destroying is pipeline.release; each state they read is typed (state.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal as _signal
import threading
from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import accounting, coldboot, images, pipeline, snapshot, state
from . import memory as memory_engines
from .accounting import HostMemory
from .cgroups import Cgroup
from .commands import BUNSHIN, Commands, Conventions, Pty
from .contract import Build, Captured
from .errors import (
    BunshinError,
    SpecError,
    TemplateNotFound,
    WarmTemplateError,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from .files import Files
from .images import templates
from .network import egress as egress_rules
from .network import set_egress
from .network.ports import Ports
from .process import lifetime
from .spec import WorkspaceSpec
from .state import Record, Status, Timing

# Removes what crashed creators left behind (`bunshin gc`).
gc = pipeline.gc


def host_memory(workspaces: Iterable[Workspace], snapshots: Iterable[Snapshot] = ()) -> HostMemory:
    """What a set of workspaces and snapshots (a fork family) costs the host's memory together:
    each workspace's charges (anon, tmpfs, page cache, kernel), each snapshot's stores, and each
    frozen layer they share counted once (see bunshinfork.accounting)."""
    return accounting.family([w.record for w in workspaces], [s.captured for s in snapshots])


def info_state(status: Status, init_alive: bool, frozen: Callable[[], bool]) -> str:
    """WorkspaceInfo.state, derived from the record's Status and what the host shows: a running
    record whose init lives is "paused" while its cgroup is frozen (pause()), else "running";
    a PAUSED record is "paused-to-disk" (pause_to_disk()); anything else is "dead"."""
    if status is Status.RUNNING and init_alive:
        return "paused" if frozen() else "running"
    return "paused-to-disk" if status is Status.PAUSED else "dead"


@dataclass(frozen=True)
class WorkspaceInfo:
    id: str
    hostname: str
    state: str  # running | paused (frozen) | paused-to-disk | dead
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
    disk_limit: int | None = None  # bytes its layer, /tmp and /dev/shm may each hold
    cpu_limit: float | None = None  # cores of CPU time per period its processes share
    # Seconds per stage of building it: for a clone, its fork profile (the snapshot's freeze,
    # dump and holders as "snapshot.*", then layer, cgroup, mount, each CRIU restore phase as
    # "criu.*", the memory engine's share and readiness), and each subsystem's total.
    timings: dict[str, float] = field(default_factory=dict)
    # A clone's CRIU restore (wall clock: started, answered); None for a created workspace.
    restore_window: tuple[float, float] | None = None
    # An image rootfs's ExposedPorts ("80/tcp"), as the image declares them.
    exposed_ports: tuple[str, ...] = ()
    # Its egress policy now ({"allow_out": [...], "deny_out": [...]}); None: all allowed.
    egress: dict[str, list[str]] | None = None


@dataclass(frozen=True)
class MemoryStats:
    """What the workspace costs the host (`host`: anonymous memory, its tmpfs and shared memory,
    the page cache and kernel memory charged to it; see bunshinfork.accounting), and its
    processes' rss, pss, uss and shared bytes summed over their smaps_rollup."""

    rss: int
    pss: int
    uss: int
    shared: int
    cgroup_usage: int
    processes: int
    per_process: dict[int, dict[str, int]] = field(default_factory=dict, repr=False)
    host: HostMemory = field(default_factory=HostMemory)


def _smaps_rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


class _SpecEnv(Mapping[str, str]):
    """The workspace's own environment as its record holds it at each read (update_env
    replaces it)."""

    def __init__(self, current: Callable[[], Mapping[str, str]]) -> None:
        self._current = current

    def __getitem__(self, key: str) -> str:
        return self._current()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())


class Workspace:
    """A running, isolated container workspace.

    Create with Workspace.create(spec); attach from any process with Workspace.connect(id).
    Commands run as root in the workspace's shell and return their result whatever the exit
    code; a workspace lives until destroyed unless given a timeout. (Sandbox, its E2B twin,
    differs in its `conventions`.)
    """

    conventions: Conventions = BUNSHIN

    def __init__(self, record: Record, pidfd: int | None = None) -> None:
        self._rec = record
        self._pidfd = pidfd
        self._lock = threading.Lock()
        self._shell_path: str | None = None
        self._image = images.config.of(record.fs.rootfs if record.fs else None)
        self._serve(self.conventions)
        self.ports = Ports(record.id, record.dir, self.live_init_pid, self._inside_addresses)

    def _serve(self, conv: Conventions) -> None:
        self.conventions = conv
        env: Mapping[str, str] = _SpecEnv(lambda: self._rec.spec.env)
        if self._image is not None:
            # As docker exec: the image's Env under the workspace's own, its WorkingDir, and its
            # User where the front door has no default user of its own (a Sandbox keeps E2B's).
            env = ChainMap(env, self._image.env)  # type: ignore[arg-type]
            conv = dataclasses.replace(conv, workdir=self._image.working_dir or conv.workdir,
                                       default_user=conv.default_user or self._image.user)
        self.files = Files(self.live_init_pid, conv.default_user)
        self.commands = Commands(self.live_init_pid, self.files, env, self._shell, self.host_pids, conv)
        self.pty = Pty(self.commands)

    def set_conventions(self, conventions: Conventions) -> None:
        """Serve commands and files with another front door's conventions (a Sandbox gives E2B's
        to the workspace it wraps). New files, commands and pty objects replace the old ones."""
        self._serve(conventions)

    # ---- construction ----

    @classmethod
    def create(cls, spec: WorkspaceSpec | None = None, *, timeout: float | None = None,
               die_with_creator: bool = False, template: str | None = None, **overrides: Any) -> Workspace:
        """Create and start a workspace. Keyword overrides are WorkspaceSpec fields.

        template: the name of a warm template (bunshin template create) or saved snapshot to
        fork instead: it starts running and initialised, with the template's spec.

        timeout: seconds until the workspace's init ends it (None or 0: never); set_timeout()
        moves it. die_with_creator: it also ends within lifetime.LEASE_SECONDS of this
        process's exit, however that comes.
        """
        if template is not None:
            if spec is not None or overrides:
                raise SpecError("a workspace from a template has the template's spec; pass no spec or fields")
            return cls.from_template(template, timeout=timeout)
        base = spec or WorkspaceSpec()
        if overrides:
            try:
                base = WorkspaceSpec(**{**base.to_dict(), **overrides})
            except TypeError as e:
                raise SpecError(str(e)) from e
        b = pipeline.create(base.validate(), lifetime.asked(timeout, die_with_creator))
        ws = cls(b.rec, b.pidfd)
        if b.rec.spec.start == "entrypoint":
            try:
                ws.start_service()
            except BaseException:
                ws.destroy()
                raise
        return ws

    @classmethod
    def from_template(cls, name: str, *, timeout: float | None = None) -> Workspace:
        """A workspace forked from the warm template (bunshin template create) or saved snapshot
        `name` (an id or a name in the template store): running and initialised, with the
        default memory engine. TemplateNotFound where the store has no such name."""
        d = templates.find(name)
        if d is None:
            raise TemplateNotFound(f"no template or saved snapshot {name!r}; see 'bunshin template ls'")
        try:
            return cls.from_saved(d, timeout=timeout)
        except BunshinError as e:
            raise WarmTemplateError(f"starting from template {name!r} failed: {e}") from e

    @classmethod
    def from_saved(cls, path: str | os.PathLike[str], *, timeout: float | None = None) -> Workspace:
        """One running clone of the snapshot saved at `path` (Snapshot.save), with the default
        memory engine; the clone's error is raised where it could not be made. The saved files
        stay: a failed start loses nothing."""
        snap = Snapshot.load(path)
        try:
            (clone,) = snap.fork(1, timeout=timeout)
        finally:
            snap.release()
        if isinstance(clone, BaseException):
            raise clone
        return clone

    def start_service(self) -> None:
        """Start the image's Entrypoint and Cmd in the background, as `docker run` does (create()
        does it for spec.start == 'entrypoint')."""
        argv = list(self._image.service) if self._image else []
        if not argv:
            raise SpecError(f"image {self._rec.spec.rootfs} has neither Entrypoint nor Cmd to start")
        self.commands.run(argv, background=True, timeout=0)

    @classmethod
    def connect(cls, ws_id: str) -> Workspace:
        """Attach to a workspace created by this or another process. One paused to disk is
        attached to as it is: resume_from_disk() or destroy() it."""
        pipeline.collect()
        try:
            rec = Record.load(ws_id)
        except FileNotFoundError:
            raise WorkspaceNotFound(f"no workspace {ws_id!r} under {state.RUN_ROOT}; see 'bunshin ls'") from None
        if rec.status is Status.PAUSED:
            return cls(rec)
        if rec.status is not Status.RUNNING or not rec.init_alive():
            raise WorkspaceStateError(
                f"workspace {ws_id} is {rec.status if rec.status is not Status.RUNNING else 'dead'}; "
                "'bunshin gc' removes what is left of it"
            )
        return cls(rec)

    @staticmethod
    def list() -> list[WorkspaceInfo]:
        pipeline.collect()
        out = []
        for rec in state.records():
            if rec.status in (Status.RUNNING, Status.PAUSED):
                with contextlib.suppress(BunshinError):
                    out.append(Workspace(rec).info())
        return out

    # ---- queries ----

    @property
    def id(self) -> str:
        return self._rec.id

    @property
    def record(self) -> Record:
        """Its state record (bunshinfork.state): what accounting and the entrances read of it."""
        return self._rec

    @property
    def init_pid(self) -> int:
        """The init's pid on the host."""
        return self._rec.process.pid if self._rec.process else 0

    def _cgroup(self) -> Cgroup:
        assert self._rec.cgroups is not None
        return Cgroup(self._rec.cgroups)

    def live_init_pid(self) -> int:
        """The init's pid on the host; WorkspaceStateError once the workspace has stopped (what
        each command and file operation checks first)."""
        if not self.is_running():
            raise WorkspaceStateError(f"workspace {self.id} is not running (destroyed, or its init died)")
        return self.init_pid

    def host_pids(self) -> list[int]:
        """The host pids of every process in the workspace (its cgroup), the init's included."""
        return self._cgroup().pids()

    def _inside_addresses(self) -> list[str]:
        net = self._rec.network
        return ["127.0.0.1"] + ([net.ip] if net is not None and net.ip else [])

    def _shell(self) -> str:
        if self._shell_path is None:
            self._shell_path = "/bin/bash" if self.files.exists("/bin/bash", user="root") else "/bin/sh"
        return self._shell_path

    @property
    def state_dir(self) -> Path:
        """The host directory holding the workspace's record; destroy() removes it with all it
        holds, so a front door keeps its own state beside the record there."""
        return self._rec.dir

    @property
    def layer_dir(self) -> Path | None:
        """The directory of the workspace's writable layer (its upper/ holds what it wrote);
        None where it has none."""
        fs = self._rec.fs
        return Path(fs.layer.path) if fs and fs.layer else None

    def ends_at(self) -> float | None:
        """When (wall clock) the workspace's init ends it, as its record says now: set_timeout()
        from any process moves it. None: no deadline."""
        with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
            self._rec.lifetime = Record.load(self.id).lifetime
        return self._rec.lifetime.deadline or None

    def is_destroyed(self) -> bool:
        """Whether destroy() ran, here or in another process (its state directory is gone)."""
        return self._rec.status is Status.DESTROYED or not self._rec.dir.exists()

    def update_env(self, env: Mapping[str, str]) -> None:
        """Add `env` to the environment every later command gets (kept in its record, so
        Workspace.connect() from another process sees it too)."""
        for k in env:
            if not isinstance(k, str) or not k or "=" in k:
                raise SpecError(f"environment variable name {k!r} is empty or contains '='")
        spec = self._rec.spec
        self._rec.spec = dataclasses.replace(spec, env={**spec.env, **env})
        self._rec.save()

    def set_egress(self, egress: dict[str, list[str]] | str | None) -> None:
        """Replace the workspace's egress policy while it runs (WorkspaceSpec.egress's forms;
        None: all allowed). Connections already open keep going; new ones meet the new rules.
        Forks made from now on inherit it; those made before keep theirs. SpecError for a bad
        policy, before anything changes. The policy in force already changes nothing."""
        self.live_init_pid()
        _fresh_egress(self._rec)
        spec = dataclasses.replace(self._rec.spec, egress=egress).validate()
        if spec.egress == self._rec.spec.egress:
            return  # in force already (a clone given its snapshot's policy): no rule to rewrite
        set_egress(self.id, self._rec.network, spec.egress)
        self._rec.spec = dataclasses.replace(self._rec.spec, egress=spec.egress)
        self._rec.save()

    def is_running(self) -> bool:
        return self._rec.status is Status.RUNNING and self._rec.init_alive()

    def info(self) -> WorkspaceInfo:
        _fresh_egress(self._rec)
        rec = self._rec
        st = info_state(rec.status, rec.init_alive(), lambda: self._cgroup().frozen())
        fs = rec.fs
        limit = rec.spec.memory_limit
        return WorkspaceInfo(
            id=self.id, hostname=rec.hostname, state=st, init_pid=self.init_pid, created_at=rec.created_at,
            rootfs=fs.rootfs.source if fs else "", rootfs_digest=fs.rootfs.digest if fs else "",
            storage=fs.layer.kind if fs and fs.layer else "", network=rec.network.info() if rec.network else {},
            cgroup_version=rec.cgroups.version if rec.cgroups else "",
            memory_limit=limit if isinstance(limit, int) else None, pids_limit=rec.spec.pids_limit,
            parent=rec.parent, disk_limit=rec.spec.disk_limit, cpu_limit=rec.spec.cpu_limit, timings=dict(rec.timings),
            restore_window=rec.restore_window, exposed_ports=self._image.exposed_ports if self._image else (),
            egress=rec.spec.egress if isinstance(rec.spec.egress, dict) else None,
        )

    def memory(self) -> MemoryStats:
        """What the workspace costs the host (`.host`), and rss, pss, uss and shared bytes of its
        processes and the cgroup's charged usage."""
        self.live_init_pid()
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
        return MemoryStats(cgroup_usage=cg.memory_usage(), processes=len(per), per_process=per,
                           host=accounting.of_cgroup(cg.state), **totals)

    # ---- lifecycle ----

    def pause(self) -> None:
        """Freeze every process of the workspace (cgroup freezer)."""
        self.live_init_pid()
        self._cgroup().freeze()

    def resume(self) -> None:
        self.live_init_pid()
        self._cgroup().thaw()

    def pause_to_disk(self, path: str | os.PathLike[str] | None = None) -> None:
        """Save the workspace's whole state (memory, processes, files) to disk at `path` (a new
        directory; default state.PAUSED_ROOT/<id>), then release its processes, memory, mounts,
        cgroup and network: only its record is left, and info().state is "paused-to-disk".
        resume_from_disk() restores it under the same id; destroy() removes it with its saved
        state. A failed save leaves it running, unchanged. (pause() is a freeze instead: the
        memory stays where it is.)"""
        dest = Path(path) if path is not None else state.PAUSED_ROOT / self.id
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Saved complete (a cow snapshot's holders are read into images): nothing of it
            # stays in memory or reads another snapshot's pages.
            with _capture(self, "auto", delta=True, dedupe=False) as snap:
                snap.save(tmp).result()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        with self._lock:
            pidfd, self._pidfd = self._pidfd, None
            pipeline.park(Build(self._rec, pidfd=pidfd), dest)

    def resume_from_disk(self, *, timeout: float | None = None) -> None:
        """Restore a workspace paused to disk, under its own id, with its processes running and
        its files as they were; `timeout`: its lifetime from now (None or 0: none). Its saved
        state is deleted once it runs; a failed resume leaves it paused, its state kept.
        WorkspaceStateError where it is not paused to disk."""
        with pipeline.resuming(self.id) as rec:
            snap = snapshot.load(str(rec.saved))
            try:
                b = pipeline.wake(rec, snap, snap.meta.memory, lifetime.asked(timeout, False))
            finally:
                pipeline.release(snap)  # a loaded snapshot: its files stay
            saved, rec.saved = rec.saved, None
            rec.save()
        shutil.rmtree(str(saved), ignore_errors=True)
        with self._lock:  # the same object runs again: its commands, files and pty with it
            self._rec, self._pidfd = b.rec, b.pidfd

    def pause_files(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """E2B's filesystem-only pause: save the workspace's files alone (its layers above the
        rootfs, flattened) at `path` with its spec, egress rules and `extra` (JSON, a front
        door's own state), then destroy it: no memory, no process is kept. boot_files() cold-boots
        them. A failed save leaves it running, unchanged."""
        coldboot.save(self, Path(path), extra)

    @staticmethod
    def files_saved(path: str | os.PathLike[str]) -> bool:
        """Whether `path` holds what pause_files() saved."""
        return coldboot.saved(Path(path))

    @staticmethod
    def boot_files(path: str | os.PathLike[str], *, timeout: float | None = None) -> tuple[Workspace, dict[str, Any]]:
        """The cold boot of pause_files(): a new workspace (new hostname and boot id) with the saved
        spec, egress rules and files, and the `extra` saved with them; `timeout` its lifetime
        (None or 0: none). `path` is left for the caller to remove."""
        return coldboot.boot(Path(path), timeout, Workspace.create)

    def reboot(self, *, timeout: float | None = None, keep: tuple[str, ...] = ()) -> Workspace:
        """A cold boot of a workspace paused to disk (pause_to_disk), its memory ignored: a new
        workspace with the saved files and spec, and the files named in `keep` (relative to
        state_dir) carried over; this one is then destroyed. WorkspaceStateError where it is
        not paused to disk."""
        return coldboot.reboot(self, timeout, keep, Workspace.create)

    def signal(self, sig: int) -> None:
        """Send `sig` to the workspace's init: KILL ends the workspace (destroy() removes what is
        left); TERM, INT, HUP, QUIT, USR1 and USR2 are forwarded to every process in it."""
        if sig == _signal.SIGKILL:
            self._cgroup().thaw()  # a frozen task cannot act on SIGKILL
        os.kill(self.live_init_pid(), sig)

    def snapshot(self, memory: str = "auto", *, incremental: bool = True) -> Snapshot:
        """Freeze briefly, capture the whole workspace, resume it; the Snapshot can fork many times.

        memory is the engine every fork of the snapshot uses, chosen now: "cow" (the default
        where /dev/bunshin exists) keeps the anonymous memory in holders shared copy-on-write
        with the source; "ksm" and "copy" keep it in CRIU images.

        incremental: store only the pages that differ from the retained snapshot this
        workspace's memory last matched (its previous snapshot, or the one it was forked from):
        where the kernel tracks dirty pages the freeze writes only the pages written since;
        elsewhere the pages equal to that snapshot's are dropped after the source resumes.
        Releasing that snapshot first is fine: the pages this one reads stay until it goes.
        False: a complete snapshot that reads nothing from another.
        """
        return Snapshot.take(self, memory, incremental=incremental)

    def fork(self, count: int = 1, memory: str = "auto", *, timeout: float | None = None,
             die_with_creator: bool = False) -> list[Workspace | Exception]:
        """Live-fork into `count` running clones (E2B semantics: each entry is a Workspace or the
        Exception that clone failed with; the source keeps running unchanged either way).

        memory: "copy" (private copies), "ksm" (merged after the fact), "cow" (kernel module),
        or "auto" (cow when /dev/bunshin exists, else ksm on Linux >= 6.4, else copy).
        timeout / die_with_creator: each clone's own lifetime (none by default, never the source's).
        """
        # The snapshot lives only for this fork: not worth comparing its pages after the thaw.
        with _capture(self, memory, delta=True, dedupe=False) as snap:
            return snap.fork(count, timeout=timeout, die_with_creator=die_with_creator)

    def set_timeout(self, timeout: float) -> None:
        """End the workspace `timeout` seconds from now (0: never), enforced by its init."""
        self.live_init_pid()  # a typed error where it has stopped
        rec = self._rec
        rec.lifetime = dataclasses.replace(rec.lifetime, deadline=lifetime.deadline_after(timeout))
        rec.save()
        assert rec.process is not None
        lifetime.apply(self.id, rec.process, rec.lifetime)

    def destroy(self) -> None:
        """Kill every process and remove mounts, cgroups, network, layers and state. Idempotent."""
        # Concurrent destroys of one object must not close the pidfd twice: the second close
        # could hit a descriptor another thread has been handed since.
        with self._lock:
            pidfd, self._pidfd = self._pidfd, None
            pipeline.release(Build(self._rec, pidfd=pidfd))

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"<Workspace {self.id} init={self.init_pid} {self._rec.status}>"

    # ---- an egress hold (bunshinrl's speculation); its rules are network/egress.py's ----

    def hold_egress(self) -> bool:
        """Refuse every new connection out of the workspace, on top of its own policy (no
        allow_out of it lifts the hold), until release_egress_hold(): what runs meanwhile has no
        remote effect. Connections already open keep going; forks do not inherit the hold, and
        destroy() removes it. False for a workspace with no bridged link (nothing leaves it);
        WorkspaceStateError once it has stopped."""
        self.live_init_pid()
        return egress_rules.hold_closed(self.id, self._rec.network)

    def release_egress_hold(self) -> None:
        """End hold_egress(): the workspace's own policy decides again. Idempotent."""
        egress_rules.release_hold(self.id)

    def egress_refused(self) -> int:
        """How many packets the current hold has refused (0 when none is held)."""
        return egress_rules.refused(self.id, egress_rules.HOLD)


def _fresh_egress(rec: Record) -> None:
    """The egress policy as the record on disk says now: set_egress() from another process (E2B's
    server, Sandbox.update_network by id) changes it, and forks must inherit that one."""
    with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
        egress = Record.load(rec.id).spec.egress
        if egress != rec.spec.egress:
            rec.spec = dataclasses.replace(rec.spec, egress=egress)


def _capture(ws: Workspace, memory: str, *, delta: bool, dedupe: bool) -> Snapshot:
    """Snapshot.take and Workspace.fork's snapshot: `delta` stores only pages that differ from the
    last retained snapshot, `dedupe` compares them after the thaw."""
    engine = memory_engines.resolve(memory)  # an engine this host lacks fails before any freeze
    if not ws.is_running():
        raise WorkspaceStateError(f"workspace {ws.id} is not running (destroyed, or its init died)")
    _fresh_egress(ws.record)  # the clones inherit the policy in force, whoever set it
    return Snapshot(snapshot.take(ws.record, engine, delta=delta, dedupe=dedupe))


class Snapshot:
    """The frozen, retained state of a workspace. fork() may be called any number of times."""

    # What a saved snapshot's directory holds (save()).
    layout = snapshot.LAYOUT

    def __init__(self, captured: Captured) -> None:
        self._snap = captured
        self._released = False
        self._fixed_bytes: int | None = None

    @classmethod
    def take(cls, ws: Workspace, memory: str = "auto", *, incremental: bool = True) -> Snapshot:
        """Capture `ws` for the memory engine `memory` (see Workspace.snapshot)."""
        return _capture(ws, memory, delta=incremental, dedupe=incremental)

    # ---- properties ----

    @property
    def captured(self) -> Captured:
        """Its captured state (contract.Captured): what accounting and the entrances read of it."""
        return self._snap

    @property
    def id(self) -> str:
        return self._snap.meta.id

    @property
    def source_id(self) -> str:
        return self._snap.meta.source

    @property
    def dir(self) -> Path:
        return self._snap.dir

    @property
    def memory(self) -> str:
        """The memory engine its clones fork with, chosen when it was taken (or loaded)."""
        return self._snap.meta.memory

    @property
    def kind(self) -> str:
        """"cow" (memory held by holders, forks share it) or "image" (memory in CRIU images)."""
        return memory_engines.kind(self.memory)

    @property
    def timing(self) -> Timing:
        """How long the source was frozen, the time per stage, and CRIU's dump statistics."""
        return self._snap.meta.timing or Timing(0.0, 0.0)

    @property
    def parent(self) -> str | None:
        """The id of the snapshot whose pages this one's images read (None: it holds them all)."""
        return self._snap.meta.parent

    @property
    def images_dir(self) -> Path:
        return self._snap.images

    @property
    def rootfs_digest(self) -> str:
        fs = self._snap.meta.fs
        return fs.rootfs.digest if fs else ""

    def image_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.images_dir.iterdir() if f.is_file())

    def retained_bytes(self) -> int:
        """What keeping this snapshot costs now: its own images (an incremental one's delta) and
        saved file-system layer; its share of released snapshots kept only because its images
        read their pages; and, for a cow snapshot, the anonymous pages only its holders still map.

        A cow snapshot shares every page with its source at first, so it starts near its images'
        size and grows by the pages the source writes afterwards; a cache bounding its memory
        should measure it again before it decides what to evict.
        """
        self._check_live()
        if self._fixed_bytes is None:
            self._fixed_bytes = snapshot.file_bytes(self._snap)
        return self._fixed_bytes + snapshot.pinned_bytes(self._snap) + memory_engines.held_bytes(self._snap)

    def host_memory(self) -> HostMemory:
        """What keeping this snapshot costs the host's memory now (`stores`): its images on the
        state root's tmpfs, its frozen layer where storage keeps it in memory, and for a cow
        snapshot the pages only its holders still map."""
        self._check_live()
        return accounting.of_snapshot(self._snap)

    def _check_live(self) -> None:
        if self._released:
            raise WorkspaceStateError(f"snapshot {self.id} was released")

    # ---- forking ----

    def fork(self, count: int = 1, memory: str | None = None, *, timeout: float | None = None,
             die_with_creator: bool = False) -> list[Workspace | Exception]:
        """Start `count` running clones with the engine the snapshot was taken for. Each succeeds
        or fails on its own (E2B semantics): a failed clone is an Exception in the list and leaves
        nothing behind. memory: None or "auto" (the snapshot's engine), or another engine that
        restores the same capture ("copy" and "ksm" both restore CRIU images).
        timeout / die_with_creator: each clone's lifetime (see Workspace.create)."""
        self._check_live()
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise SpecError(f"count must be a positive integer, got {count!r}")
        engine = memory_engines.for_fork(self.memory, self.id, memory)
        life = lifetime.asked(timeout, die_with_creator)
        return [Workspace(r.rec, r.pidfd) if isinstance(r, Build) else r
                for r in pipeline.fork(self._snap, count, engine, life)]

    # ---- durability ----

    def save(self, path: str | os.PathLike[str], *, incremental: bool = False) -> Future[str]:
        """Write a durable copy to `path` (a new directory) in the background; the source has
        long resumed. The future's result is the path. A cow snapshot's holders are read into
        complete images, so the saved copy loads and forks with the copy or ksm engine.

        incremental: write only this snapshot's own pages (its delta against `parent`), for a
        store that keeps the parent's saved copy: load() then needs the parent's saved images at
        `layout.parent` inside the directory. A snapshot that holds all its pages (or a cow one)
        is saved complete either way; the saved SnapshotMeta's parent says which it is."""
        self._check_live()
        return snapshot.save(self._snap, path, incremental=incremental)

    @classmethod
    def load(cls, path: str | os.PathLike[str], memory: str | None = None) -> Snapshot:
        """Open a snapshot written by save(). It is used in place and never deleted by release().
        memory: the engine its clones fork with (None: the one it was taken with, where its
        images serve it; else the best this host runs)."""
        return cls(snapshot.load(path, memory))

    def release(self) -> None:
        """Drop the retained state (images, file-system snapshot, memory holders). Idempotent."""
        if self._released:
            return
        self._released = True
        pipeline.release(self._snap)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} of {self.source_id}>"
