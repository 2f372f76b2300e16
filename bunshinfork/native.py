"""Thin, typed access to the CFFI `_native` module (errno becomes OSError), and where host tools are."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass

from ._native import ffi, lib

CLONE_NEWCGROUP = 0x02000000
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000

MS_NOSUID = 2
MS_NODEV = 4
MS_NOATIME = 1024
MNT_DETACH = 2

PR_GET_MEMORY_MERGE = 68


# sudo and cron often drop the sbin directories from PATH, where criu and mkfs.btrfs live.
SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def which(prog: str) -> str | None:
    """`prog` on PATH, or in an sbin directory PATH left out."""
    found = shutil.which(prog)
    if found:
        return found
    for d in SBIN_DIRS:
        p = os.path.join(d, prog)
        if os.access(p, os.X_OK):
            return p
    return None


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ffi.errno
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    def c(s: str | None):
        return ffi.NULL if s is None else s.encode()

    _check(lib.bn_mount(c(source), target.encode(), c(fstype), flags, c(data)), f"mount {target}")


def umount2(target: str, flags: int = 0) -> None:
    _check(lib.bn_umount2(target.encode(), flags), f"umount {target}")


def unmount_below(directory: str | os.PathLike[str]) -> None:
    """Detach every host mount under `directory`, children before their parents. A restore that
    failed, or whose creator died, leaves the clone's overlay (CRIU's --root) and CRIU's cgroup
    yard mounted under the clone's state directory."""
    prefix = str(directory) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for mp in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        with contextlib.suppress(OSError):
            umount2(mp, MNT_DETACH)


RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


def openat2(dirfd: int, path: str, flags: int, mode: int = 0o644,
            resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> int:
    # openat2 rejects a mode unless the call can create the file.
    mode = mode if (flags & os.O_CREAT or (flags & os.O_TMPFILE) == os.O_TMPFILE) else 0
    return _check(lib.bn_openat2(dirfd, path.encode(), flags | os.O_CLOEXEC, mode, resolve), f"open {path}")


def setns(fd: int, nstype: int = 0) -> None:
    _check(lib.bn_setns(fd, nstype), "setns")


def prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    return _check(lib.bn_prctl(option, a2, a3, a4, a5), f"prctl({option})")


def set_hostname_in(pid: int, name: str) -> None:
    """sethostname() inside the UTS namespace of `pid`."""
    _check(lib.bn_set_hostname_in(pid, name.encode()), f"set hostname of {pid}")


def loopback_up_in(pid: int) -> None:
    """Bring up the loopback interface in the network namespace of `pid` (the kernel gives it
    127.0.0.1/8 and ::1)."""
    _check(lib.bn_loopback_up_in(pid), f"bring up lo of {pid}")


def attach_device_filter(cgroup_dir: str, rules: list[tuple[int, int, int]]) -> None:
    """Allow only `rules` ((type, major, minor): type 1 block, 2 char; minor -1 any) to the tasks
    of the cgroup2 directory `cgroup_dir` (a BPF device program, csrc/native.c)."""
    flat = ffi.new("int[]", [v for rule in rules for v in rule])
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check(lib.bn_attach_device_filter(fd, flat, len(rules)), f"attach the device allowlist to {cgroup_dir}")
    finally:
        os.close(fd)


def _neg_errno(rc: int, what: str) -> int:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def ptrace_seize(pid: int) -> None:
    """PTRACE_SEIZE (with PTRACE_O_TRACECLONE) and PTRACE_INTERRUPT; wait_stop() collects the stop."""
    _neg_errno(lib.bn_ptrace_seize(pid), f"ptrace seize {pid}")


def _ms(timeout: float | None) -> int:
    return 0 if timeout is None else max(1, int(timeout * 1000))


def ptrace_wait_stop(pid: int, timeout: float | None = None) -> None:
    """Collect `pid`'s ptrace stop; TimeoutError (ETIMEDOUT) past `timeout` seconds."""
    _neg_errno(lib.bn_ptrace_wait_stop(pid, _ms(timeout)), f"wait for {pid} to stop")


def ptrace_detach(pid: int) -> None:
    _neg_errno(lib.bn_ptrace_detach(pid), f"ptrace detach {pid}")


def inject_fork(pid: int, timeout: float | None = None) -> tuple[int, int]:
    """Fork a stopped tracee from inside; the child is traced by us and stopped before its first
    instruction, and its parent gets no SIGCHLD for it. Returns (host pid, pid in the tracee's
    namespace) of the child. Past `timeout` seconds the tracee is interrupted and restored, and
    TimeoutError (ETIMEDOUT) is raised."""
    ns_child = ffi.new("int *")
    host = _neg_errno(lib.bn_inject_fork(pid, ns_child, _ms(timeout)), f"inject fork into {pid}")
    return host, int(ns_child[0])


def inject_reap(parent: int, ns_child: int, timeout: float | None = None) -> None:
    """Reap a killed child inside its stopped, traced parent with an injected wait4(__WALL|WNOHANG);
    `ns_child` is the child's pid as the parent sees it. BlockingIOError (EAGAIN): not reapable yet."""
    _neg_errno(lib.bn_inject_reap(parent, ns_child, _ms(timeout)), f"inject wait4({ns_child}) into {parent}")


def inject_syscall(pid: int, nr: int, a1: int = 0, a2: int = 0, a3: int = 0, timeout: float | None = None) -> int:
    """Run syscall `nr` inside the stopped tracee `pid`; returns what it returned (-errno on
    failure). Past `timeout` seconds it is interrupted, the tracee's code and registers are put
    back, and TimeoutError is raised."""
    result = ffi.new("long *")
    _neg_errno(lib.bn_inject_syscall(pid, nr, a1, a2, a3, _ms(timeout), result), f"inject syscall {nr} into {pid}")
    return int(result[0])


@dataclass
class Spawned:
    pid: int
    pidfd: int
    sync_fd: int
    err_fd: int


@dataclass
class SpawnConfig:
    ns_flags: int
    root: str
    overlay_opts: str
    hostname: str
    init_path: str = "/.bunshin/init"
    mount_sysfs: bool = True
    ksm_merge: bool = False
    privileged: bool = False
    seccomp_bpf: bytes = b""  # loaded just before the init is exec'd (empty: none)
    tmpfs_size: int = 0  # size= of /tmp and /dev/shm in bytes (0: tmpfs's defaults)


def spawn(cfg: SpawnConfig) -> Spawned:
    """Clone the workspace's first process; it waits for `release` before doing anything."""
    keep = [ffi.new("char[]", s.encode()) for s in (cfg.root, cfg.overlay_opts, cfg.hostname, cfg.init_path)]
    c = ffi.new("struct bn_spawn_cfg *")
    c.ns_flags = cfg.ns_flags
    c.root, c.overlay_opts, c.hostname, c.init_path = keep
    c.mount_sysfs = int(cfg.mount_sysfs)
    c.ksm_merge = int(cfg.ksm_merge)
    c.privileged = int(cfg.privileged)
    bpf = ffi.new("unsigned char[]", cfg.seccomp_bpf) if cfg.seccomp_bpf else ffi.NULL
    keep.append(bpf)
    c.seccomp_bpf = bpf
    c.seccomp_len = len(cfg.seccomp_bpf)
    c.tmpfs_size = cfg.tmpfs_size
    pidfd = ffi.new("int *")
    sync_fd = ffi.new("int *")
    err_fd = ffi.new("int *")
    pid = _check(lib.bn_spawn(c, pidfd, sync_fd, err_fd), "clone3 workspace init")
    return Spawned(pid, pidfd[0], sync_fd[0], err_fd[0])


def release(sp: Spawned) -> str | None:
    """Let the child run its set-up and exec the init; returns None or the step that failed."""
    buf = ffi.new("char[]", 512)
    rc = lib.bn_spawn_release(sp.sync_fd, sp.err_fd, buf, 512)
    return None if rc == 0 else ffi.string(buf).decode(errors="replace")
