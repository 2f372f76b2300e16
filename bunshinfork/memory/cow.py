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
