"""cgroup2's `favordynmods`: moving a task between cgroups without waiting out an RCU grace period.

Every move of a task into a cgroup (a restore's CRIU writes each clone's init into its cgroups)
takes the kernel's cgroup_threadgroup_rwsem for writing: a per-CPU rwsem, whose writer waits
for an RCU grace period unless one passed just before. On this 2-vCPU VM that was 6 ms for a
lone move and 19 ms for the first of a restore's moves, on every clone's path. The cgroup2
mount option favordynmods (Linux 6.0, Documentation/admin-guide/cgroup-v2.rst) keeps that
lock in its slow-reader mode instead (Linux 6.18 goes further: a lock per thread group), so
moves stop waiting, "at the cost of making hot path operations such as forks and exits more
expensive" host-wide.

It is a host setting, like the KSM knobs: bunshin turns it on once, on the cgroup2 hierarchy
it already uses (util-linux's remount keeps the mount's other options), and leaves it on; on
6.18 the kernel keeps its per-thread-group locking even after the option is cleared. Where the
kernel refuses it (older than 6.0; a host whose cgroup2 mount this namespace may not change)
workspaces work as before. BUNSHIN_CGROUP_FAVOR_DYNMODS=0 leaves the host as it is.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

OPTION = "favordynmods"
OPT_OUT_ENV = "BUNSHIN_CGROUP_FAVOR_DYNMODS"
MOUNT = "/usr/bin/mount"  # util-linux, essential on Debian
MOUNT_TIMEOUT = 10.0

_lock = threading.Lock()
_tried: dict[str, bool] = {}  # mount point -> whether it is on, once this process has looked


def enabled(mount_point: Path) -> bool | None:
    """Whether the cgroup2 mount at `mount_point` has favordynmods; None where it is not one."""
    target = str(mount_point)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) > 4 and fields[4] == target and len(tail) >= 3 and tail[0] == "cgroup2":
            return OPTION in tail[2].split(",")
    return None


def ensure(mount_point: Path) -> bool:
    """Turn favordynmods on for the cgroup2 mount at `mount_point`, once per process; whether
    it is on. Never raises: without it, moves are only slower."""
    key = str(mount_point)
    with _lock:
        if key not in _tried:
            _tried[key] = _turn_on(mount_point)
        return _tried[key]


def _turn_on(mount_point: Path) -> bool:
    try:
        state = enabled(mount_point)
        if state is None or state or os.environ.get(OPT_OUT_ENV, "1") == "0":
            return bool(state)
        subprocess.run([MOUNT, "-o", f"remount,{OPTION}", str(mount_point)], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=MOUNT_TIMEOUT, check=False)
        return bool(enabled(mount_point))
    except (OSError, subprocess.SubprocessError):
        return False
