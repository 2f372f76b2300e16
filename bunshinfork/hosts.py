"""This process's bunshin host, the public API: which host it is, where its state lives, and
the teardown of one of several hosts on a machine.

A host is what bunshinfork names host-wide (state root, cgroup parent, bridge, subnet, layer
store), read from the environment once when bunshinfork is imported (bunshinfork.host). The
machine's default host is one per machine; `HostConfig.named(name)` is one of several, and its
`env()` is what a child process needs to become it (a pool's worker: bunshinrl.cluster).

    current_host()     the configuration this process runs as
    state_root()       its state root, mounted (a tmpfs of its own when it would share `/`)
    reap_orphans()     destroy this host's workspaces whose creator is gone, then gc
    teardown_host()    remove a named host's state root and cgroup parents once it holds no workspace
    tree_bytes(path)   the bytes of the files under a host directory (a saved snapshot)

Nothing here touches another host's workspaces, cgroups, veths or layers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from . import native, pipeline, state
from .cgroups import cgroup
from .errors import BunshinError, HostError, HostInUse
from .host import DEFAULT_RUN_ROOT, HOST, HostConfig
from .memory import ksm
from .workspace import Workspace


def current_host() -> HostConfig:
    """The host this process is (its environment when bunshinfork was imported)."""
    return HOST


def state_root() -> Path:
    """This host's state root, created and mounted if it is not yet: where a caller may keep
    host-side files beside the workspaces (a snapshot being imported), on the same file system."""
    return state.run_root()


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """The sizes of the files under `path` (a saved snapshot's directory), summed; a file removed
    meanwhile counts for nothing, and a path that does not exist holds 0 bytes."""
    return state.tree_bytes(path)


def reap_orphans() -> dict[str, list[str]]:
    """Destroy every running workspace of this host whose creator process is gone (a worker that
    died), except this process's own, then run bunshinfork's gc on this host (`bunshin gc`): on a
    named host only its own state root, cgroup parent, bridge and layer store are touched.

    Returns gc's report by kind, with the ids destroyed here under "reaped". A workspace that
    cannot be destroyed (it went meanwhile) is left to gc."""
    reaped = []
    for rec in state.records():
        if rec.status is state.Status.RUNNING and rec.creator_pid != os.getpid() and not rec.creator_alive():
            with contextlib.suppress(BunshinError, OSError):
                Workspace.connect(rec.id).destroy()
                reaped.append(rec.id)
    out = pipeline.gc()
    out["reaped"] = reaped
    return out


def teardown_host() -> list[str]:
    """Remove this named host from the machine: its cgroup parents (every hierarchy's), its state
    root's tmpfs and directory, and this process's boost of ksmd. Returns the paths removed.

    HostInUse while a workspace's state directory remains under the state root (destroy them, or
    reap_orphans() first); nothing is removed then. HostError on the machine's default host,
    which is never torn down (other processes share it)."""
    root = HOST.run_root
    if root == DEFAULT_RUN_ROOT:
        raise HostError(f"{root} is the machine's default host; only a named host is torn down")
    left = sorted(n for n in os.listdir(root) if n.startswith("ws-")) if root.is_dir() else []
    if left:
        raise HostInUse(f"host {root} still holds {len(left)} workspace(s): {', '.join(left[:5])}")
    # ksmd's knobs are the machine's: a host that boosted them leaves the boost now, not at an exit
    # its pool may never give it (Ray kills a retired actor), so the knobs do not wait on a prune.
    ksm.tuner.relax_now()
    removed = []
    for parent in _cgroup_parents():
        with contextlib.suppress(OSError):
            os.rmdir(parent)
            removed.append(str(parent))
    if os.path.ismount(root):
        native.umount2(str(root), native.MNT_DETACH)
    if root.exists():
        shutil.rmtree(root, ignore_errors=True)
        removed.append(str(root))
    return removed


def _cgroup_parents() -> list[Path]:
    """This host's cgroup parent in each hierarchy that has one (v2, v1's controllers, hybrid's unified)."""
    base = cgroup.CGROUP_ROOT
    ps = [base / cgroup.PARENT] if (base / "cgroup.controllers").exists() else \
        [base / c / cgroup.PARENT for c in cgroup.V1_CONTROLLERS]
    return [p for p in [*ps, base / cgroup.UNIFIED / cgroup.PARENT] if p.is_dir()]


__all__ = ["HostConfig", "current_host", "reap_orphans", "state_root", "teardown_host", "tree_bytes"]
