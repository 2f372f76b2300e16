"""The copy-on-write engine: availability and the ioctls of /dev/bunshin (module in kernel/).

Request numbers and layouts come from kernel/bunshin_uapi.h through the CFFI build.
"""

from __future__ import annotations

import fcntl
import os

from ..native import ffi, lib

DEVICE = "/dev/bunshin"
# criu/patches/0001: a dump with this set writes no anonymous private pages; the holders keep them.
DUMP_ENV = {"CRIU_BUNSHIN_NO_ANON_PAGES": "1"}


def available() -> bool:
    return os.path.exists(DEVICE)


def unavailable_reason() -> str:
    return (
        f"memory='cow' needs the bunshin kernel module ({DEVICE} is missing): build it with "
        "'make -C kernel' and insmod kernel/bunshin.ko on a host that can load modules; "
        "memory='auto' falls back to 'ksm' (or 'copy' before Linux 6.4)"
    )


def _ioctl(request: int, req: object) -> int:
    # With a writable buffer fcntl.ioctl returns the ioctl's own result and fills the struct in.
    with open(DEVICE, "rb", buffering=0) as dev:
        return fcntl.ioctl(dev.fileno(), request, ffi.buffer(req), True)


def snapshot_fd(holder_pid: int) -> int:
    """The mm of a stopped holder as a snapshot descriptor (pread reads its memory)."""
    req = ffi.new("struct bunshin_snapshot_req *", {"pid": holder_pid})
    return _ioctl(lib.BUNSHIN_IOC_SNAPSHOT, req)


def stats(snap_fd: int) -> tuple[int, int]:
    """(pages the snapshot maps, pages only it maps): what keeping it costs."""
    req = ffi.new("struct bunshin_stats_req *", {"snap_fd": snap_fd})
    _ioctl(lib.BUNSHIN_IOC_STATS, req)
    return int(req.pages), int(req.private_pages)


def share(snap_fd: int, target_pid: int, start: int, end: int, holder_pid: int = 0,
          reset: bool = False, files: bool = False) -> tuple[int, int]:
    """Map the snapshot's anonymous private VMAs in [start, end) copy-on-write into the stopped
    `target_pid` (0: the caller). Returns (VMAs shared, VMAs skipped).
    reset: discard what the target's VMAs already hold instead of refusing with EBUSY.
    files: also the written pages of private file mappings, where the target maps the same
    inode at the same offset (a file the target sees as another inode is skipped)."""
    flags = (lib.BUNSHIN_SHARE_RESET if reset else 0) | (lib.BUNSHIN_SHARE_FILES if files else 0)
    req = ffi.new("struct bunshin_share_req *", {"snap_fd": snap_fd, "holder_pid": holder_pid,
                                                 "target_pid": target_pid, "flags": flags,
                                                 "start": start, "end": end})
    _ioctl(lib.BUNSHIN_IOC_SHARE, req)
    return int(req.vmas), int(req.skipped)
