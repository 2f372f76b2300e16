"""Where workspaces and snapshots live on the host, and the typed state saved there.

/run/bunshin/<id>/state.json is a workspace's Record and /run/bunshin/snapshots/<id>/snapshot.json
a snapshot's SnapshotMeta. As runc's State, they are the single source of truth that lets a
second process connect to, or garbage-collect, what another process made; no daemon is needed.
Each subsystem's share of them is one dataclass below, and save()/load() are the only code
that turns them into JSON and back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import fcntl
import functools
import json
import os
import secrets
import shutil
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import native
from .errors import IllegalTransition, PrivilegeError
from .host import HOST
from .spec import WorkspaceSpec

RUN_ROOT = HOST.run_root
SNAPSHOTS = "snapshots"
# In the state directory of a workspace or snapshot being released, or of a released snapshot
# kept only for the images that still read its pages: it owns nothing any more. One marker for
# both (process/chain.py keeps it when it trims a released snapshot, fs/frozen.py reads it), so
# that a kept snapshot never looks like a live owner of its frozen layer.
RELEASED = ".released"


def require_root() -> None:
    if os.geteuid() != 0:
        raise PrivilegeError("bunshin needs root (namespaces, mounts, cgroups); run it as root")


def run_root() -> Path:
    """The state root, on its own tmpfs when it would otherwise share the host root's file system.

    Overlayfs refuses a layer that lies inside another layer on the same file system, and the
    host rootfs uses the host's `/` as its bottom layer; a separate tmpfs keeps the generated
    layers and default upper directories out of it.
    """
    RUN_ROOT.mkdir(parents=True, exist_ok=True, mode=0o711)
    if os.stat(RUN_ROOT).st_dev == os.stat("/").st_dev:
        with lock("mount-run-root", root=Path("/run")):
            if os.stat(RUN_ROOT).st_dev == os.stat("/").st_dev:
                native.mount("bunshin", str(RUN_ROOT), "tmpfs", native.MS_NOSUID | native.MS_NODEV, "mode=711")
    return RUN_ROOT


@contextlib.contextmanager
def lock(name: str, root: Path | None = None) -> Iterator[None]:
    """A host-wide advisory lock (flock), held across processes."""
    d = root or RUN_ROOT
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / f".{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def new_id() -> str:
    return "ws-" + secrets.token_hex(6)


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(6)


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: tells a live process from a recycled pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _running(pid: int, starttime: int) -> bool:
    """The process is the one recorded and has not exited (a zombie awaiting its reaper has)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == starttime


def all_ids() -> list[str]:
    if not RUN_ROOT.is_dir():
        return []
    return sorted(n for n in os.listdir(RUN_ROOT) if n.startswith("ws-") and (RUN_ROOT / n).is_dir())


TRASH = ".trash"  # under RUN_ROOT: state directories on their way out


def remove_dir(d: Path) -> None:
    """Remove a workspace's or snapshot's state directory so that it is gone at once for every
    reader: renamed out of sight, then deleted. Deleting in place would leave, for a while, a
    directory without its RELEASED marker but with its record, which a concurrent release would
    take for a live owner (and keep a frozen layer for it). A crash in between leaves it under
    TRASH, which gc empties."""
    trash = RUN_ROOT / TRASH
    trash.mkdir(exist_ok=True)
    gone = trash / f"{d.name}-{secrets.token_hex(4)}"
    try:
        os.rename(d, gone)
    except FileNotFoundError:
        return
    except OSError:
        gone = d  # e.g. a mount point left inside: delete in place, as before
    shutil.rmtree(gone)


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """The sizes of the files under `path` (a layer's upper, a snapshot's directory), summed; a
    file removed meanwhile counts for nothing."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def empty_trash() -> list[str]:
    trash = RUN_ROOT / TRASH
    names = sorted(os.listdir(trash)) if trash.is_dir() else []
    for n in names:
        shutil.rmtree(trash / n, ignore_errors=True)
    return names


def snapshots_root() -> Path:
    return run_root() / SNAPSHOTS


def snapshot_ids() -> list[str]:
    """Every retained snapshot directory under the state root (used by gc and the leak checks)."""
    root = RUN_ROOT / SNAPSHOTS
    return sorted(os.listdir(root)) if root.is_dir() else []


# ---- each subsystem's state ----


@dataclass(frozen=True)
class Rootfs:
    """fs: the read-only lower layers a workspace's overlay stacks."""

    kind: str  # host | debian | dir | docker
    lowerdirs: tuple[str, ...]  # top first, as overlayfs lists them
    digest: str
    source: str
    shift: int = 0  # userns: its files belong to host ids shifted by this (rootfs.shifted)


@dataclass(frozen=True)
class Layer:
    """fs: a private layer, a subvolume or directory holding the overlay's upper/ and work/."""

    kind: str  # btrfs | dir
    path: str

    @property
    def upper(self) -> str:
        return os.path.join(self.path, "upper")

    @property
    def work(self) -> str:
        return os.path.join(self.path, "work")


@dataclass(frozen=True)
class FsState:
    """fs: a workspace's overlay is `layer`'s upper over `lowers` over the rootfs's lower layers.

    For a snapshot, `layer` is the source's upper frozen (read-only) and `lowers` the source's
    own stack; a clone stacks both, top first, under an empty upper of its own.
    """

    rootfs: Rootfs
    layer: Layer | None = None  # a workspace's writable layer, or a snapshot's frozen one
    lowers: tuple[Layer, ...] = ()  # frozen layers of the snapshots it descends from, top first

    def lowerdirs(self) -> tuple[str, ...]:
        """Every read-only layer of the overlay, top first."""
        return tuple(lay.upper for lay in self.lowers) + self.rootfs.lowerdirs


@dataclass(frozen=True)
class CgroupState:
    version: str  # v1 | v2
    paths: dict[str, str]  # controller (or "unified") -> directory


@dataclass(frozen=True)
class InitState:
    """process: the workspace's PID 1 on the host."""

    pid: int
    starttime: int

    def alive(self) -> bool:
        return _running(self.pid, self.starttime)


@dataclass(frozen=True)
class NetworkState:
    mode: str = "none"  # none | bridge
    bridge: str | None = None
    host_if: str | None = None
    ip: str | None = None
    prefixlen: int | None = None
    gateway: str | None = None
    nat: bool = False
    # A clone of a bridged workspace (network/clones.py): its conntrack zone (also its fwmark
    # and routing table, offset), and the unique address the host rewrites its source to.
    zone: int | None = None
    snat: str | None = None

    def info(self) -> dict[str, Any]:
        """What WorkspaceInfo.network shows: the fields this mode has."""
        shown = dataclasses.asdict(self) if self.mode != "none" else {"mode": self.mode}
        return {k: v for k, v in shown.items() if v is not None}


@dataclass(frozen=True)
class Lineage:
    """process: the snapshots whose images this workspace's memory last matched, newest first (the
    one it was forked from, or the ones taken of it since). A new snapshot stores its pages as a
    delta against the first of them still retained."""

    snapshots: tuple[str, ...] = ()
    # snapshots[0] was dumped from this workspace with the kernel's dirty tracking reset: the pages
    # not written since are its pages, and CRIU may leave them out of the next dump.
    tracked: bool = False


@dataclass(frozen=True)
class Lifetime:
    """process: when the workspace's init ends it (lifetime.py), wall-clock seconds, 0 for never."""

    deadline: float = 0.0
    lease: float = 0.0  # a die_with_creator workspace ends this long after its creator stops renewing


@dataclass(frozen=True)
class Timing:
    """A snapshot's cost to its source: how long it was frozen, and where the time went."""

    frozen_seconds: float
    dump_seconds: float
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage, freeze to dedupe
    criu: dict[str, int] = field(default_factory=dict)  # CRIU's dump statistics (stats-dump)


class Status(enum.StrEnum):
    """Where a workspace is in its lifecycle, as its record says (runc's containerState).

    A str, so that a record saved before this was an enum loads as it is, and a status
    compares equal to its name. Whether it is paused or its init died is not recorded: that is
    read from the host (Workspace.info().state derives it from this and them).

    Extension points: a state that later work adds (a template, a workspace paused to disk)
    is a member here, its row in TRANSITIONS, and its line in workspace.info_state().
    """

    CREATING = "creating"  # its parts are being prepared or restored
    RUNNING = "running"  # every part is built: its init runs (unless it died since)
    # Paused to disk (Workspace.pause_to_disk): its whole state saved at Record.saved and every
    # part released; only this record is left, and a resume restores it under the same id.
    PAUSED = "paused"
    DESTROYED = "destroyed"  # released, or being released: it owns nothing any more


# The moves each status allows; anything else raises IllegalTransition. Destroying is
# idempotent (a release that finds another process took the workspace apart already). A
# resume is a restore (PAUSED -> CREATING), and one that fails goes back to PAUSED.
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.CREATING: frozenset({Status.RUNNING, Status.PAUSED, Status.DESTROYED}),
    Status.RUNNING: frozenset({Status.PAUSED, Status.DESTROYED}),
    Status.PAUSED: frozenset({Status.CREATING, Status.DESTROYED}),
    Status.DESTROYED: frozenset({Status.DESTROYED}),
}
# Where a workspace paused to disk keeps its saved state by default: on disk, beside the layer
# store (the state root is a tmpfs, which would keep the memory a pause gives back).
PAUSED_ROOT = HOST.layer_store.parent / "paused"


@dataclass
class Record:
    """A workspace: its identity, its spec and one state per subsystem, filled in as it is built.

    `status` moves only along TRANSITIONS: assigning it checks the move (transition())."""

    id: str
    status: Status
    creator_pid: int
    created_at: float
    hostname: str
    spec: WorkspaceSpec
    parent: str | None = None
    fs: FsState | None = None
    cgroups: CgroupState | None = None
    process: InitState | None = None
    network: NetworkState | None = None
    lineage: Lineage | None = None
    # Seconds per subsystem while it was built ("fs"), and per stage within one ("fs.layer"); a
    # clone's also name the snapshot's stages ("snapshot.freeze").
    timings: dict[str, float] = field(default_factory=dict)
    # A clone's CRIU restore, from the start of CRIU to its answer, in wall-clock seconds: how
    # the restores of clones forked together overlap.
    restore_window: tuple[float, float] | None = None
    lifetime: Lifetime = field(default_factory=Lifetime)
    saved: str | None = None  # while PAUSED (and resuming): the directory its state is saved in

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "status":
            new = Status(value)  # a string from an older caller or a record on disk; ValueError if unknown
            if "status" in self.__dict__ and new not in TRANSITIONS[self.status]:
                raise IllegalTransition(f"workspace {self.id} cannot go from {self.status} to {new}")
            value = new
        super().__setattr__(name, value)

    def transition(self, to: Status) -> None:
        """Move to `to`; raises IllegalTransition where the lifecycle does not allow it."""
        self.status = to

    @property
    def dir(self) -> Path:
        return RUN_ROOT / self.id

    def save(self) -> None:
        save(self, self.dir / "state.json")

    @classmethod
    def load(cls, ws_id: str) -> Record:
        """The record of `ws_id`. An id that cannot name one (empty, a path, a NUL, longer than a
        file name) names none: FileNotFoundError, which callers report as no such workspace,
        rather than the OSError its path would raise or a path outside the state root."""
        if not ws_id or ws_id in (".", "..") or "/" in ws_id or "\0" in ws_id \
                or len(ws_id.encode("utf-8", "surrogateescape")) > 255:
            raise FileNotFoundError(errno.ENOENT, "no workspace record", ws_id)
        return load(cls, RUN_ROOT / ws_id / "state.json")

    def init_alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def creator_alive(self) -> bool:
        return proc_starttime(self.creator_pid) is not None


def records(exclude: str | None = None, skip: Callable[[str], bool] | None = None) -> Iterator[Record]:
    """Every readable workspace record, by id. One being removed or half written (a creator
    that died before saving it) is skipped: only gc, which reads ids, deals with those. `skip`
    is asked of each id before its record is read (a marker that must be read first)."""
    for ws_id in all_ids():
        if ws_id == exclude or (skip is not None and skip(ws_id)):
            continue
        try:
            yield Record.load(ws_id)
        except (OSError, ValueError):
            continue


@dataclass
class SnapshotMeta:
    """A snapshot: what it was taken from and with, and each subsystem's captured state."""

    id: str
    source: str
    created_at: float
    owner_pid: int
    hostname: str
    spec: WorkspaceSpec
    memory: str  # the memory engine it was taken for: clones fork with it
    cgroup_version: str = ""
    fs: FsState | None = None
    timing: Timing | None = None
    parent: str | None = None  # the snapshot whose images its own pages are a delta against

    FILE = "snapshot.json"

    def save(self, directory: Path) -> None:
        save(self, directory / self.FILE)

    @classmethod
    def load(cls, directory: Path) -> SnapshotMeta:
        return load(cls, directory / cls.FILE)


# ---- JSON, in one place ----

T = TypeVar("T")


def save(obj: Any, path: Path) -> None:
    """Write a state dataclass atomically."""
    tmp = path.with_name(path.name + ".tmp")
    # Without indent json uses its C encoder: a fork saves its record at every part, and the
    # pure-Python one made that 1 ms a save (`python -m json.tool` reads a record for a person).
    tmp.write_text(json.dumps(_plain(obj), sort_keys=True))
    os.replace(tmp, path)


def _plain(obj: Any) -> Any:
    """dataclasses.asdict without its deep copy of every leaf: the same JSON, in a third of the
    time (a fork saves its record at every part)."""
    names = _field_names.get(type(obj))
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _field_names.setdefault(type(obj), tuple(f.name for f in dataclasses.fields(obj)))
    if names is not None:
        return {n: _plain(getattr(obj, n)) for n in names}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


_field_names: dict[type, tuple[str, ...]] = {}


def load(cls: type[T], path: Path) -> T:
    """Read a state dataclass; raises FileNotFoundError, or ValueError for a record it cannot read."""
    try:
        return _decode(cls, json.loads(path.read_text()))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a {cls.__name__}: {e}") from e


@functools.cache
def _hints(tp: type) -> dict[str, Any]:
    # typing.get_type_hints evaluates every annotation string anew: 0.1 ms a class, most of
    # what reading a record cost (gc and a fork's release read every record).
    return typing.get_type_hints(tp)


def _decode(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        nested = [a for a in inner if dataclasses.is_dataclass(a)]
        return _decode(nested[0], value) if nested and isinstance(value, dict) else value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        # Fields a newer version wrote are ignored, as runc does; missing ones take their defaults.
        known = {f.name for f in dataclasses.fields(tp) if f.init}
        return tp(**{k: _decode(hints[k], v) for k, v in value.items() if k in known})
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(value)
    return value
