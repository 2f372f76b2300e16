"""The copy-on-write engine's availability (the kernel module lives in kernel/)."""

from __future__ import annotations

import os

DEVICE = "/dev/bunshin"


def available() -> bool:
    return os.path.exists(DEVICE)


def unavailable_reason() -> str:
    return (
        f"memory='cow' needs the bunshin kernel module ({DEVICE} is missing): build it with "
        "'make -C kernel' and insmod kernel/bunshin.ko on a host that can load modules; "
        "memory='auto' falls back to 'ksm'"
    )


# _IOWR(0xB5, 2, struct bunshin_share_req) — 48 bytes, see kernel/bunshin_uapi.h.
_SHARE_FMT = "=iiiIQQQQ"
IOC_SHARE = (3 << 30) | (48 << 16) | (0xB5 << 8) | 2


SHARE_RESET = 1  # BUNSHIN_SHARE_RESET: the target's existing anonymous content is disposable


def share(snap_fd: int, target_pid: int, start: int, end: int, holder_pid: int = 0,
          reset: bool = False) -> tuple[int, int]:
    """Map the snapshot's anonymous private VMAs in [start, end) copy-on-write into the stopped
    `target_pid` (0: the caller). Returns (VMAs shared, VMAs skipped as not anonymous-private).
    reset: discard what the target's VMAs already hold instead of refusing with EBUSY."""
    import fcntl
    import struct

    flags = SHARE_RESET if reset else 0
    buf = bytearray(struct.pack(_SHARE_FMT, snap_fd, holder_pid, target_pid, flags, start, end, 0, 0))
    with open(DEVICE, "rb", buffering=0) as dev:
        fcntl.ioctl(dev.fileno(), IOC_SHARE, buf, True)
    *_, vmas, skipped = struct.unpack(_SHARE_FMT, buf)
    return vmas, skipped
