"""Docker-equivalent confinement by default: the seccomp filter (Docker's default profile), a
cgroup namespace, and privileged=True opting out; clones keep all of it."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from fork_support import COW, fork_of
from helpers import run_ok

from bunshinfork.process import seccomp_profile
from bunshinfork.workspace import Workspace

# Each probe is (name, syscall number, arguments); the script prints {name: errno or 0}.
# x86-64 numbers. Arguments are chosen so that an allowed call fails for its own reasons (a
# bad pointer, a bad fd) and never with EPERM, which is the filter's answer; and so that none
# has an effect even in a privileged workspace (no kexec_load, no namespace-creating clone).
PROBES = {
    "unshare(CLONE_NEWUSER)": (272, [0x10000000]),
    "clone3": (435, [0, 0]),
    "keyctl": (250, [0, 0, 0]),
    "add_key": (248, [0, 0, 0, 0, 0]),
    "bpf": (321, [0, 0, 0]),
    "io_uring_setup": (425, [1, 0]),
    "userfaultfd": (323, [0]),
    "swapon": (167, [0, 0]),
    "personality(READ_IMPLIES_EXEC)": (135, [0x0400000]),
    "socket(AF_VSOCK)": (41, [40, 1, 0]),
    "socket(AF_ALG)": (41, [38, 5, 0]),
    # allowed
    "personality(query)": (135, [0xFFFFFFFF]),
    "socket(AF_UNIX)": (41, [1, 1, 0]),
    "ptrace(PEEKDATA, 0)": (101, [2, 0, 0, 0]),
    "getpid": (39, []),
    "fchmodat2": (452, [-100, 0, 0, 0]),  # Linux 6.6; ENOSYS from older kernels
    "mseal (named by number)": (462, [0, 0, 0]),  # Linux 6.10, unknown to libseccomp 2.5.4
}
DENIED = {"unshare(CLONE_NEWUSER)", "keyctl", "add_key", "bpf", "io_uring_setup", "userfaultfd", "swapon",
          "personality(READ_IMPLIES_EXEC)", "socket(AF_VSOCK)", "socket(AF_ALG)"}
PROBE_SCRIPT = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
for name, (nr, args) in json.loads(sys.argv[1]).items():
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    out[name] = ctypes.get_errno() if r == -1 else 0
print(json.dumps(out))
"""


def _probe(ws: Workspace) -> dict[str, int]:
    ws.files.write("/root/probe.py", PROBE_SCRIPT)
    return json.loads(run_ok(ws, ["python3", "/root/probe.py", json.dumps(PROBES)]).stdout)


def _assert_confined(ws: Workspace) -> None:
    status = run_ok(ws, "grep -E '^(Seccomp|Seccomp_filters|NoNewPrivs):' /proc/self/status").stdout.split()
    assert status == ["NoNewPrivs:", "0", "Seccomp:", "2", "Seccomp_filters:", "1"], status
    got = _probe(ws)
    for name, err in got.items():
        if name == "clone3":
            assert err == errno.ENOSYS, "clone3 must fail with ENOSYS, so that glibc falls back to clone"
        elif name in DENIED:
            assert err == errno.EPERM, f"{name} gave errno {err}, not the filter's EPERM"
        else:
            assert err != errno.EPERM, f"{name} is allowed by Docker's profile"
    # Ordinary work still works: threads, pipes, a debugger, dropping to another user.
    r = run_ok(ws, "python3 -c 'import threading; t = threading.Thread(target=print, args=(1,)); t.start(); t.join()'"
               " && echo x | cat && strace -o /dev/null true && setpriv --reuid=65534 --clear-groups id -u")
    assert r.stdout.split() == ["1", "x", "65534"]


def _assert_own_cgroup_namespace(ws: Workspace) -> None:
    inside = run_ok(ws, "cat /proc/self/cgroup /proc/1/cgroup").stdout.splitlines()
    assert inside and all(line.endswith(":/") for line in inside), inside
    host = Path(f"/proc/{ws.init_pid}/cgroup").read_text()
    assert f"/bunshin/{ws.id}" in host, "the workspace's processes are in its own cgroups on the host"
    assert os.readlink(f"/proc/{ws.init_pid}/ns/cgroup") != os.readlink("/proc/self/ns/cgroup")


@pytest.mark.skipif(not seccomp_profile.available(), reason="needs python3-seccomp")
def test_default_profile_is_dockers() -> None:
    """The allow list is Docker's, rendered for Docker's capabilities without CAP_MKNOD: what
    Docker's profile gives to CAP_SYS_ADMIN and the other dropped capabilities is absent."""
    allowed = set(seccomp_profile.ALLOWED) | set(seccomp_profile.ALLOWED_X86_64_NUMBERS)
    for name in ("mount", "umount2", "unshare", "setns", "bpf", "keyctl", "add_key", "reboot", "init_module",
                 "kexec_load", "swapon", "settimeofday", "clock_settime", "acct", "perf_event_open",
                 "open_by_handle_at", "io_uring_setup", "userfaultfd", "clone3", "clone", "socket", "personality"):
        assert name not in allowed, name  # clone, socket, personality: only with argument rules
    for name in ("chroot", "ptrace", "arch_prctl", "process_vm_readv", "mseal", "listmount"):
        assert name in allowed, name
    assert len(seccomp_profile.bpf()) % 8 == 0 and len(seccomp_profile.bpf()) // 8 < 4096


def test_workspace_is_confined_and_privileged_opts_out() -> None:
    with Workspace.create() as ws:
        _assert_confined(ws)
        _assert_own_cgroup_namespace(ws)
    with Workspace.create(privileged=True) as ws:
        assert "Seccomp:\t0\n" in run_ok(ws, "cat /proc/self/status").stdout
        got = _probe(ws)
        assert got["unshare(CLONE_NEWUSER)"] == 0 and got["clone3"] != errno.ENOSYS
        _assert_own_cgroup_namespace(ws)


@pytest.mark.parametrize("memory", ["copy", COW])
def test_clones_keep_the_filter_and_the_cgroup_namespace(memory: str) -> None:
    """CRIU dumps the filtered tree (its parasite runs with the filter suspended) and restores
    the filter in every task; the cow engine injects clone and wait4 into filtered processes."""
    with Workspace.create() as ws:
        ws.commands.run("exec sleep 1000", background=True)
        with fork_of(ws, 2, memory) as clones:
            for w in (*clones, ws):
                pid = int(run_ok(w, "pgrep -x sleep").stdout)
                assert "Seccomp:\t2\n" in run_ok(w, f"cat /proc/{pid}/status").stdout
                _assert_confined(w)
                _assert_own_cgroup_namespace(w)
