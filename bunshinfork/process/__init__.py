"""Process subsystem (paper §4.3): capture and rebuild a workspace's whole process tree.

The tree is rooted at the workspace's init (init.py, csrc/init.c), which starts every command
and answers on a control socket inside the workspace (control.py). CRIU, driven over its RPC
protocol (criu.py), dumps the tree while the workspace is frozen (dump.py) and restores it
inside fresh pid, mount, net, ipc and uts namespaces (restore.py), so every pid, parent link,
session and thread inside the namespace is identical in each clone while host pids differ.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from .. import idmap, native
from ..cgroups import Cgroup
from ..contract import Build, Capture, Check, Held, Part
from ..errors import ForkError
from ..state import InitState, Lineage, proc_starttime
from . import control, criu, init, lifetime, seccomp_profile, sessions
from .dump import dump_tree, predump_tree, prepare_dump
from .options import dump_opts, restore_opts
from .reaper import reaper
from .restore import restore_tree
from .tree import ProcInfo, tree

__all__ = ["ProcInfo", "ProcessPart", "dump_opts", "restore_opts", "tree"]

# Here rather than in native.py, which lies below contract.py (state.py imports it): the probe
# loads native.py, the one module that imports the compiled bunshinfork._native, by name, so
# that a missing build is a failed check.
def check_native() -> Check:
    try:
        importlib.import_module("bunshinfork.native")
    except ImportError as e:
        return Check("native", False, f"bunshinfork._native does not load ({e}); reinstall bunshin "
                     "(scripts/setup.sh)", required=True)
    return Check("native", True, "bunshinfork._native loads", required=True)


class ProcessPart(Part):
    name = "process"
    # Each beside the mechanism it checks.
    probes = (init.check_namespaces, check_native, init.check_init_binary, criu.check_pycriu,
              criu.check_criu_version, criu.check_criu_check, seccomp_profile.check_seccomp, idmap.check_userns)

    def prepare(self, b: Build) -> None:
        assert b.root is not None and b.rec.fs is not None and b.rec.fs.layer is not None
        init.require_binary()
        upper = Path(b.rec.fs.layer.upper)
        init.install(upper)
        if b.rec.spec.userns:
            self._mount_for_userns(b, upper)
        assert b.rec.cgroups is not None
        b.rec.process, b.pidfd = init.spawn(b.rec, str(b.root.path), b.root.options, Cgroup(b.rec.cgroups),
                                            b.ksm_merge)
        # Held in the init's memory, never in its file system (lifetime.py); until this the
        # init waits for it, and a create that fails here leaves nothing running.
        lifetime.install(b.rec.process.pid, b.rec.process.starttime, b.rec.lifetime)
        if b.rec.lifetime.lease:
            lifetime.leases.hold(b.rec)

    @staticmethod
    def _mount_for_userns(b: Build, upper: Path) -> None:
        """The host's share of a userns workspace's root: what it wrote into the layer given to
        the namespace's ids first (the overlay reads its root's owner when mounted), then the
        overlay mounted here, where the child's mount namespace copies it at the clone; the
        host's own reference goes once the child runs."""
        assert b.root is not None
        idmap.shift_tree(upper)
        point = str(b.root.path)
        # nodev, which the child's bind of it keeps (csrc/native.c).
        native.mount("overlay", point, "overlay", native.MS_NODEV, b.root.options)
        b.deferred.append(lambda: native.umount2(point, native.MNT_DETACH))

    def before_freeze(self, c: Capture) -> None:
        prepare_dump(c)
        predump_tree(c)

    def capture(self, c: Capture) -> None:
        dump_tree(c)

    def restore(self, b: Build) -> None:
        assert b.source is not None
        rec = b.rec
        assert rec.fs is not None and rec.fs.layer is not None
        # The clone's own lifetime, never its source's: restore_tree gives it to the init
        # before any of the clone's tasks runs again.
        pid = restore_tree(b)
        rec.process = InitState(pid, proc_starttime(pid) or 0)
        # Its memory is the snapshot's: a snapshot of the clone stores what differs from it.
        rec.lineage = Lineage((b.source.meta.id,)) if b.source.owned else None
        rec.save()
        b.pidfd = os.pidfd_open(pid)
        reaper.watch(pid, b.pidfd)
        with b.stage("process.ready"):
            if not control.ping(pid):
                raise ForkError(f"clone {rec.id} was restored but its init does not answer")
        if rec.lifetime.lease:
            lifetime.leases.hold(rec)

    def release(self, held: Held) -> None:
        if not isinstance(held, Build):
            return
        lifetime.leases.drop(held.rec.id)
        init.kill_tree(held.rec, held.pidfd)
        if held.pidfd is not None:
            pidfd, held.pidfd = held.pidfd, None
            os.close(pidfd)

    def gc(self) -> list[str]:
        """CRIUs whose caller died (sessions.py)."""
        return sessions.gc()
