"""File-system subsystem (paper §4.5): a workspace's root file system and its private layer.

Each workspace mounts an overlayfs: shared read-only lower layers (rootfs.py: the host's
/usr under a generated skeleton, a debootstrap, a directory or an OCI image) plus a private
upper layer (layers.py), a btrfs subvolume in the layer store (store.py) by default. A
snapshot writes the upper back while the source still runs, then freezes it as a read-only
btrfs snapshot (frozen.py; elsewhere a copy, once per snapshot). Every clone stacks that
frozen layer over the source's own lowers under an empty upper of its own, so nothing is
copied per clone and siblings share one page cache of every file written before the fork.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from .. import idmap, images, native, state
from ..contract import Build, Capture, Check, Held, Mount, Part
from ..errors import ForkError
from ..state import FsState, Layer
from . import btrfs, frozen, identity, layers, quota, rootfs, store
from .btrfs import loop_devices_for, setup_btrfs_loop, teardown_btrfs_loop
from .store import StorageWarning

__all__ = ["FsPart", "StorageWarning", "digest", "loop_devices_for", "setup_btrfs_loop", "teardown_btrfs_loop"]

SAVED_LAYER = "fs"  # a saved snapshot's copy of the layer, beside its images
ORPHAN_AGE = 60.0  # a layer younger than this may belong to a workspace being created


def digest(source: str = "host") -> str:
    """The digest of a root file system (WorkspaceInfo.rootfs_digest of a workspace made from it),
    preparing its cached layers if needed but starting nothing."""
    return rootfs.resolve(source).digest


def _filesystems() -> set[str]:
    try:
        text = Path("/proc/filesystems").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in text.splitlines() if line.split()}


def check_overlayfs() -> Check:
    if "overlay" in _filesystems():
        return Check("overlayfs", True, "overlay in /proc/filesystems", required=True)
    return Check("overlayfs", False, "overlay is not in /proc/filesystems; try 'modprobe overlay'",
                 required=True)


def check_btrfs() -> Check:
    missing = []
    if "btrfs" not in _filesystems():
        missing.append("btrfs not in /proc/filesystems (try 'modprobe btrfs')")
    if native.which("mkfs.btrfs") is None:
        missing.append("mkfs.btrfs missing (apt install btrfs-progs)")
    if layers.btrfsutil is None:
        missing.append("btrfsutil not importable (apt install python3-btrfsutil)")
    if missing:
        return Check("btrfs", False, "; ".join(missing) + "; layers fall back to plain directories",
                     required=False)
    return Check("btrfs", True, "kernel support, mkfs.btrfs and btrfsutil present", required=False)


def _overlay(fs: FsState) -> str:
    assert fs.layer is not None
    return frozen.overlay_options(fs.lowers, fs.rootfs.lowerdirs, fs.layer)


class FsPart(Part):
    name = "fs"
    probes = (check_overlayfs, check_btrfs, store.check_store, quota.check_quotas)

    def prepare(self, b: Build) -> None:
        rec = b.rec
        root_fs = rootfs.resolve(rec.spec.rootfs, idmap.BASE if rec.spec.userns else 0)
        layer = layers.create_layer(rec.id, rec.spec.storage_dir, rec.spec.disk_limit)
        rec.fs = FsState(root_fs, layer)
        rec.save()
        identity.seed(Path(layer.upper), rec.hostname, root_fs)
        # The workspace's first process mounts it inside its own mount namespace.
        b.root = Mount(self._mountpoint(b), _overlay(rec.fs))

    def before_freeze(self, c: Capture) -> None:
        src = c.source.fs
        assert src is not None and src.layer is not None
        if src.layer.kind == "btrfs":
            # What is written between this and the freeze is flushed inside it: little, since
            # the store holds its dirty data at btrfs.DIRTY_LIMIT.
            layers.flush(src.layer)

    def capture(self, c: Capture) -> None:
        src = c.source.fs
        assert src is not None and src.layer is not None
        snap_id = c.snap.meta.id
        try:
            with c.stage("layer"):
                layer, copied = frozen.freeze(src.layer, frozen.dest_for(src.layer, snap_id))
        except OSError as e:
            raise ForkError(f"snapshot of {c.source.id} failed; the workspace keeps running: {e}") from e
        if copied is not None:
            store.warn_copy(f"snapshot {snap_id} of {c.source.id}", copied, Path(src.layer.path).parent)
        c.snap.meta.fs = FsState(src.rootfs, layer, src.lowers)
        if frozen.too_deep(c.snap.meta.fs, Path(src.layer.path).parent):
            c.after_thaw.append(lambda: self._flatten(c))

    @staticmethod
    def _flatten(c: Capture) -> None:
        """The snapshot's stack as one layer, replacing its frozen layer (no clone uses it yet)."""
        fs = c.snap.meta.fs
        assert fs is not None and fs.layer is not None
        dest = Path(fs.layer.path)
        flat = frozen.flatten([fs.layer, *fs.lowers], dest)
        layers.remove_layer(fs.layer)
        os.rename(flat.path, dest)
        c.snap.meta.fs = FsState(fs.rootfs, Layer(flat.kind, str(dest)))

    def restore(self, b: Build) -> None:
        assert b.source is not None
        src = b.source.meta.fs
        assert src is not None and src.layer is not None
        rec = b.rec
        with b.stage("fs.layer"):
            layer = layers.create_layer(rec.id, rec.spec.storage_dir, rec.spec.disk_limit)
            rec.fs = FsState(src.rootfs, layer, (src.layer, *src.lowers))
            rec.save()
            # No identity of its own: a clone keeps its source's /etc/hostname, /etc/hosts and
            # boot id, as it keeps its hostname (pipeline.fork).
            if rec.spec.userns:
                idmap.shift_tree(Path(layer.upper))
        # CRIU restores into it (--root), so it is mounted here; the clone's mount namespace
        # holds its own reference once restored, and the host needs none. nodev, as a created
        # workspace's root (csrc/native.c): a node in any layer opens nothing.
        point = self._mountpoint(b)
        opts = _overlay(rec.fs)
        with b.stage("fs.mount"):
            native.mount("overlay", str(point), "overlay", native.MS_NODEV, opts)
        b.deferred.append(lambda: _detach(point))
        b.root = Mount(point, opts)

    @staticmethod
    def _mountpoint(b: Build) -> Path:
        point = b.rec.dir / "rootfs"
        point.mkdir()
        return point

    def release(self, held: Held) -> None:
        if isinstance(held, Build):
            # A mount left under the state dir (a crashed fork's --root, CRIU's cgroup yard)
            # may still use the layer as its upper: detach first.
            native.unmount_below(held.rec.dir)
            fs = held.rec.fs
            if fs is None:
                return
            if fs.layer is not None:
                layers.remove_layer(fs.layer)
            frozen.drop_unused(fs.lowers, exclude=held.rec.id)
        else:
            fs = held.meta.fs
            if fs is not None:
                if fs.layer is not None:
                    frozen.let_go(fs.layer)
                # A loaded snapshot carries the id of the one it was saved from, which may still
                # live on this host: keyed by that id, its release marked the original released,
                # and the next release beside it removed the original's layer from under it. It
                # answers for its own imported layer only.
                owner = held.meta.id if held.owned or fs.layer is None else Path(fs.layer.path).name
                frozen.drop_unused(fs.lowers, exclude=owner, own=fs.layer)

    def gc(self) -> list[str]:
        """Layers under the default storage roots whose workspace left no record, frozen
        layers nothing uses, and the layer store's qgroups that outlived their subvolumes."""
        roots = [r for r in (store.ensure(), store.fallback_root()) if r is not None]
        removed = []
        now = time.time()
        for root in roots:
            for name in sorted(os.listdir(root)) if root.is_dir() else []:
                path = root / name
                with contextlib.suppress(OSError):
                    if name.startswith("ws-") and not (state.RUN_ROOT / name).exists() \
                            and now - path.stat().st_mtime > ORPHAN_AGE:
                        layers.remove_layer(layers.at(path))
                        removed.append(str(path))
        removed += frozen.orphans(roots)
        removed += rootfs.shifted_orphans(_rootfs_in_use())
        removed += images.store.gc()
        if roots and btrfs.is_btrfs(roots[0]):
            removed += [f"qgroup {q}" for q in quota.settle(roots[0])]
        return removed


def _rootfs_in_use() -> set[str]:
    """The root file system layers every workspace and snapshot stacks."""
    used: set[str] = set()
    for rec in state.records(""):
        if rec.fs is not None:
            used.update(rec.fs.rootfs.lowerdirs)
    for snap_id in state.snapshot_ids():
        with contextlib.suppress(FileNotFoundError, ValueError):
            meta = state.SnapshotMeta.load(state.RUN_ROOT / state.SNAPSHOTS / snap_id)
            if meta.fs is not None:
                used.update(meta.fs.rootfs.lowerdirs)
    return used


def _detach(point: Path) -> None:
    with contextlib.suppress(OSError):
        native.umount2(str(point), native.MNT_DETACH)


def save(fs: FsState, dest: Path) -> FsState:
    """Write a snapshot's stack, flattened into one layer, into a saved snapshot's directory;
    the state to save with it."""
    assert fs.layer is not None
    out = frozen.flatten([fs.layer, *fs.lowers], dest / SAVED_LAYER, subvolume=False)
    os.rename(out.path, dest / SAVED_LAYER)
    return FsState(fs.rootfs, Layer("dir", SAVED_LAYER))


def load(fs: FsState, directory: Path, snap_id: str, storage_dir: str | None = None) -> FsState:
    """A saved snapshot's fs state: its layer imported into the storage once (clones stack it
    from there), refused if its root file system changed since."""
    # An image the layer store holds whole needs neither its engine nor its registry again.
    current = (images.by_digest(fs.rootfs.source, fs.rootfs.digest) if fs.rootfs.kind == "image"
               and not fs.rootfs.shift else None) or rootfs.resolve(fs.rootfs.source, fs.rootfs.shift)
    if current.digest != fs.rootfs.digest:
        raise ForkError(
            f"the root file system {fs.rootfs.source!r} changed since snapshot {snap_id} was saved "
            f"({fs.rootfs.digest} -> {current.digest}); clones would see different files"
        )
    saved = Layer("dir", str(directory / SAVED_LAYER))
    root = layers.storage_root(storage_dir if storage_dir and os.path.isdir(storage_dir) else None)
    return FsState(current, frozen.import_saved(Path(saved.upper), root))
