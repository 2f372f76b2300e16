"""Frozen layers: a snapshot's read-only copy of its source's upper, stacked under its clones.

Taken while the source is frozen (a read-only btrfs snapshot: no data copied; elsewhere a copy,
once per snapshot), a frozen layer is the top lower of every clone forked from that snapshot,
so siblings read the same inodes and the host caches their pages once. A clone forked again
adds its own frozen upper above it. Past MAX_STACK layers (or overlay options too long for
mount(2) and CRIU's 4 KiB mountinfo lines) a snapshot flattens its stack into one layer by
reflink copy, after the source has resumed.

A frozen layer lives in `<storage root>/snapshots/<name>` and outlives the Snapshot object that
made it while clones stack on it: it is removed when no workspace record and no snapshot
references it any more (drop_unused), and gc removes those a crashed process left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from .. import state
from ..state import FsState, Layer, SnapshotMeta, Status
from . import layers
from .btrfs import btrfsutil, same_fs

MAX_STACK = 16  # frozen layers under a clone: each adds ~0.6 µs to every negative lookup
MAX_OPTIONS = 3072  # overlay options, below one page (mount(2)) and CRIU's 4096-byte mountinfo lines
LOADED = "load-"  # frozen layers imported from saved snapshots: load-<pid>-<hex>
HOLDER = "holder"  # in an imported layer: "<pid> <starttime>" of the process whose snapshot holds it
ORPHAN_AGE = 60.0
OPAQUE = "trusted.overlay.opaque"


def dest_for(lay: Layer, name: str) -> Path:
    """Where a frozen layer of `lay` (a workspace's layer) goes: beside it, so that on btrfs
    it is a snapshot within the same file system."""
    return Path(lay.path).parent / layers.SNAPSHOTS / name


def freeze(lay: Layer, dest: Path) -> tuple[Layer, int | None]:
    """The layer's upper, frozen at `dest`: a read-only btrfs snapshot, else a copy. Returns the
    frozen layer and the bytes copied (None where nothing was copied). The workspace is frozen."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if lay.kind == "btrfs" and same_fs(lay.path, dest.parent):
        btrfsutil.create_snapshot(lay.path, str(dest), read_only=True)
        return Layer("btrfs", str(dest)), None
    dest.mkdir()
    frozen = Layer("dir", str(dest))
    try:
        layers.copy_tree(lay.upper, frozen.upper)
    except BaseException:
        layers.remove_layer(frozen)
        raise
    return frozen, state.tree_bytes(frozen.upper)


def too_deep(fs: FsState, root: Path) -> bool:
    """Whether a clone of a snapshot with this state would stack too much."""
    if len(fs.lowers) + 1 > MAX_STACK:
        return True
    probe = Layer("dir", str(root / "ws-000000000000"))  # a clone's layer name, as long as any
    opts = overlay_options((fs.layer, *fs.lowers) if fs.layer else fs.lowers, fs.rootfs.lowerdirs, probe)
    return len(opts) > MAX_OPTIONS


# With an index and file handles that decode (nfs_export), CRIU dumps an inotify watch on any
# file of the overlay by handle: without them it fails ("Can't dump that handle").
FEATURES = "index=on,nfs_export=on"


def overlay_options(stack: Iterable[Layer], rootfs_lowers: Iterable[str], upper: Layer) -> str:
    lowers = [lay.upper for lay in stack] + list(rootfs_lowers)
    return f"lowerdir={':'.join(lowers)},upperdir={upper.upper},workdir={upper.work},{FEATURES}"


# ---- flattening: several overlay layers into one, as overlayfs shows them ----


def is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _copy_meta(src: str, dst: str) -> None:
    """A merged directory takes its upper's owner, mode, xattrs (an opaque mark below it stays:
    it still hides what lies under the stack) and times."""
    st = os.lstat(src)
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _apply(src: str, dst: str) -> None:
    """Put the overlay layer `src` over `dst` (the merge of the layers below it): an entry of
    src replaces dst's, whiteouts included, except that a plain directory over a directory
    merges. Replaced entries are copied in one cp per directory (reflinks where possible)."""
    replace = []
    merge = []
    with os.scandir(src) as it:
        for e in it:
            d = os.path.join(dst, e.name)
            if e.is_dir(follow_symlinks=False) and not is_opaque(e.path) \
                    and os.path.isdir(d) and not os.path.islink(d):
                merge.append((e.path, d))
            else:
                _remove(d)
                replace.append(e.path)
    if replace:
        layers.copy_into(replace, dst)
    for s, d in merge:
        _apply(s, d)
    _copy_meta(src, dst)


def flatten(stack: list[Layer], dest: Path, subvolume: bool = True) -> Layer:
    """One layer beside `dest` (at dest.flat) showing what `stack` (top first) shows, whiteouts
    and opaque directories included: the bottom layer as a writable btrfs snapshot (where
    `subvolume` allows; else a copy), then each layer above it applied in turn, sharing extents
    by reflink where the file system can. The caller renames it into place."""
    bottom = stack[-1]
    tmp = dest.with_name(dest.name + ".flat")
    if subvolume and bottom.kind == "btrfs" and same_fs(bottom.path, dest.parent):
        btrfsutil.create_snapshot(bottom.path, str(tmp))
        out = Layer("btrfs", str(tmp))
    else:
        tmp.mkdir()
        out = Layer("dir", str(tmp))
        layers.copy_tree(bottom.upper, out.upper)
    try:
        for lay in reversed(stack[:-1]):
            _apply(lay.upper, out.upper)
        if out.kind == "btrfs":
            btrfsutil.set_subvolume_read_only(out.path, True)
    except BaseException:
        layers.remove_layer(out)
        raise
    return out


def import_saved(upper: Path, root: Path) -> Layer:
    """A saved snapshot's layer copied into a storage root (reflinks where it can), since
    overlayfs refuses a lower inside another lower of the same file system. Its HOLDER file
    names the live process whose loaded snapshot holds it, until that snapshot is released."""
    pid = os.getpid()
    start = state.proc_starttime(pid)
    dest = root / layers.SNAPSHOTS / f"{LOADED}{pid}-{secrets.token_hex(6)}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.mkdir()
    frozen = Layer("dir", str(dest))
    try:
        (dest / HOLDER).write_text(f"{pid} {start}\n")
        layers.copy_tree(str(upper), frozen.upper)
    except BaseException:
        layers.remove_layer(frozen)
        raise
    return frozen


def let_go(lay: Layer) -> None:
    """The loaded snapshot holding an imported layer is released: only clones keep it now."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path(lay.path) / HOLDER)


# ---- lifetime ----


# Written (under the lock) into the state directory of a workspace or snapshot whose frozen
# layers are being let go, before it decides what to remove: a release running beside it then
# no longer counts it as a user. Without it, a clone and its snapshot released at the same time
# would each keep the layer for the other, and nobody would remove it. It is the marker a
# released snapshot kept for its images' readers carries too.
RELEASED = state.RELEASED


def _state_dir(owner: str) -> Path:
    return state.RUN_ROOT / state.SNAPSHOTS / owner if owner.startswith("snap-") else state.RUN_ROOT / owner


def _releasing(owner: str) -> bool:
    return (_state_dir(owner) / RELEASED).exists()


# The marker is read before the state it qualifies, in every check below. A marker appears only
# under the lock these checks run in, but a state directory is removed outside it (just after
# its marked release): read the other way round, a record loaded just before its directory went
# looks unmarked, and its layer is kept for an owner that is gone (CI saw one such leak).


def _references(exclude: str) -> set[str]:
    """Paths of the frozen layers any workspace or snapshot other than `exclude` (and other than
    those being released) stacks or holds."""
    refs: set[str] = set()
    for rec in state.records(exclude, skip=_releasing):
        if rec.fs is not None and rec.status is not Status.DESTROYED:
            refs.update(lay.path for lay in rec.fs.lowers)
    for snap_id in state.snapshot_ids():
        if snap_id == exclude or _releasing(snap_id):
            continue
        with contextlib.suppress(FileNotFoundError, ValueError):
            meta = SnapshotMeta.load(state.RUN_ROOT / state.SNAPSHOTS / snap_id)
            if meta.fs is not None:
                refs.update(lay.path for lay in (meta.fs.layer, *meta.fs.lowers) if lay is not None)
    return refs


def _owner_alive(path: Path, exclude: str) -> bool:
    """A frozen layer no state references yet may still be held: by the snapshot taking it (its
    directory exists), or by a live process's loaded snapshot (HOLDER)."""
    if path.name.startswith(LOADED):
        try:
            pid, start = (path / HOLDER).read_text().split()
            return str(state.proc_starttime(int(pid))) == start
        except (OSError, ValueError):
            return False
    return path.name != exclude and not _releasing(path.name) \
        and (state.RUN_ROOT / state.SNAPSHOTS / path.name).exists()


def _lock() -> contextlib.AbstractContextManager[None]:
    return state.lock("fs-frozen")


def drop_unused(candidates: Iterable[Layer], exclude: str, own: Layer | None = None) -> list[str]:
    """Remove each of `candidates` (frozen layers) that nothing but `exclude` (the workspace or
    snapshot being released) uses any more; `own` is the releasing snapshot's own frozen layer,
    which no owner protects. Returns the paths removed."""
    todo = [lay for lay in (*candidates, *([own] if own else [])) if os.path.lexists(lay.path)]
    if not todo:
        return []
    removed = []
    with _lock():
        with contextlib.suppress(FileNotFoundError):
            (_state_dir(exclude) / RELEASED).touch()
        refs = _references(exclude)
        for lay in todo:
            if lay.path in refs or (lay != own and _owner_alive(Path(lay.path), exclude)):
                continue
            layers.remove_layer(lay)
            removed.append(lay.path)
    return removed


def orphans(roots: Iterable[Path]) -> list[str]:
    """Remove frozen layers under `roots` that nothing references and no live owner holds."""
    removed = []
    now = time.time()
    with _lock():
        refs = _references("")
        for root in roots:
            d = root / layers.SNAPSHOTS
            for name in sorted(os.listdir(d)) if d.is_dir() else []:
                path = d / name
                with contextlib.suppress(OSError):
                    if str(path) in refs or _owner_alive(path, "") or now - path.lstat().st_mtime < ORPHAN_AGE:
                        continue
                    layers.remove_layer(layers.at(path))
                    removed.append(str(path))
    return removed
