"""Disk quotas on layers (WorkspaceSpec.disk_limit): a qgroup limit on a btrfs layer's
subvolume, a sized tmpfs for a layer on the state root's tmpfs.

btrfs quotas are enabled on a file system the first time a workspace with a disk_limit is made
there, and stay enabled. Where the kernel has simple quotas (Linux >= 6.7: an extent is charged
to the subvolume that wrote it, one owner reference per extent and no backref walks) they are
what is enabled; elsewhere classic qgroups, whose accounting walks backrefs at every commit and
makes snapshots and deletions slower. Enabling costs one transaction commit.

A workspace's layer is a fresh subvolume, so its qgroup holds exactly what the workspace wrote:
the frozen layers it stacks on are other subvolumes, and a copy-up shares the lower's extents
(reflink) where it can. A deleted subvolume's qgroup goes when its last extent does: the kernel
removes it itself when its cleaner drops the subvolume (at the next commit, up to 30 s after
the delete); one whose extents outlive it in a snapshot stays "stale" until that snapshot is
dropped too. Every later layer removal on the file system sweeps those (sweep()), and gc
waits for the cleaner and sweeps (settle()).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import subprocess
from pathlib import Path

from ..contract import Check
from ..errors import KernelFeatureError
from . import btrfs
from .btrfs import btrfsutil


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


BTRFS_IOC_SYNC = _ioc(0, 8, 0)  # commit, and wake the cleaner that drops deleted subvolumes
BTRFS_IOC_QUOTA_CTL = _ioc(3, 40, 16)  # struct btrfs_ioctl_quota_ctl_args { u64 cmd, status; }
BTRFS_IOC_QGROUP_CREATE = _ioc(1, 42, 16)  # struct btrfs_ioctl_qgroup_create_args { u64 create, qgroupid; }
BTRFS_IOC_QGROUP_LIMIT = _ioc(2, 43, 48)  # { u64 qgroupid; struct btrfs_qgroup_limit { u64 flags, 4 x u64 } }
QUOTA_CTL_ENABLE = 1
QUOTA_CTL_ENABLE_SIMPLE = 4
LIMIT_MAX_RFER = 1
LIMIT_MAX_EXCL = 2
SIMPLE_FEATURE = Path("/sys/fs/btrfs/features/simple_quota")
TOPLEVEL = 5
SYNC_TIMEOUT = 30.0


def _fd(path: str | os.PathLike[str]) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _sysfs(path: str | os.PathLike[str]) -> Path | None:
    uuid = btrfs.fsid(str(path))
    return Path("/sys/fs/btrfs", uuid, "qgroups") if uuid else None


def mode(path: str | os.PathLike[str]) -> str | None:
    """'squota' or 'qgroup' where quotas are enabled on the btrfs holding `path`, else None."""
    d = _sysfs(path)
    if d is None or not d.is_dir():
        return None
    try:
        return (d / "mode").read_text().strip() or "qgroup"
    except OSError:
        return "qgroup"  # kernels before simple quotas have no mode file


def simple_available() -> bool:
    return SIMPLE_FEATURE.exists()


def enable(path: str | os.PathLike[str]) -> str:
    """Enable quotas on the btrfs holding `path` (simple ones where the kernel has them); returns
    the mode. Idempotent: the kernel ignores an enable on a file system that has quotas."""
    if (m := mode(path)) is not None:
        return m
    fd = _fd(path)
    try:
        cmd = QUOTA_CTL_ENABLE_SIMPLE if simple_available() else QUOTA_CTL_ENABLE
        fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("=QQ", cmd, 0)))
    except OSError as e:
        raise KernelFeatureError(f"enabling btrfs quotas on {path} failed: {e}; disk_limit needs them") from e
    finally:
        os.close(fd)
    return mode(path) or "qgroup"


def limit(subvolume: str, nbytes: int) -> None:
    """Hold the subvolume's qgroup to `nbytes` (referenced and exclusive: under simple quotas the
    two are equal; under classic ones a fresh subvolume's referenced bytes are what it wrote)."""
    enable(subvolume)
    qgroup = btrfsutil.subvolume_id(subvolume)
    fd = _fd(subvolume)
    try:
        lim = struct.pack("=6Q", qgroup, LIMIT_MAX_RFER | LIMIT_MAX_EXCL, nbytes, nbytes, 0, 0)
        fcntl.ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, bytearray(lim))
    except OSError as e:
        raise KernelFeatureError(f"setting a {nbytes}-byte quota on {subvolume} failed: {e}") from e
    finally:
        os.close(fd)


def _usage(d: Path) -> int:
    try:
        return int((d / "referenced").read_text()) + int((d / "exclusive").read_text())
    except (OSError, ValueError):
        return 0


def _subvolume_exists(root: str, subvol_id: int) -> bool:
    try:
        btrfsutil.subvolume_info(root, subvol_id)
        return True
    except btrfsutil.BtrfsUtilError as e:
        return e.errno != errno.ENOENT


def stale(root: str | os.PathLike[str]) -> dict[str, int]:
    """Level-0 qgroups of the btrfs holding `root` whose subvolume is gone, with their bytes."""
    d = _sysfs(root)
    if d is None or not d.is_dir():
        return {}
    out = {}
    for q in os.listdir(d):
        level, _, ident = q.partition("_")
        if level != "0" or not ident.isdigit() or int(ident) == TOPLEVEL:
            continue
        if not _subvolume_exists(str(root), int(ident)):
            out[f"0/{ident}"] = _usage(d / q)
    return out


def sweep(root: str | os.PathLike[str]) -> list[str]:
    """Remove the stale qgroups that hold nothing any more; returns them."""
    removed = []
    empty = [q for q, used in stale(root).items() if used == 0]
    if not empty:
        return removed
    fd = _fd(root)
    try:
        for q in empty:
            # QGROUP_CREATE with create=0 removes the qgroup (the ioctl does both).
            with contextlib.suppress(OSError):  # EBUSY: a drop still under way charges it
                fcntl.ioctl(fd, BTRFS_IOC_QGROUP_CREATE, bytearray(struct.pack("=QQ", 0, int(q[2:]))))
                removed.append(q)
    finally:
        os.close(fd)
    return removed


def settle(root: str | os.PathLike[str], timeout: float = SYNC_TIMEOUT) -> list[str]:
    """Have the cleaner drop the deleted subvolumes now (it otherwise waits for the next
    periodic commit, up to 30 s), wait for it (bounded), then sweep: what gc does."""
    if mode(root) is None:
        return []
    fd = _fd(root)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SYNC)
    except OSError:
        pass
    finally:
        os.close(fd)
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        subprocess.run(["btrfs", "subvolume", "sync", str(root)], capture_output=True, timeout=timeout, check=False)
    return sweep(root)


def check_quotas() -> Check:
    """Whether disk_limit can be enforced on btrfs layers here, and how."""
    from . import store  # store imports layers, which imports this module

    if btrfsutil is None:
        return Check("disk quotas", False, "btrfsutil missing: disk_limit works only on tmpfs layers",
                     required=False)
    where = f"; on the layer store: {mode(store.STORE) or 'not enabled yet'}" if store.mounted() else ""
    if simple_available():
        return Check("disk quotas", True, f"btrfs simple quotas (squota){where}", required=False)
    return Check("disk quotas", True, "btrfs classic qgroups (no simple quotas before Linux 6.7: snapshots and "
                 f"deletions are slower once enabled){where}", required=False)
