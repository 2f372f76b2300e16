"""Private writable layers (overlay upper + work dirs), and the loop-file btrfs helper.

When the storage directory is on btrfs, each workspace's layer is its own subvolume,
because fork snapshots it while the workspace is frozen. Elsewhere it is a plain
directory under the state root's tmpfs.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import native, state
from .errors import KernelFeatureError, SpecError

try:
    import btrfsutil  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - set-up installs python3-btrfsutil
    btrfsutil = None


def is_btrfs(path: str | os.PathLike[str]) -> bool:
    if btrfsutil is None:
        return False
    try:
        btrfsutil.subvolume_id(str(path))
        return True
    except btrfsutil.BtrfsUtilError:
        return False


@dataclass
class Layer:
    kind: str  # btrfs | dir
    path: str  # the subvolume or directory holding upper/ and work/

    @property
    def upper(self) -> str:
        return os.path.join(self.path, "upper")

    @property
    def work(self) -> str:
        return os.path.join(self.path, "work")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": self.path}


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


def remove_layer(layer: dict | Layer) -> None:
    lay = layer if isinstance(layer, Layer) else Layer(layer["kind"], layer["path"])
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


def snapshot_layer(layer: dict | Layer, dest: str) -> Layer:
    """A frozen, read-only copy of a layer: a btrfs snapshot, else a (reflink) copy.

    Called while the workspace is frozen, so the upper directory is consistent.
    """
    lay = layer if isinstance(layer, Layer) else Layer(layer["kind"], layer["path"])
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    if lay.kind == "btrfs" and is_btrfs(Path(dest).parent):
        btrfsutil.create_snapshot(lay.path, dest, read_only=True)
        return Layer("btrfs", dest)
    copy_tree(lay.path, dest)
    return Layer("dir", dest)


def clone_layer(snapshot: dict | Layer, ws_id: str, storage_dir: str | None) -> Layer:
    """A new writable layer for a clone, sharing the snapshot's blocks where possible."""
    snap = snapshot if isinstance(snapshot, Layer) else Layer(snapshot["kind"], snapshot["path"])
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


def unmount_below(directory: str | os.PathLike[str]) -> None:
    """Detach every host mount under `directory`, children before their parents. A restore that
    failed, or whose creator died, leaves the clone's overlay (CRIU's --root) and CRIU's cgroup
    yard mounted under the clone's state directory."""
    prefix = str(directory) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for mp in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        with contextlib.suppress(OSError):
            native.umount2(mp, native.MNT_DETACH)


# ---- loop-file btrfs ----

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4


def _loop_attach(image: str) -> tuple[str, int]:
    """Attach `image` to a free loop device with autoclear; return the device and an open fd on it.

    Autoclear detaches the device at its last close, not only at the last umount: the caller
    keeps the fd open until a mount holds the device, then closes it.
    """
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(8):
            n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            dev = f"/dev/loop{n}"
            backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
            try:
                loop = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                os.close(backing)
                raise
            try:
                # struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
                info = bytearray(232)  # sizeof(struct loop_info64)
                struct.pack_into("=I", info, 52, LO_FLAGS_AUTOCLEAR)  # lo_flags
                cfg = struct.pack("=II", backing, 0) + bytes(info) + bytes(64)
                buf = ctypes.create_string_buffer(cfg, len(cfg))
                fcntl.ioctl(loop, LOOP_CONFIGURE, buf)
                return dev, loop
            except OSError as e:
                os.close(loop)
                if e.errno != 16:  # EBUSY: another process took this device first
                    raise
            finally:
                os.close(backing)
    finally:
        os.close(ctl)
    raise KernelFeatureError("no free loop device could be configured")


def setup_btrfs_loop(image: str, mountpoint: str, size: int = 4 << 30) -> str:
    """Create (if needed) a sparse btrfs image and mount it at `mountpoint`; returns the mountpoint.

    The loop device has autoclear set, so teardown_btrfs_loop (a plain umount) leaves no loop
    device behind.
    """
    mp = Path(mountpoint)
    if is_btrfs(mp) and os.path.ismount(mp):
        return str(mp)
    if not shutil.which("mkfs.btrfs"):
        raise KernelFeatureError("mkfs.btrfs is missing; install btrfs-progs (scripts/setup.sh does)")
    img = Path(image)
    img.parent.mkdir(parents=True, exist_ok=True)
    if not img.exists():
        with open(img, "wb") as f:
            f.truncate(size)
        proc = subprocess.run(["mkfs.btrfs", "-q", "-f", str(img)], capture_output=True, text=True)
        if proc.returncode != 0:
            img.unlink()
            raise KernelFeatureError(f"mkfs.btrfs failed: {proc.stderr.strip()}")
    mp.mkdir(parents=True, exist_ok=True)
    dev, loop_fd = _loop_attach(str(img))
    try:
        # noatime is a VFS flag, not a btrfs option: btrfs's fs_context parser rejects it as data.
        native.mount(dev, str(mp), "btrfs", native.MS_NOATIME, None)
    except OSError as e:
        with contextlib.suppress(OSError):
            fcntl.ioctl(loop_fd, 0x4C01)  # LOOP_CLR_FD: detach now rather than at the close below
        raise KernelFeatureError(f"mounting btrfs image {img} on {mp} failed: {e}") from e
    finally:
        # The mount now holds the device; on failure this last close lets autoclear detach it.
        os.close(loop_fd)
    return str(mp)


def teardown_btrfs_loop(mountpoint: str, remove_image: str | None = None) -> None:
    if os.path.ismount(mountpoint):
        native.umount2(mountpoint, 0)
    if remove_image:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(remove_image)


def loop_devices_for(image: str) -> list[str]:
    """Loop devices whose backing file is `image` (for leak checks)."""
    out = []
    target = os.path.realpath(image)
    for d in Path("/sys/block").glob("loop*"):
        with contextlib.suppress(OSError):
            if (d / "loop" / "backing_file").read_text().strip() == target:
                out.append("/dev/" + d.name)
    return out
