"""`bunshin doctor`: what this host offers bunshinfork, and what to do about what it lacks.

Every check is cheap and side-effect free apart from `criu check`, and none raises: a
missing feature becomes a failed Check whose detail says how to get it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cgroups import cgroup as cgroups
from .errors import CgroupError

INIT_BINARY = Path(__file__).resolve().parent / "_bin" / "bunshin-init"
NAMESPACES = ("pid", "mnt", "net", "ipc", "uts")
# openat2 (5.6) is the newest syscall the core runtime cannot do without.
MIN_KERNEL = (5, 6)
CRIU_WANTED = (4, 2)
# sudo and cron often drop the sbin directories from PATH, where criu and mkfs.btrfs live.
SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool

    @property
    def level(self) -> str:
        if self.ok:
            return "OK"
        return "FAIL" if self.required else "WARN"


def _which(prog: str) -> str | None:
    found = shutil.which(prog)
    if found:
        return found
    for d in SBIN_DIRS:
        p = os.path.join(d, prog)
        if os.access(p, os.X_OK):
            return p
    return None


def _filesystems() -> set[str]:
    try:
        text = Path("/proc/filesystems").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in text.splitlines() if line.split()}


def _version_tuple(text: str) -> tuple[int, ...] | None:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def _one_line(text: str, limit: int = 200) -> str:
    """Multi-line tool output squeezed into one line of the report."""
    joined = "; ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


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


def check_namespaces() -> Check:
    missing = [ns for ns in NAMESPACES if not os.path.exists(f"/proc/self/ns/{ns}")]
    if missing:
        return Check("namespaces", False, f"missing {', '.join(missing)} namespace(s); the kernel lacks "
                     f"CONFIG_{'/'.join(m.upper() for m in missing)}_NS", required=True)
    return Check("namespaces", True, ", ".join(NAMESPACES), required=True)


def check_overlayfs() -> Check:
    if "overlay" in _filesystems():
        return Check("overlayfs", True, "overlay in /proc/filesystems", required=True)
    return Check("overlayfs", False, "overlay is not in /proc/filesystems; try 'modprobe overlay'",
                 required=True)


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
    root = cgroups.CGROUP_ROOT
    try:
        version = cgroups.detect(root)
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


def check_init_binary() -> Check:
    if os.access(INIT_BINARY, os.X_OK):
        return Check("bunshin-init", True, str(INIT_BINARY), required=True)
    return Check("bunshin-init", False, f"{INIT_BINARY} is missing or not executable; reinstall bunshin "
                 "(scripts/setup.sh)", required=True)


def check_native() -> Check:
    try:
        importlib.import_module("bunshinfork._native")
    except ImportError as e:
        return Check("native", False, f"bunshinfork._native does not load ({e}); reinstall bunshin "
                     "(scripts/setup.sh)", required=True)
    return Check("native", True, "bunshinfork._native loads", required=True)


def _criu_version_text(criu: str) -> str:
    proc = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=30)
    return proc.stdout + proc.stderr


def check_criu_version() -> Check:
    criu = _which("criu")
    if criu is None:
        return Check("criu", False, "criu is not installed; scripts/setup.sh builds 4.2.1", required=True)
    try:
        text = _criu_version_text(criu)
    except (OSError, subprocess.SubprocessError) as e:
        return Check("criu", False, f"{criu} --version failed: {e}", required=True)
    m = re.search(r"Version:\s*(\S+)", text)
    shown = m.group(1) if m else _one_line(text)
    v = _version_tuple(shown)
    if v is None:
        return Check("criu", False, f"{criu}: cannot tell its version from {shown!r}", required=True)
    if v[:2] == CRIU_WANTED:
        return Check("criu", True, f"{shown} ({criu})", required=True)
    if v[:2] > CRIU_WANTED:
        return Check("criu", True, f"{shown} ({criu}); newer than the tested 4.2.x", required=True)
    if v[0] < 4:
        why = "bookworm's 3.17 fails on this kernel's vDSO (vvar_vclock)"
    else:
        why = "4.1.x cannot dump TCP sockets on kernels >= 6.16"
    return Check("criu", False, f"{shown} ({criu}) is too old: needs 4.2.x; {why}; "
                 "scripts/setup.sh builds 4.2.1", required=True)


def check_criu_check() -> Check:
    criu = _which("criu")
    if criu is None:
        return Check("criu check", False, "criu is not installed", required=True)
    if os.geteuid() != 0:
        return Check("criu check", False, "criu check needs root", required=True)
    try:
        proc = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return Check("criu check", False, f"{criu} check failed to run: {e}", required=True)
    out = proc.stdout + proc.stderr
    if "Looks good." in out:
        return Check("criu check", True, "Looks good.", required=True)
    return Check("criu check", False, f"exit {proc.returncode}: {_one_line(out) or 'no output'}",
                 required=True)


def check_pycriu() -> Check:
    try:
        mod = importlib.import_module("pycriu")
    except Exception as e:  # protobuf version clashes surface as TypeError, not ImportError
        return Check("pycriu", False, f"pycriu does not import ({type(e).__name__}: {e}); scripts/setup.sh "
                     "installs it into the venv", required=True)
    return Check("pycriu", True, f"importable ({os.path.dirname(mod.__file__ or '?')})", required=True)


def check_ksm() -> Check:
    run_file = Path("/sys/kernel/mm/ksm/run")
    if not run_file.exists():
        return Check("ksm", False, "/sys/kernel/mm/ksm is absent (kernel without CONFIG_KSM)", required=False)
    try:
        run = run_file.read_text().strip()
    except OSError as e:
        run = f"unreadable ({e.strerror})"
    meaning = {"0": "stopped", "1": "running", "2": "unmerging"}.get(run, "")
    detail = f"run={run}" + (f" ({meaning})" if meaning else "")
    try:
        from .memory import ksm

        why = ksm.unavailable_reason()
    except ImportError as e:
        return Check("ksm", False, f"{detail}; cannot test PR_GET_MEMORY_MERGE: {e}", required=False)
    if why:
        return Check("ksm", False, f"{detail}; {why}, so memory='ksm' and ksm=True are unavailable",
                     required=False)
    return Check("ksm", True, f"{detail}; prctl(PR_GET_MEMORY_MERGE) works", required=False)


def check_userfaultfd() -> Check:
    # The sysctl exists exactly when the kernel was built with CONFIG_USERFAULTFD.
    sysctl = Path("/proc/sys/vm/unprivileged_userfaultfd")
    dev = Path("/dev/userfaultfd")
    if dev.exists():
        return Check("userfaultfd", True, "/dev/userfaultfd present", required=False)
    if sysctl.exists():
        with contextlib.suppress(OSError):
            return Check("userfaultfd", True, f"syscall available (unprivileged_userfaultfd="
                         f"{sysctl.read_text().strip()})", required=False)
        return Check("userfaultfd", True, "syscall available", required=False)
    return Check("userfaultfd", False, "not available (kernel without CONFIG_USERFAULTFD); CRIU lazy "
                 "restore cannot be used", required=False)


def check_cow_module() -> Check:
    if os.path.exists("/dev/bunshin"):
        return Check("/dev/bunshin", True, "copy-on-write kernel module loaded", required=False)
    from .memory import resolve

    return Check("/dev/bunshin", False, f'absent: memory="auto" will use {resolve("auto")}; build with '
                 "`make -C kernel` and insmod on hosts that can load modules", required=False)


def check_btrfs() -> Check:
    missing = []
    if "btrfs" not in _filesystems():
        missing.append("btrfs not in /proc/filesystems (try 'modprobe btrfs')")
    if _which("mkfs.btrfs") is None:
        missing.append("mkfs.btrfs missing (apt install btrfs-progs)")
    try:
        importlib.import_module("btrfsutil")
    except ImportError:
        missing.append("btrfsutil not importable (apt install python3-btrfsutil)")
    if missing:
        return Check("btrfs", False, "; ".join(missing) + "; layers fall back to plain directories",
                     required=False)
    return Check("btrfs", True, "kernel support, mkfs.btrfs and btrfsutil present", required=False)


CHECKS: tuple[Callable[[], Check], ...] = (
    check_kernel,
    check_root,
    check_namespaces,
    check_overlayfs,
    check_cgroups,
    check_native,
    check_init_binary,
    check_criu_version,
    check_criu_check,
    check_pycriu,
    check_ksm,
    check_userfaultfd,
    check_cow_module,
    check_btrfs,
)


def run_checks() -> list[Check]:
    """Run every check; a check that crashes is reported as failed rather than aborting the report."""
    out = []
    for fn in CHECKS:
        try:
            out.append(fn())
        except Exception as e:
            name = fn.__name__.removeprefix("check_")
            out.append(Check(name, False, f"check crashed: {type(e).__name__}: {e}", required=False))
    return out


def format_checks(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    return "\n".join(f"{c.level:<4}  {c.name:<{width}}  {c.detail}" for c in checks)


def failed_required(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.required and not c.ok]
