"""The copy-on-write engine: availability and the ioctls of /dev/bunshin (module in kernel/)."""

from __future__ import annotations

import fcntl
import os
import struct

DEVICE = "/dev/bunshin"


def available() -> bool:
    return os.path.exists(DEVICE)


def unavailable_reason() -> str:
    return (
        f"memory='cow' needs the bunshin kernel module ({DEVICE} is missing): build it with "
        "'make -C kernel' and insmod kernel/bunshin.ko on a host that can load modules; "
        "memory='auto' falls back to 'ksm' (or 'copy' before Linux 6.4)"
    )


# The ioctls of kernel/bunshin_uapi.h: _IOW/_IOWR(0xB5, nr, struct).
IOC_SNAPSHOT = (1 << 30) | (8 << 16) | (0xB5 << 8) | 1  # struct bunshin_snapshot_req{s32 pid; u32 flags}
IOC_SHARE = (3 << 30) | (48 << 16) | (0xB5 << 8) | 2  # struct bunshin_share_req, 48 bytes
IOC_STATS = (3 << 30) | (24 << 16) | (0xB5 << 8) | 3  # struct bunshin_stats_req{s32 fd; u32; u64; u64}
_SHARE_FMT = "=iiiIQQQQ"
_STATS_FMT = "=iIQQ"
SHARE_RESET = 1  # BUNSHIN_SHARE_RESET: the target's existing content is disposable
SHARE_FILES = 2  # BUNSHIN_SHARE_FILES: also private file mappings of the same inode


def _ioctl(request: int, buf: bytearray) -> int:
    # With a mutable buffer fcntl.ioctl returns the ioctl's own result and fills `buf` in.
    with open(DEVICE, "rb", buffering=0) as dev:
        return fcntl.ioctl(dev.fileno(), request, buf, True)


def snapshot_fd(holder_pid: int) -> int:
    """The mm of a stopped holder as a snapshot descriptor (pread reads its memory)."""
    return _ioctl(IOC_SNAPSHOT, bytearray(struct.pack("=iI", holder_pid, 0)))


def stats(snap_fd: int) -> tuple[int, int]:
    """(pages the snapshot maps, pages only it maps): what keeping it costs."""
    buf = bytearray(struct.pack(_STATS_FMT, snap_fd, 0, 0, 0))
    _ioctl(IOC_STATS, buf)
    _, _, pages, private = struct.unpack(_STATS_FMT, buf)
    return pages, private


def share(snap_fd: int, target_pid: int, start: int, end: int, holder_pid: int = 0,
          reset: bool = False, files: bool = False) -> tuple[int, int]:
    """Map the snapshot's anonymous private VMAs in [start, end) copy-on-write into the stopped
    `target_pid` (0: the caller). Returns (VMAs shared, VMAs skipped).
    reset: discard what the target's VMAs already hold instead of refusing with EBUSY.
    files: also the written pages of private file mappings, where the target maps the same
    inode at the same offset (a file the target sees as another inode is skipped)."""
    flags = (SHARE_RESET if reset else 0) | (SHARE_FILES if files else 0)
    buf = bytearray(struct.pack(_SHARE_FMT, snap_fd, holder_pid, target_pid, flags, start, end, 0, 0))
    _ioctl(IOC_SHARE, buf)
    *_, vmas, skipped = struct.unpack(_SHARE_FMT, buf)
    return vmas, skipped
