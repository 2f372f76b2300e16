"""Private writable layers (overlay upper + work dirs), and copying layers where that is needed.

A workspace's layer lives under its storage root: the layer store by default (store.py), or
`storage_dir`/bunshin-layers. On btrfs each layer is a subvolume of its own, because a
snapshot freezes it with a read-only subvolume snapshot; elsewhere it is a plain directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

from .. import native
from ..errors import SpecError
from ..state import Layer
from . import quota, store
from .btrfs import btrfsutil, is_btrfs

SNAPSHOTS = "snapshots"  # frozen layers, beside the workspaces' layers of one storage root
_libc = ctypes.CDLL(None, use_errno=True)


def storage_root(storage_dir: str | None) -> Path:
    """Where layers live (made, with its modes, if missing): a layer, a frozen layer or a saved
    snapshot's imported one goes nowhere else."""
    if storage_dir is None:
        root = store.default_root()
    else:
        p = Path(storage_dir)
        if not p.is_dir():
            raise SpecError(f"storage_dir {storage_dir} does not exist; create it or use setup_btrfs_loop()")
        root = p / "bunshin-layers"
    _prepare(root)
    return root


_swept: set[str] = set()


def _prepare(root: Path) -> None:
    """A storage root a local user passes through to nothing (store.py): the root 0711, its
    frozen layers' directory 0700; the layers a store made before these modes, 0700, once."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, store.ROOT_MODE)
    snaps = root / SNAPSHOTS
    snaps.mkdir(mode=store.PRIVATE_MODE, exist_ok=True)
    os.chmod(snaps, store.PRIVATE_MODE)
    if str(root) not in _swept:
        store.private_dirs(root, [n for n in os.listdir(root) if n.startswith("ws-")])
        _swept.add(str(root))


def create_layer(ws_id: str, storage_dir: str | None, disk_limit: int | None = None) -> Layer:
    """A new empty layer, held to `disk_limit` bytes: a qgroup limit on btrfs, a tmpfs of that
    size on a tmpfs root (the state root's, where there is no layer store)."""
    root = storage_root(storage_dir)
    path = root / ws_id
    if is_btrfs(root):
        btrfsutil.create_subvolume(str(path))
        layer = Layer("btrfs", str(path))
        if disk_limit is not None:
            try:
                quota.limit(str(path), disk_limit)
            except BaseException:
                remove_layer(layer)
                raise
    elif disk_limit is not None and store.fs_magic(root) == store.TMPFS_MAGIC:
        path.mkdir()
        layer = Layer("dir", str(path))
        try:
            native.mount("bunshin-layer", str(path), "tmpfs", native.MS_NOSUID | native.MS_NODEV,
                         f"size={disk_limit},mode=700")
        except BaseException:
            remove_layer(layer)
            raise
    elif disk_limit is not None:
        raise SpecError(f"disk_limit needs layers on btrfs or tmpfs, and {root} is on neither; "
                        "put storage_dir on btrfs (see 'bunshin storage setup')")
    else:
        path.mkdir()
        layer = Layer("dir", str(path))
    os.chmod(path, store.PRIVATE_MODE)
    os.mkdir(layer.upper, 0o755)
    os.mkdir(layer.work, 0o700)
    return layer


def remove_layer(lay: Layer) -> None:
    if not os.path.lexists(lay.path):
        return
    if lay.kind == "btrfs":
        # Overlay's work dir holds a root-owned 000 directory; subvolume deletion copes with it.
        btrfsutil.delete_subvolume(lay.path, recursive=True)
        if quota.mode(Path(lay.path).parent) is not None:
            # The qgroups of subvolumes dropped since, whose last extents went with them.
            quota.sweep(Path(lay.path).parent)
    else:
        if os.path.ismount(lay.path):  # a disk_limit's tmpfs
            native.umount2(lay.path, native.MNT_DETACH)
        shutil.rmtree(lay.path)


def at(path: Path) -> Layer:
    """The layer at `path`, by what is there (for leftovers no record describes)."""
    if is_btrfs(path) and btrfsutil.is_subvolume(str(path)):
        return Layer("btrfs", str(path))
    return Layer("dir", str(path))


def copy_tree(src: str, dst: str) -> None:
    # cp -a keeps what overlayfs needs and shutil cannot copy: sockets, whiteout device
    # nodes and trusted.overlay.* xattrs. --reflink=auto shares extents where the fs can.
    proc = subprocess.run(["cp", "-a", "--reflink=auto", src, dst], capture_output=True, text=True)
    if proc.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(dst)
        raise OSError(f"copying layer {src} to {dst} failed: {proc.stderr.strip()}")


def copy_into(srcs: list[str], dst_dir: str) -> None:
    """cp -a several entries into one directory (one process for many files)."""
    for i in range(0, len(srcs), 512):
        proc = subprocess.run(["cp", "-a", "--reflink=auto", "-t", dst_dir, "--", *srcs[i:i + 512]],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"copying into {dst_dir} failed: {proc.stderr.strip()}")


def flush(lay: Layer) -> None:
    """Write back the layer's file system's dirty data (syncfs), so that a btrfs snapshot taken
    right after has almost nothing left to write back."""
    fd = os.open(lay.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {lay.path}: {os.strerror(err)}")
    finally:
        os.close(fd)
