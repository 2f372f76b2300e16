"""Cgroups: each workspace's resource limits, and the freezer every capture rests on.

One cgroup per workspace (freezer, memory, pids on cgroup v1; the same on a unified v2
hierarchy) with its memory and pids limits, so the OOM killer acts inside the workspace.
A fork freezes the source through it (paper §4.2: the freeze covers metadata capture,
holder creation and the file-system snapshot) and restores each clone into its own.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from .. import state
from ..contract import Build, Capture, Check, Held, Part
from ..errors import CgroupError
from . import cgroup, devices, dynmods
from .cgroup import Cgroup, detect, leftover_cgroups

__all__ = ["Cgroup", "CgroupsPart", "detect", "leftover_cgroups"]

# A cgroup younger than this may belong to a workspace being created under another state root.
ORPHAN_AGE = 60.0


def _v1_controllers() -> list[str]:
    # /proc/cgroups: a non-zero hierarchy id means the controller is mounted on a v1 hierarchy.
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cgroups").read_text().splitlines():
            if line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) >= 4 and parts[1] != "0" and parts[3] == "1":
                out.append(parts[0])
    return out


def check_cgroups() -> Check:
    root = cgroup.CGROUP_ROOT
    try:
        version = detect(root)
    except CgroupError as e:
        return Check("cgroups", False, str(e), required=True)
    if version == "v1":
        detail = f"v1, controllers: {' '.join(_v1_controllers()) or '?'}"
        if (root / "unified" / "cgroup.controllers").exists():
            detail += f" (hybrid: v2 at {root / 'unified'})"
        return Check("cgroups", True, detail, required=True)
    try:
        ctrls = (root / "cgroup.controllers").read_text().split()
    except OSError as e:
        return Check("cgroups", False, f"v2 at {root}, but cgroup.controllers is unreadable: {e}",
                     required=True)
    detail = f"v2, controllers: {' '.join(ctrls) or '(none)'}"
    lacking = [c for c in ("memory", "pids") if c not in ctrls]
    if lacking:
        # Workspaces still start; only memory_limit / pids_limit are refused.
        detail += f"; {', '.join(lacking)} unavailable, so the matching limits cannot be set"
    return Check("cgroups", True, detail, required=True)


def check_device_allowlist() -> Check:
    """Whether this kernel runs cgroup BPF device programs (CONFIG_CGROUP_BPF), which every
    non-privileged workspace's cgroup gets (devices.py): tried on a cgroup of its own."""
    root = cgroup.CGROUP_ROOT
    try:
        detect(root)
        base = cgroup.cgroup2_root(root)
        probe = base / f"bunshin-devices-probe-{os.getpid()}"
        probe.mkdir()
    except (CgroupError, OSError) as e:
        return Check("device allowlist", False, f"no cgroup2 directory to try it on: {e}", required=True)
    try:
        devices.restrict(str(probe))
    except OSError as e:
        return Check("device allowlist", False, f"a BPF device program does not attach ({e.strerror}): "
                     "workspaces cannot be created; the kernel needs CONFIG_CGROUP_BPF", required=True)
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return Check("device allowlist", True, "BPF device programs attach: workspaces open only the standard nodes",
                 required=True)


def check_favordynmods() -> Check:
    """Whether task moves between cgroups skip the RCU grace period (dynmods.py)."""
    try:
        base = cgroup.cgroup2_root(cgroup.CGROUP_ROOT)
        on = dynmods.enabled(base)
    except (CgroupError, OSError) as e:
        return Check("cgroup favordynmods", False, f"no cgroup2 hierarchy to read: {e}", required=False)
    if on:
        return Check("cgroup favordynmods", True, f"on at {base}: moving a clone's init into its cgroups waits "
                     "for no RCU grace period", required=False)
    return Check("cgroup favordynmods", False, f"off at {base}: each restore waits out an RCU grace period "
                 f"(6-20 ms here); bunshin turns it on at the first workspace unless {dynmods.OPT_OUT_ENV}=0",
                 required=False)


class CgroupsPart(Part):
    name = "cgroups"
    probes = (check_cgroups, check_device_allowlist, check_favordynmods)

    def prepare(self, b: Build) -> None:
        self._create(b, b.rec.spec.cgroup)

    def capture(self, c: Capture) -> None:
        assert c.source.cgroups is not None
        c.snap.meta.cgroup_version = c.source.cgroups.version

    def restore(self, b: Build) -> None:
        assert b.source is not None
        self._create(b, b.source.meta.cgroup_version)

    @staticmethod
    def _create(b: Build, version: str) -> None:
        # Once per process: restores move each clone's init into its cgroups (dynmods.py).
        with contextlib.suppress(CgroupError, OSError):
            dynmods.ensure(cgroup.cgroup2_root(cgroup.CGROUP_ROOT))
        spec = b.rec.spec
        limit = spec.memory_limit if isinstance(spec.memory_limit, int) else None  # validated: bytes
        b.rec.cgroups = Cgroup.create(b.rec.id, memory_limit=limit, pids_limit=spec.pids_limit,
                                      version=version, devices=not spec.privileged,
                                      cpu_limit=spec.cpu_limit).state

    def release(self, held: Held) -> None:
        if isinstance(held, Build) and held.rec.cgroups is not None:
            Cgroup(held.rec.cgroups).remove()

    def gc(self) -> list[str]:
        """Workspace cgroups with no record under this state root, no task and some age: left
        where a release could not remove them (a task still dying) and the record went anyway."""
        removed = []
        now = time.time()
        for d in leftover_cgroups():
            name = os.path.basename(d)
            if not name.startswith("ws-") or (state.RUN_ROOT / name).exists():
                continue
            try:
                if now - os.stat(d).st_mtime < ORPHAN_AGE or (Path(d) / "cgroup.procs").read_text().strip():
                    continue
                os.rmdir(d)
            except OSError:
                continue
            removed.append(d)
        return removed
