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
from ..errors import BunshinError, ForkError
from ..state import InitState, Lineage, proc_starttime
from . import control, criu, init, lifetime, seccomp_profile, sessions
from .dump import dump_tree, predump_tree
from .options import dump_opts, restore_opts
from .reaper import reaper
from .restore import restore_tree
from .tree import ProcInfo, tree

__all__ = ["ProcInfo", "ProcessPart", "dump_opts", "restore_opts", "tree"]

NAMESPACES = ("pid", "mnt", "net", "ipc", "uts", "cgroup")


def check_namespaces() -> Check:
    missing = [ns for ns in NAMESPACES if not os.path.exists(f"/proc/self/ns/{ns}")]
    if missing:
        return Check("namespaces", False, f"missing {', '.join(missing)} namespace(s); the kernel lacks "
                     f"CONFIG_{'/'.join(m.upper() for m in missing)}_NS", required=True)
    return Check("namespaces", True, ", ".join(NAMESPACES), required=True)


def check_native() -> Check:
    try:
        importlib.import_module("bunshinfork._native")
    except ImportError as e:
        return Check("native", False, f"bunshinfork._native does not load ({e}); reinstall bunshin "
                     "(scripts/setup.sh)", required=True)
    return Check("native", True, "bunshinfork._native loads", required=True)


def check_init_binary() -> Check:
    if os.access(init.INIT_BINARY, os.X_OK):
        return Check("bunshin-init", True, str(init.INIT_BINARY), required=True)
    return Check("bunshin-init", False, f"{init.INIT_BINARY} is missing or not executable; reinstall bunshin "
                 "(scripts/setup.sh)", required=True)


def check_pycriu() -> Check:
    if criu.rpc is None:
        return Check("pycriu", False, "pycriu does not import; scripts/setup.sh installs it into the venv",
                     required=True)
    return Check("pycriu", True, f"importable ({os.path.dirname(criu.rpc.__file__ or '?')})", required=True)


def check_criu_version() -> Check:
    try:
        path = criu.binary()
        v = criu.version()
    except BunshinError as e:
        return Check("criu", False, f"{e}; scripts/setup.sh builds 4.2.1", required=True)
    shown = ".".join(map(str, v))
    if why := criu.version_problem(v):
        return Check("criu", False, f"{shown} ({path}) is {why}", required=True)
    newer = "; newer than the tested 4.2.x" if v[:2] > criu.REQUIRED else ""
    return Check("criu", True, f"{shown} ({path}){newer}", required=True)


def check_criu_check() -> Check:
    if os.geteuid() != 0:
        return Check("criu check", False, "criu check needs root", required=True)
    try:
        problem = criu.check()
    except BunshinError as e:
        return Check("criu check", False, str(e), required=True)
    if problem is None:
        return Check("criu check", True, "Looks good.", required=True)
    return Check("criu check", False, problem, required=True)


def check_seccomp() -> Check:
    if not seccomp_profile.available():
        return Check("seccomp", False, "libseccomp's Python bindings are missing (Debian's python3-seccomp): "
                     "only privileged=True workspaces can be created; scripts/setup.sh installs them",
                     required=True)
    rules = len(seccomp_profile.bpf()) // 8
    return Check("seccomp", True, f"Docker's default profile, {rules} BPF instructions", required=True)


def check_userns() -> Check:
    """userns=True only: the kernel must let the host create user namespaces."""
    try:
        limit = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        limit = 0
    if not os.path.exists("/proc/self/ns/user") or limit <= 0:
        return Check("user namespaces", False, "the kernel offers none (CONFIG_USER_NS, user.max_user_namespaces): "
                     "only userns=False workspaces can be created", required=False)
    return Check("user namespaces", True, f"userns=True maps root to host uid {idmap.BASE} "
                 f"(max_user_namespaces {limit})", required=False)


class ProcessPart(Part):
    name = "process"
    probes = (check_namespaces, check_native, check_init_binary, check_pycriu, check_criu_version,
              check_criu_check, check_seccomp, check_userns)

    def prepare(self, b: Build) -> None:
        assert b.root is not None and b.rec.fs is not None and b.rec.fs.layer is not None
        init.require_binary()
        upper = Path(b.rec.fs.layer.upper)
        init.install(upper)
        lifetime.seed(upper, b.rec.lifetime)
        if b.rec.spec.userns:
            self._mount_for_userns(b, upper)
        assert b.rec.cgroups is not None
        b.rec.process, b.pidfd = init.spawn(b.rec, str(b.root.path), b.root.options, Cgroup(b.rec.cgroups),
                                            b.ksm_merge)
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
        native.mount("overlay", point, "overlay", 0, b.root.options)
        b.deferred.append(lambda: native.umount2(point, native.MNT_DETACH))

    def before_freeze(self, c: Capture) -> None:
        predump_tree(c)

    def capture(self, c: Capture) -> None:
        dump_tree(c)

    def restore(self, b: Build) -> None:
        assert b.source is not None
        rec = b.rec
        assert rec.fs is not None and rec.fs.layer is not None
        # The clone's own lifetime, never its source's: the restored init obeys this file.
        lifetime.seed(Path(rec.fs.layer.upper), rec.lifetime)
        if rec.spec.userns:
            idmap.shift_tree(Path(rec.fs.layer.upper))  # its /.bunshin, which the init reads
        pid = restore_tree(b)
        rec.process = InitState(pid, proc_starttime(pid) or 0)
        # Its memory is the snapshot's: a snapshot of the clone stores what differs from it.
        rec.lineage = Lineage((b.source.meta.id,)) if b.source.owned else None
        rec.save()
        b.pidfd = os.pidfd_open(pid)
        reaper.watch(pid, b.pidfd)
        with b.stage("process.hostname"):
            native.set_hostname_in(pid, rec.hostname)
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
