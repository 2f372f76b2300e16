"""`bunshin doctor`: what this host offers bunshinfork, and what to do about what it lacks.

The kernel and the privileges come first; then every subsystem part's own probes
(pipeline.PARTS, each part's `probes`). Every check is cheap and side-effect free apart from
CRIU's CHECK, and none raises: a missing feature becomes a failed Check whose detail says how
to get it.
"""

from __future__ import annotations

import os
import re

from . import pipeline
from .contract import Check, Probe, run_probe

__all__ = ["CHECKS", "Check", "failed_required", "format_checks", "run_checks"]

# openat2 (5.6) is the newest syscall the core runtime cannot do without.
MIN_KERNEL = (5, 6)


def _version_tuple(text: str) -> tuple[int, ...] | None:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def check_kernel() -> Check:
    release = os.uname().release
    v = _version_tuple(release)
    if v is None or v[:2] >= MIN_KERNEL:
        return Check("kernel", True, release, required=True)
    return Check("kernel", False, f"{release}: bunshinfork needs Linux >= {'.'.join(map(str, MIN_KERNEL))} "
                 "(clone3, pidfd, openat2)", required=True)


def check_root() -> Check:
    if os.geteuid() == 0:
        return Check("root", True, "running as root", required=True)
    return Check("root", False, f"running as uid {os.geteuid()}; namespaces, mounts and cgroups need root",
                 required=True)


OWN: tuple[Probe, ...] = (check_kernel, check_root)
# Every check `run_checks` runs, in its order.
CHECKS: tuple[Probe, ...] = (*OWN, *pipeline.probes())


def run_checks() -> list[Check]:
    """The host's checks, then each part's; a check that crashes is reported as failed."""
    return [run_probe(fn) for fn in OWN] + [c for part in pipeline.PARTS for c in part.check()]


def format_checks(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    return "\n".join(f"{c.level:<4}  {c.name:<{width}}  {c.detail}" for c in checks)


def failed_required(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.required and not c.ok]
