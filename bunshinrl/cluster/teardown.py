"""A pool host's teardown: reaping the workspaces of a host actor that died and bunshinfork's
gc on the host's own state root, then removing the host itself (its state root's tmpfs, its
cgroup parents) once nothing of a workspace remains there."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from bunshinfork import Workspace, native, pipeline, state
from bunshinfork.cgroups import cgroup
from bunshinfork.host import DEFAULT_RUN_ROOT, HOST


def remove_host_dirs() -> list[str]:
    root = HOST.run_root
    if root == DEFAULT_RUN_ROOT or any(n.startswith("ws-") for n in os.listdir(root)):
        return []
    removed = []
    for parent in cgroup_parents():
        with contextlib.suppress(OSError):
            os.rmdir(parent)
            removed.append(str(parent))
    if os.path.ismount(root):
        native.umount2(str(root), native.MNT_DETACH)
    shutil.rmtree(root, ignore_errors=True)
    removed.append(str(root))
    return removed


def cgroup_parents() -> list[Path]:
    base = cgroup.CGROUP_ROOT
    ps = [base / cgroup.PARENT] if (base / "cgroup.controllers").exists() else \
        [base / c / cgroup.PARENT for c in cgroup.V1_CONTROLLERS]
    return [p for p in [*ps, base / cgroup.UNIFIED / cgroup.PARENT] if p.is_dir()]


def reap() -> dict[str, list[str]]:
    """Every workspace under this host's state root whose creator is gone (a host actor that
    died) is destroyed, then bunshinfork's gc runs: on a named host, only its own state root,
    cgroup parent, bridge and layer store are touched."""
    destroyed = []
    for rec in state.records():
        if rec.status == "running" and not rec.creator_alive() and rec.creator_pid != os.getpid():
            with contextlib.suppress(Exception):
                Workspace.connect(rec.id).destroy()
                destroyed.append(rec.id)
    out = pipeline.gc()
    out["reaped"] = destroyed
    return out
