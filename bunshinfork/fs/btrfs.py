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
# Without direct I/O every block of the layers is cached twice (btrfs's page cache and the
# backing file's), and each btrfs commit fsyncs the whole backing file: a snapshot then waits
# on gigabytes of the host file system's dirty pages.
LO_FLAGS_DIRECT_IO = 16
# discard=async: space freed in the btrfs (a layer removed) is punched out of the sparse image.
MOUNT_OPTIONS = "discard=async"


def _loop_attach(image: str) -> tuple[str, int]:
    """Attach `image` to a free loop device with autoclear and direct I/O; return the device
    and an open fd on it. (The kernel drops direct I/O where the backing file cannot do it.)

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
                struct.pack_into("=I", info, 52, LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO)  # lo_flags
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
        # nosuid,nodev: the layers hold what sandboxes wrote (setuid files, capabilities, nodes),
        # which must give the host's users nothing (fs/store.py).
        native.mount(dev, str(mp), "btrfs", native.MS_NOATIME | native.MS_NOSUID | native.MS_NODEV,
                     MOUNT_OPTIONS)
    except OSError as e:
        with contextlib.suppress(OSError):
            fcntl.ioctl(loop_fd, 0x4C01)  # LOOP_CLR_FD: detach now rather than at the close below
        raise KernelFeatureError(f"mounting btrfs image {img} on {mp} failed: {e}") from e
    finally:
        # The mount now holds the device; on failure this last close lets autoclear detach it.
        os.close(loop_fd)
    limit_dirty(str(mp))
    return str(mp)


# Bound on the dirty data of one layer store. A btrfs snapshot writes back every dirty byte of
# the subvolume it snapshots before it returns, inside the source's freeze; with this bound a
# fork waits on at most DIRTY_LIMIT however much the workspace has just written. Writers are
# throttled to about the disk's speed instead (measured: +15-25 % for a 2 GiB burst).
DIRTY_LIMIT = 64 << 20


BTRFS_IOC_FS_INFO = 0x8400941F  # _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args), 1024 bytes


def fsid(path: str) -> str | None:
    """The btrfs file system uuid of `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        buf = bytearray(1024)
        fcntl.ioctl(fd, BTRFS_IOC_FS_INFO, buf)
    except OSError:
        return None
    finally:
        os.close(fd)
    raw = bytes(buf[16:32])  # after max_id and num_devices
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def same_fs(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths lie on one btrfs (subvolumes each have an st_dev of their own)."""
    fa = fsid(str(a)) if is_btrfs(a) else None
    return fa is not None and fa == fsid(str(b))


def bdi_dir(mountpoint: str) -> Path | None:
    """The backing-device-info directory of the btrfs mounted at `mountpoint`."""
    uuid = fsid(mountpoint)
    bdi = Path("/sys/fs/btrfs", uuid or "-", "bdi")
    return bdi.resolve() if uuid and bdi.exists() else None


def limit_dirty(mountpoint: str, limit: int = DIRTY_LIMIT) -> bool:
    """Hold the store's dirty data at `limit` (strict_limit and max_bytes, Linux >= 6.2: a
    bdi's own limit applies below the global dirty threshold only when it is strict).
    Returns whether the kernel took it."""
    bdi = bdi_dir(mountpoint)
    if bdi is None or not (bdi / "max_bytes").exists() or not (bdi / "strict_limit").exists():
        return False
    try:
        (bdi / "max_bytes").write_text(str(limit))
        (bdi / "strict_limit").write_text("1")
    except OSError:
        return False
    return True


def dirty_limit(mountpoint: str) -> int | None:
    """The strict dirty limit set on the store at `mountpoint`, or None."""
    bdi = bdi_dir(mountpoint)
    try:
        if bdi is not None and (bdi / "strict_limit").read_text().strip() == "1":
            return int((bdi / "max_bytes").read_text())
    except (OSError, ValueError):
        pass
    return None


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
