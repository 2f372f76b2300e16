"""Private writable layers (overlay upper + work dirs).

When the storage directory is on btrfs, each workspace's layer is its own subvolume,
because fork snapshots it while the workspace is frozen. Elsewhere it is a plain
directory under the state root's tmpfs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from .. import state
from ..errors import SpecError
from ..state import Layer
from .btrfs import btrfsutil, is_btrfs


def storage_root(storage_dir: str | None) -> Path:
    if storage_dir is None:
        return state.run_root() / "layers" / "ws"
    p = Path(storage_dir)
    if not p.is_dir():
        raise SpecError(f"storage_dir {storage_dir} does not exist; create it or use setup_btrfs_loop()")
    return p / "bunshin-layers"


def create_layer(ws_id: str, storage_dir: str | None) -> Layer:
    root = storage_root(storage_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / ws_id
    if is_btrfs(root):
        btrfsutil.create_subvolume(str(path))
        layer = Layer("btrfs", str(path))
    else:
        path.mkdir()
        layer = Layer("dir", str(path))
    os.mkdir(layer.upper, 0o755)
    os.mkdir(layer.work, 0o700)
    return layer


def remove_layer(lay: Layer) -> None:
    if not os.path.lexists(lay.path):
        return
    if lay.kind == "btrfs":
        # Overlay's work dir holds a root-owned 000 directory; subvolume deletion copes with it.
        btrfsutil.delete_subvolume(lay.path, recursive=True)
    else:
        shutil.rmtree(lay.path)


def copy_tree(src: str, dst: str) -> None:
    # cp -a keeps what overlayfs needs and shutil cannot copy: sockets, whiteout device
    # nodes and trusted.overlay.* xattrs. --reflink=auto shares extents where the fs can.
    proc = subprocess.run(["cp", "-a", "--reflink=auto", src, dst], capture_output=True, text=True)
    if proc.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(dst)
        raise OSError(f"copying layer {src} to {dst} failed: {proc.stderr.strip()}")


def snapshot_layer(lay: Layer, dest: str) -> Layer:
    """A frozen, read-only copy of a layer: a btrfs snapshot, else a (reflink) copy.

    Called while the workspace is frozen, so the upper directory is consistent.
    """
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    if lay.kind == "btrfs" and is_btrfs(Path(dest).parent):
        btrfsutil.create_snapshot(lay.path, dest, read_only=True)
        return Layer("btrfs", dest)
    copy_tree(lay.path, dest)
    return Layer("dir", dest)


def clone_layer(snap: Layer, ws_id: str, storage_dir: str | None) -> Layer:
    """A new writable layer for a clone, sharing the snapshot's blocks where possible."""
    root = storage_root(storage_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = str(root / ws_id)
    if snap.kind == "btrfs" and is_btrfs(root):
        btrfsutil.create_snapshot(snap.path, path)
        layer = Layer("btrfs", path)
    else:
        copy_tree(snap.path, path)
        layer = Layer("dir", path)
    # Overlay's work dir must start empty for a new mount.
    shutil.rmtree(layer.work)
    os.mkdir(layer.work, 0o700)
    return layer
