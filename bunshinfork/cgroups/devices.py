"""A workspace's device allowlist: the nodes its processes may open, whatever nodes they find.

Docker's default (runc's AllowedDevices) less what bunshin does not give: the standard
character devices of the workspace's own /dev, the console, and the pseudo-terminals of its
private devpts instance. Anything else (a block device an image's layer named, a node the host
wrote into a workspace's /dev) is refused with EPERM even where a node exists and no nodev
mount stands in the way. Overlay whiteouts (0:0 character devices) are exempt in the kernel.

One mechanism for both cgroup layouts: a BPF device program on the workspace's cgroup2
directory (a hybrid v1 host's `unified` one too, where the kernel runs it before the v1 devices
controller). CRIU neither dumps nor restores cgroup BPF programs; a clone's and a resumed
workspace's cgroup is made here, with its program, before CRIU moves the tasks in.
"""

from __future__ import annotations

from .. import native

BLOCK, CHAR = 1, 2  # BPF_DEVCG_DEV_BLOCK, BPF_DEVCG_DEV_CHAR
ANY = -1

ALLOWED: tuple[tuple[int, int, int], ...] = (
    (CHAR, 1, 3),  # null
    (CHAR, 1, 5),  # zero
    (CHAR, 1, 7),  # full
    (CHAR, 1, 8),  # random
    (CHAR, 1, 9),  # urandom
    (CHAR, 5, 0),  # tty
    (CHAR, 5, 1),  # console
    (CHAR, 5, 2),  # ptmx
    (CHAR, 136, ANY),  # pts/*
)


def restrict(cgroup2_dir: str) -> None:
    """Admit only ALLOWED to the tasks of `cgroup2_dir` (OSError where the kernel refuses)."""
    native.attach_device_filter(cgroup2_dir, list(ALLOWED))
