"""File-system subsystem (paper §4.5): a workspace's root file system and its private layer.

Each workspace mounts an overlayfs: shared read-only lower layers (rootfs.py: the host's
/usr under a generated skeleton, a debootstrap, a directory or an OCI image) plus a private
upper layer (layers.py), a btrfs subvolume where the storage allows (btrfs.py). A snapshot
copies the upper while the source is frozen (a read-only btrfs snapshot, or a reflink/copy);
each clone gets a writable copy of that over the same lowers, so unchanged files share one
page cache.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from .. import native, state
from ..contract import Build, Capture, Check, Held, Mount, Part
from ..errors import ForkError
from ..state import FsState, Layer
from . import identity, layers, rootfs
from .btrfs import loop_devices_for, setup_btrfs_loop, teardown_btrfs_loop

__all__ = ["FsPart", "digest", "loop_devices_for", "setup_btrfs_loop", "teardown_btrfs_loop"]

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


def _overlay(root_fs: state.Rootfs, layer: Layer) -> str:
    return f"lowerdir={':'.join(root_fs.lowerdirs)},upperdir={layer.upper},workdir={layer.work}"


class FsPart(Part):
    name = "fs"
    probes = (check_overlayfs, check_btrfs)

    def prepare(self, b: Build) -> None:
        rec = b.rec
        root_fs = rootfs.resolve(rec.spec.rootfs)
        layer = layers.create_layer(rec.id, rec.spec.storage_dir)
        rec.fs = FsState(root_fs, layer)
        rec.save()
        identity.seed(Path(layer.upper), rec.hostname, root_fs)
        # The workspace's first process mounts it inside its own mount namespace.
        b.root = Mount(self._mountpoint(b), _overlay(root_fs, layer))

    def capture(self, c: Capture) -> None:
        src = c.source.fs
        assert src is not None and src.layer is not None
        if src.layer.kind == "btrfs":
            dest = layers.storage_root(c.source.spec.storage_dir) / "snapshots" / c.snap.meta.id
        else:
            dest = c.snap.dir / SAVED_LAYER
        c.snap.meta.fs = FsState(src.rootfs, layers.snapshot_layer(src.layer, str(dest)))

    def restore(self, b: Build) -> None:
        assert b.source is not None
        src = b.source.meta.fs
        assert src is not None and src.layer is not None
        rec = b.rec
        layer = layers.clone_layer(src.layer, rec.id, rec.spec.storage_dir)
        rec.fs = FsState(src.rootfs, layer)
        rec.save()
        identity.write_identity(Path(layer.upper), rec.hostname)
        # CRIU restores into it (--root), so it is mounted here; the clone's mount namespace
        # holds its own reference once restored, and the host needs none.
        point = self._mountpoint(b)
        opts = _overlay(src.rootfs, layer)
        native.mount("overlay", str(point), "overlay", 0, opts)
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
        else:
            fs = held.meta.fs if held.owned else None
        if fs is not None and fs.layer is not None:
            layers.remove_layer(fs.layer)

    def gc(self) -> list[str]:
        """Layers under the default storage root whose workspace left no record."""
        root = layers.storage_root(None)
        removed = []
        now = time.time()
        for name in sorted(os.listdir(root)) if root.is_dir() else []:
            path = root / name
            with contextlib.suppress(OSError):
                if name.startswith("ws-") and not (state.RUN_ROOT / name).exists() \
                        and now - path.stat().st_mtime > ORPHAN_AGE:
                    layers.remove_layer(Layer("dir", str(path)))
                    removed.append(str(path))
        return removed


def _detach(point: Path) -> None:
    with contextlib.suppress(OSError):
        native.umount2(str(point), native.MNT_DETACH)


def save(fs: FsState, dest: Path) -> FsState:
    """Copy a snapshot's layer into a saved snapshot's directory; the state to save with it."""
    assert fs.layer is not None
    layers.copy_tree(fs.layer.path, str(dest / SAVED_LAYER))
    return FsState(fs.rootfs, Layer("dir", SAVED_LAYER))


def load(fs: FsState, directory: Path, snap_id: str) -> FsState:
    """A saved snapshot's fs state, used in place: refused if its root file system changed since."""
    current = rootfs.resolve(fs.rootfs.source)
    if current.digest != fs.rootfs.digest:
        raise ForkError(
            f"the root file system {fs.rootfs.source!r} changed since snapshot {snap_id} was saved "
            f"({fs.rootfs.digest} -> {current.digest}); clones would see different files"
        )
    return FsState(current, Layer("dir", str(directory / SAVED_LAYER)))
