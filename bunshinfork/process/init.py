"""The workspace's PID 1 (csrc/init.c): where its binary is, starting it, and ending its tree."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

from .. import idmap, native
from ..cgroups import Cgroup
from ..contract import Check
from ..errors import BunshinError, CgroupError, KernelFeatureError, PrivilegeError, WorkspaceStateError
from ..state import InitState, Record, proc_starttime
from . import control, seccomp_profile
from .reaper import reaper

INIT_BINARY = Path(__file__).resolve().parent.parent / "_bin" / "bunshin-init"
IN_WORKSPACE = "/.bunshin/init"
BOOT_ID = "/.bunshin/boot_id"
NS_FLAGS = (
    native.CLONE_NEWPID | native.CLONE_NEWNS | native.CLONE_NEWNET | native.CLONE_NEWIPC | native.CLONE_NEWUTS
    | native.CLONE_NEWCGROUP
)
READY_TIMEOUT = 15.0


def require_binary() -> None:
    if not INIT_BINARY.exists():
        raise KernelFeatureError(f"{INIT_BINARY} is missing; reinstall bunshin (scripts/setup.sh)")


def install(upper: Path) -> None:
    """Put the init into a new workspace's own layer, where it execs it from, beside a new boot id."""
    bdir = upper / Path(IN_WORKSPACE).parent.name
    bdir.mkdir(mode=0o700)
    shutil.copy2(INIT_BINARY, upper / IN_WORKSPACE.lstrip("/"))
    new_boot_id(upper)


def new_boot_id(upper: Path) -> None:
    """A cold boot's identity: the boot id its /proc/sys/kernel/random/boot_id shows (a bind of
    this file, csrc/native.c), new for every created workspace, whatever its root file system
    carries; a clone keeps its source's, in the layers it stacks on."""
    path = upper / BOOT_ID.lstrip("/")
    path.write_text(f"{uuid.uuid4()}\n")
    path.chmod(0o444)


def spawn(rec: Record, root: str, overlay_opts: str, cgroup: Cgroup, ksm_merge: bool) -> tuple[InitState, int]:
    """Clone the init into new namespaces, inside `cgroup` before it runs anything, mounting its
    overlay in its own mount namespace (with userns, binding the one the host mounted at
    `root`); returns its state and pidfd once it answers."""
    spec = rec.spec
    sp = native.spawn(native.SpawnConfig(
        ns_flags=NS_FLAGS | (native.CLONE_NEWUSER if spec.userns else 0), root=root, overlay_opts=overlay_opts,
        hostname=rec.hostname, init_path=IN_WORKSPACE,
        mount_sysfs=spec.mount_sysfs, ksm_merge=ksm_merge, privileged=spec.privileged,
        seccomp_bpf=b"" if spec.privileged else seccomp_profile.bpf(), tmpfs_size=spec.disk_limit or 0,
    ))
    init = InitState(sp.pid, proc_starttime(sp.pid) or 0)
    rec.process = init
    rec.save()
    reaper.watch(sp.pid, sp.pidfd)
    try:
        cgroup.add(sp.pid)
        if spec.userns:
            idmap.write(sp.pid)
    except (CgroupError, KernelFeatureError):
        os.kill(sp.pid, signal.SIGKILL)
        os.close(sp.sync_fd)
        os.close(sp.err_fd)
        os.close(sp.pidfd)
        raise
    try:
        failure = native.release(sp)
        if failure:
            raise _classify_spawn_failure(failure)
        wait_ready(rec.id, init)
    except BaseException:
        os.close(sp.pidfd)
        raise
    return init, sp.pidfd


def wait_ready(ws_id: str, init: InitState) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    delay = 0.001
    while not control.ping(init.pid):
        if not init.alive():
            raise WorkspaceStateError(f"workspace {ws_id}: init exited during start-up")
        if time.monotonic() > deadline:
            raise WorkspaceStateError(f"workspace {ws_id}: init did not answer within {READY_TIMEOUT}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _classify_spawn_failure(msg: str) -> BunshinError:
    if "Operation not permitted" in msg:
        return PrivilegeError(f"workspace set-up failed at {msg}; run as root with CAP_SYS_ADMIN")
    if "mount overlay" in msg:
        return KernelFeatureError(f"workspace set-up failed at {msg}; is overlayfs available? see 'bunshin doctor'")
    return WorkspaceStateError(f"workspace set-up failed at {msg}")


def kill_tree(rec: Record, pidfd: int | None) -> None:
    """Kill every process of the workspace and wait until they are gone."""
    cg = Cgroup(rec.cgroups) if rec.cgroups is not None else None
    if cg is not None and cg.exists():
        # v1 freezer: a frozen task cannot act on SIGKILL until thawed.
        with contextlib.suppress(CgroupError, OSError):
            if cg.frozen():
                cg.thaw()
    init = rec.process
    if init is not None and init.alive():
        # Killing a pid namespace's init kills every process in it.
        with contextlib.suppress(ProcessLookupError):
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(init.pid, signal.SIGKILL)
    if init is not None:
        deadline = time.monotonic() + 10
        while init.alive() and time.monotonic() < deadline:
            if rec.creator_pid == os.getpid():
                reaper.reap_now(init.pid)
            time.sleep(0.002)
        # It may have become a zombie since the last reap (alive() counts one as gone): reap it
        # here rather than leave it to the reaper's thread, so that it is gone on return.
        if rec.creator_pid == os.getpid():
            reaper.reap_now(init.pid)
    if cg is not None and cg.exists():
        deadline = time.monotonic() + 10
        while cg.pids() and time.monotonic() < deadline:
            for pid in cg.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)


NAMESPACES = ("pid", "mnt", "net", "ipc", "uts", "cgroup")


def check_namespaces() -> Check:
    missing = [ns for ns in NAMESPACES if not os.path.exists(f"/proc/self/ns/{ns}")]
    if missing:
        return Check("namespaces", False, f"missing {', '.join(missing)} namespace(s); the kernel lacks "
                     f"CONFIG_{'/'.join(m.upper() for m in missing)}_NS", required=True)
    return Check("namespaces", True, ", ".join(NAMESPACES), required=True)


def check_init_binary() -> Check:
    if os.access(INIT_BINARY, os.X_OK):
        return Check("bunshin-init", True, str(INIT_BINARY), required=True)
    return Check("bunshin-init", False, f"{INIT_BINARY} is missing or not executable; reinstall bunshin "
                 "(scripts/setup.sh)", required=True)
