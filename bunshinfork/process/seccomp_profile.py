"""The workspaces' seccomp filter: Docker's default profile, built with libseccomp's bindings.

Docker renders its profile for a container's capabilities and the host's architecture; this
is that rendering for a workspace: Docker's default capability set without CAP_MKNOD and CAP_NET_RAW (see
`kept_caps` in csrc/native.c) on x86-64, with its i386 and x32 sub-architectures. What is
not allowed fails with EPERM (Docker's default action), clone3 with ENOSYS (so that glibc
falls back to clone, whose namespace flags are refused). Among what it refuses: mount,
unshare, setns and namespace-creating clone flags (so no user namespaces inside), bpf,
keyctl, add_key, kexec, modules, swapon, reboot, the clock, personality changes other than
the usual ones, and AF_ALG and AF_VSOCK sockets.

The filter is exported as BPF once per process and loaded by the workspace's first process
just before it execs the init (csrc/native.c), so the init and everything it starts run under
it. CRIU dumps such a tree (its parasite runs with the filter suspended, PTRACE_O_SUSPEND_SECCOMP)
and restores the filter in every restored task before it resumes; the cow engine's injected
clone and wait4 are allowed by it.
"""

from __future__ import annotations

import errno
import functools
import tempfile

try:
    import seccomp  # type: ignore[import-not-found]  # Debian's python3-seccomp (libseccomp)
except ImportError:  # pragma: no cover - set-up installs python3-seccomp
    seccomp = None

from ..contract import Check
from ..errors import KernelFeatureError

_ALLOWED = """
accept accept4 access adjtimex alarm arch_prctl bind brk cachestat capget capset chdir chmod
chown chown32 chroot clock_adjtime clock_adjtime64 clock_getres clock_getres_time64
clock_gettime clock_gettime64 clock_nanosleep clock_nanosleep_time64 close close_range connect
copy_file_range creat dup dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old
epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd eventfd2 execve execveat exit
exit_group faccessat faccessat2 fadvise64 fadvise64_64 fallocate fanotify_mark fchdir fchmod
fchmodat fchmodat2 fchown fchown32 fchownat fcntl fcntl64 fdatasync fgetxattr flistxattr flock
fork fremovexattr fsetxattr fstat fstat64 fstatat64 fstatfs fstatfs64 fsync ftruncate
ftruncate64 futex futex_time64 futex_waitv futimesat get_robust_list get_thread_area getcpu
getcwd getdents getdents64 getegid getegid32 geteuid geteuid32 getgid getgid32 getgroups
getgroups32 getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom
getresgid getresgid32 getresuid getresuid32 getrlimit getrusage getsid getsockname getsockopt
gettid gettimeofday getuid getuid32 getxattr inotify_add_watch inotify_init inotify_init1
inotify_rm_watch io_cancel io_destroy io_getevents io_pgetevents io_pgetevents_time64 io_setup
io_submit ioctl ioprio_get ioprio_set ipc kill landlock_add_rule landlock_create_ruleset
landlock_restrict_self lchown lchown32 lgetxattr link linkat listen listxattr llistxattr
_llseek lremovexattr lseek lsetxattr lstat lstat64 madvise map_shadow_stack membarrier
memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat mlock mlock2 mlockall mmap mmap2
modify_ldt mprotect mq_getsetattr mq_notify mq_open mq_timedreceive mq_timedreceive_time64
mq_timedsend mq_timedsend_time64 mq_unlink mremap msgctl msgget msgrcv msgsnd msync munlock
munlockall munmap name_to_handle_at nanosleep newfstatat _newselect open openat openat2 pause
pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll
ppoll_time64 prctl pread64 preadv preadv2 prlimit64 process_mrelease process_vm_readv
process_vm_writev pselect6 pselect6_time64 ptrace pwrite64 pwritev pwritev2 read readahead
readlink readlinkat readv recv recvfrom recvmmsg recvmmsg_time64 recvmsg remap_file_pages
removexattr rename renameat renameat2 restart_syscall rmdir rseq rt_sigaction
rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend rt_sigtimedwait
rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_get_priority_max sched_get_priority_min
sched_getaffinity sched_getattr sched_getparam sched_getscheduler sched_rr_get_interval
sched_rr_get_interval_time64 sched_setaffinity sched_setattr sched_setparam sched_setscheduler
sched_yield seccomp select semctl semget semop semtimedop semtimedop_time64 send sendfile
sendfile64 sendmmsg sendmsg sendto set_robust_list set_thread_area set_tid_address setfsgid
setfsgid32 setfsuid setfsuid32 setgid setgid32 setgroups setgroups32 setitimer setpgid
setpriority setregid setregid32 setresgid setresgid32 setresuid setresuid32 setreuid
setreuid32 setrlimit setsid setsockopt setuid setuid32 setxattr shmat shmctl shmdt shmget
shutdown sigaltstack signalfd signalfd4 sigprocmask sigreturn socketcall socketpair splice stat
stat64 statfs statfs64 statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill
time timer_create timer_delete timer_getoverrun timer_gettime timer_gettime64 timer_settime
timer_settime64 timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime
timerfd_settime64 times tkill truncate truncate64 ugetrlimit umask uname unlink unlinkat utime
utimensat utimensat_time64 utimes vfork vmsplice wait4 waitid waitpid write writev
"""
ALLOWED = tuple(_ALLOWED.split())

# (Docker's list also has riscv_hwprobe, a RISC-V call libseccomp 2.5.4 cannot name.)
# Allowed too, but newer than bookworm's libseccomp 2.5.4, which cannot name them: their x86-64
# numbers (asm/unistd_64.h). They are allowed for native x86-64 code only.
ALLOWED_X86_64_NUMBERS = {
    "uretprobe": 335, "futex_wake": 454, "futex_wait": 455, "futex_requeue": 456, "statmount": 457,
    "listmount": 458, "mseal": 462, "setxattrat": 463, "getxattrat": 464, "listxattrat": 465,
    "removexattrat": 466,
}
# personality(2) personas Docker allows: PER_LINUX, UNAME26, ADDR_NO_RANDOMIZE, both, and a query.
PERSONALITIES = (0x0, 0x0008, 0x20000, 0x20008, 0xFFFFFFFF)
AF_ALG, AF_VSOCK = 38, 40
# Namespace flags a clone without CAP_SYS_ADMIN may not carry (CLONE_NEWNS|NEWCGROUP|NEWUTS|
# NEWIPC|NEWUSER|NEWPID|NEWNET).
CLONE_NAMESPACES = 0x7E020000


def available() -> bool:
    return seccomp is not None


def _rules(f: seccomp.SyscallFilter) -> None:
    for name in ALLOWED:
        f.add_rule(seccomp.ALLOW, name)
    f.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.LT, AF_ALG))
    f.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.EQ, AF_ALG + 1))  # AF_NFC, between the two
    f.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.GT, AF_VSOCK))
    for persona in PERSONALITIES:
        f.add_rule(seccomp.ALLOW, "personality", seccomp.Arg(0, seccomp.EQ, persona))
    f.add_rule(seccomp.ALLOW, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NAMESPACES, 0))
    f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")


@functools.lru_cache(maxsize=1)
def bpf() -> bytes:
    """The filter as a BPF program (struct sock_filter[]), ready for seccomp(2)."""
    if seccomp is None:
        raise KernelFeatureError("libseccomp's Python bindings are missing (Debian's python3-seccomp); "
                                 "run scripts/setup.sh, or create the workspace with privileged=True")
    native = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))
    _rules(native)
    for number in ALLOWED_X86_64_NUMBERS.values():
        native.add_rule(seccomp.ALLOW, number)
    # Rules are added per architecture present at the time: the 32-bit ABIs get their own
    # filter, merged in (libseccomp refuses numbers across several architectures).
    compat = seccomp.SyscallFilter(seccomp.ERRNO(errno.EPERM))
    compat.remove_arch(seccomp.Arch.NATIVE)
    compat.add_arch(seccomp.Arch.X86)
    compat.add_arch(seccomp.Arch.X32)
    _rules(compat)
    native.merge(compat)
    with tempfile.TemporaryFile() as out:
        native.export_bpf(out)
        out.seek(0)
        return out.read()


def check_seccomp() -> Check:
    if not available():
        return Check("seccomp", False, "libseccomp's Python bindings are missing (Debian's python3-seccomp): "
                     "only privileged=True workspaces can be created; scripts/setup.sh installs them",
                     required=True)
    rules = len(bpf()) // 8
    return Check("seccomp", True, f"Docker's default profile, {rules} BPF instructions", required=True)
