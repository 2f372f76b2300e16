"""btrfs for layers: subvolume detection through btrfsutil, and a loop-file btrfs to keep them on."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import struct
import subprocess
from pathlib import Path

from .. import native
from ..errors import KernelFeatureError

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
