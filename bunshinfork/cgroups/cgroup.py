"""One cgroup per workspace: freezer, memory accounting and limits, pids limit.

Two layouts: this machine's cgroup v1 controllers (one directory per controller)
and a unified cgroup v2 hierarchy. Both are driven through the same small API.

Both layouts freeze with cgroup v2's freezer (`cgroup.freeze`, every cgroup2 hierarchy has
it, with or without controllers): on a v1 host the workspace also gets a directory in the
cgroup2 hierarchy (systemd's hybrid `unified` mount, mounted there when missing). The v1
freezer cannot be used to checkpoint: it parks tasks in the refrigerator, and PTRACE_SEIZE of
a task that was also job-control stopped waits for that task to leave the refrigerator
(ptrace_attach waits for JOBCTL_TRAPPING to clear, which only the tracee can do), so CRIU
would wait forever for a thaw it is to do itself. The v2 freezer parks tasks in a signal-stop
trap that a ptrace interrupt breaks into.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import time
from pathlib import Path

from .. import native
from ..errors import CgroupError
from ..host import HOST
from ..state import CgroupState
from .devices import restrict as restrict_devices

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = HOST.cgroup_parent
V1_CONTROLLERS = ("memory", "pids")
CPU = "cpu"  # a v1 hierarchy of its own: every workspace joins it, a quota only with a CPU limit
CFS_PERIOD_US = 100_000  # the kernel's default period; the quota is cores times it
UNIFIED = "unified"  # where systemd's hybrid layout mounts the cgroup2 hierarchy under CGROUP_ROOT


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value!r} to {path}: {e.strerror}") from e


def _events_frozen(fd: int) -> bool:
    try:
        return b"frozen 1" in os.pread(fd, 4096, 0)
    except OSError as e:
        raise CgroupError(f"cannot read cgroup.events: {e.strerror}") from e


def _is_cgroup2(path: Path) -> bool:
    return (path / "cgroup.controllers").exists()


def unified_root(root: Path) -> Path:
    """The cgroup2 hierarchy beside a v1 layout: `root/unified`, mounted there if it is not."""
    d = root / UNIFIED
    if _is_cgroup2(d):
        return d
    try:
        d.mkdir(exist_ok=True)
        native.mount("cgroup2", str(d), "cgroup2")
    except OSError as e:
        raise CgroupError(f"no cgroup2 hierarchy at {d} to freeze workspaces with, and mounting one failed: {e}"
                          ) from e
    return d


def cgroup2_root(root: Path) -> Path:
    """The cgroup2 hierarchy workspaces freeze with: `root` itself on a v2 host, else unified_root."""
    return root if _is_cgroup2(root) else unified_root(root)


def detect(root: Path = CGROUP_ROOT) -> str:
    """'v2' on a pure cgroup v2 host, 'v1' where the v1 controllers we need are mounted."""
    if _is_cgroup2(root):
        return "v2"
    if all((root / c).is_dir() for c in V1_CONTROLLERS):
        return "v1"
    raise CgroupError(
        f"no usable cgroup hierarchy under {root}: need cgroup v2, or v1 with {', '.join(V1_CONTROLLERS)}"
    )


class Cgroup:
    """A workspace's cgroup, driven from its recorded state. `paths` maps a controller (or
    'unified') to its directory."""

    def __init__(self, state: CgroupState) -> None:
        self.state = state

    @property
    def version(self) -> str:
        return self.state.version

    @property
    def paths(self) -> dict[str, str]:
        return self.state.paths

    @classmethod
    def create(
        cls,
        name: str,
        memory_limit: int | None = None,
        pids_limit: int | None = None,
        version: str = "auto",
        root: Path | None = None,
        devices: bool = False,
        cpu_limit: float | None = None,
    ) -> Cgroup:
        """`devices`: admit only the standard nodes (devices.py) to its tasks. `cpu_limit`: the
        CPU time its tasks get together, in cores (CFS bandwidth: a quota per 100 ms period)."""
        # Looked up at call time, so a test or an embedding program can point CGROUP_ROOT elsewhere.
        root = CGROUP_ROOT if root is None else root
        version = detect(root) if version == "auto" else version
        # Check the layout before creating anything: on a v1 host, /sys/fs/cgroup is a plain tmpfs
        # where a "v2" parent directory would be created as a stray, useless directory.
        if version == "v2" and not _is_cgroup2(root):
            raise CgroupError(f"{root} is not a cgroup v2 hierarchy; use cgroup='auto' or 'v1' on this host")
        if version == "v1" and not all((root / c).is_dir() for c in V1_CONTROLLERS + ((CPU,) if cpu_limit else ())):
            raise CgroupError(
                f"{root} lacks the cgroup v1 controllers {', '.join(V1_CONTROLLERS)}; "
                "use cgroup='auto' or 'v2'"
            )
        cg = cls(CgroupState(version=version, paths={}))
        try:
            if version == "v1":
                for ctrl in V1_CONTROLLERS:
                    d = root / ctrl / PARENT / name
                    d.mkdir(parents=True, exist_ok=False)
                    cg.paths[ctrl] = str(d)
                if memory_limit is not None:
                    _write(Path(cg.paths["memory"]) / "memory.limit_in_bytes", str(memory_limit))
                if pids_limit is not None:
                    _write(Path(cg.paths["pids"]) / "pids.max", str(pids_limit))
                # Every workspace has a cpu directory where the hierarchy exists, a limit or not:
                # CRIU's dump records the whole subtree of a task's cgroup, so a task left in the
                # hierarchy's root recorded every other workspace's cpu directory, and its restore
                # made them again after those workspaces were gone (and named them to the clone).
                if cpu_limit is not None or (root / CPU).is_dir():
                    d = root / CPU / PARENT / name
                    d.mkdir(parents=True, exist_ok=False)
                    cg.paths[CPU] = str(d)
                if cpu_limit is not None:
                    _write(d / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                    _write(d / "cpu.cfs_quota_us", str(_quota(cpu_limit)))
                d = unified_root(root) / PARENT / name
                d.mkdir(parents=True, exist_ok=False)
                cg.paths[UNIFIED] = str(d)
            elif version == "v2":
                parent = root / PARENT
                parent.mkdir(exist_ok=True)
                wanted = [c for c, v in (("memory", memory_limit), ("pids", pids_limit), (CPU, cpu_limit))
                          if v is not None]
                available = (root / "cgroup.controllers").read_text().split()
                missing = [c for c in wanted if c not in available]
                if missing:
                    raise CgroupError(
                        f"cgroup v2 at {root} does not offer the {', '.join(missing)} controller(s) that the "
                        "requested limits need (they may be bound to a v1 hierarchy); drop the limits or "
                        "use the v1 layout"
                    )
                # A limit needs its controller; accounting wants them even without one (as podman
                # and Docker enable them): without memory, memory.stat is absent and the host-cost
                # accounting would read a workspace as costing nothing. Best effort when no limit asked.
                for c in (*V1_CONTROLLERS, *((CPU,) if cpu_limit is not None else ())):
                    if c not in available:
                        continue
                    with contextlib.nullcontext() if c in wanted else contextlib.suppress(CgroupError):
                        _write(root / "cgroup.subtree_control", f"+{c}")
                        _write(parent / "cgroup.subtree_control", f"+{c}")
                d = parent / name
                d.mkdir(exist_ok=False)
                cg.paths[UNIFIED] = str(d)
                if memory_limit is not None:
                    _write(d / "memory.max", str(memory_limit))
                    _write(d / "memory.swap.max", "0")
                if pids_limit is not None:
                    _write(d / "pids.max", str(pids_limit))
                if cpu_limit is not None:
                    _write(d / "cpu.max", f"{_quota(cpu_limit)} {CFS_PERIOD_US}")
            else:
                raise CgroupError(f"unknown cgroup version {version!r}; use 'auto', 'v1' or 'v2'")
            if devices:
                # Before any task is in it: a created init, or CRIU's restored tree.
                restrict_devices(cg.paths[UNIFIED])
        except FileExistsError as e:
            cg.remove()
            raise CgroupError(f"cgroup {e.filename} already exists; run 'bunshin gc'") from e
        except OSError as e:
            cg.remove()
            raise CgroupError(f"cannot create cgroup {name}: {e}") from e
        except CgroupError:
            cg.remove()
            raise
        return cg

    def _dirs(self) -> list[Path]:
        return [Path(p) for p in self.paths.values()]

    def add(self, pid: int) -> None:
        for d in self._dirs():
            _write(d / "cgroup.procs", str(pid))

    @property
    def freezer_dir(self) -> str:
        """The cgroup2 directory whose cgroup.freeze stops the workspace (CRIU's freeze_cgroup)."""
        return self.paths[UNIFIED]

    def pids(self) -> list[int]:
        d = Path(self.freezer_dir)
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def freeze(self, timeout: float = 10.0) -> None:
        self._set_frozen(True, timeout)

    def thaw(self, timeout: float = 10.0) -> None:
        self._set_frozen(False, timeout)

    def frozen(self) -> bool:
        events = (Path(self.freezer_dir) / "cgroup.events").read_text()
        return "frozen 1" in events

    def _set_frozen(self, frozen: bool, timeout: float) -> None:
        d = Path(self.freezer_dir)
        # cgroup.events wakes a poller (POLLPRI) when its "frozen" line changes: a freeze is
        # seen the moment it completes (every fork's source waits on it), not at the next of a
        # 2 ms sleep's polls. Opened before the write, so no change can come before the watch.
        try:
            events = os.open(d / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise CgroupError(f"cannot open {d / 'cgroup.events'}: {e.strerror}") from e
        try:
            watch = select.poll()
            watch.register(events, select.POLLPRI)
            _write(d / "cgroup.freeze", "1" if frozen else "0")
            deadline = time.monotonic() + timeout
            while _events_frozen(events) != frozen:
                left = deadline - time.monotonic()
                if left <= 0:
                    # Never leave a half-frozen workspace behind a failed freeze.
                    if frozen:
                        with contextlib.suppress(CgroupError):
                            _write(d / "cgroup.freeze", "0")
                    raise CgroupError(f"{d} did not {'freeze' if frozen else 'thaw'} within {timeout}s")
                # Bounded, so that a missed wake-up costs 10 ms, never the deadline.
                watch.poll(max(1, min(10, int(left * 1000))))
        finally:
            os.close(events)

    def memory_usage(self) -> int:
        if self.version == "v1":
            return int((Path(self.paths["memory"]) / "memory.usage_in_bytes").read_text())
        p = Path(self.paths["unified"]) / "memory.current"
        return int(p.read_text()) if p.exists() else 0

    def memory_limit(self) -> int | None:
        if self.version == "v1":
            v = int((Path(self.paths["memory"]) / "memory.limit_in_bytes").read_text())
            return None if v >= 1 << 62 else v
        p = Path(self.paths["unified"]) / "memory.max"
        if not p.exists():
            return None
        v = p.read_text().strip()
        return None if v == "max" else int(v)

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed inside this workspace."""
        if self.version == "v1":
            text = (Path(self.paths["memory"]) / "memory.oom_control").read_text()
        else:
            p = Path(self.paths["unified"]) / "memory.events"
            text = p.read_text() if p.exists() else ""
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def remove(self, timeout: float = 10.0) -> None:
        """Remove every directory; the kernel refuses while dying tasks linger, so retry."""
        deadline = time.monotonic() + timeout
        for d in self._dirs():
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise CgroupError(f"cannot remove cgroup {d}: {e.strerror}") from e
                    time.sleep(0.01)

    def exists(self) -> bool:
        return any(d.exists() for d in self._dirs())

    def hierarchy_paths(self) -> list[tuple[str, str]]:
        """(controller, path relative to its hierarchy's root): where CRIU puts restored tasks."""
        return [(ctrl, "/" + os.path.relpath(p, _mount_point(Path(p)))) for ctrl, p in self.paths.items()]


def _quota(cores: float) -> int:
    # 1 ms per period is the kernel's floor for a quota.
    return max(1000, round(cores * CFS_PERIOD_US))


def _mount_point(path: Path) -> Path:
    p = path
    while p.parent != p:
        if os.path.ismount(p):
            return p
        p = p.parent
    raise CgroupError(f"cgroup {path} is on no cgroup mount")


def leftover_cgroups(root: Path = CGROUP_ROOT, parent: str | None = None) -> list[str]:
    """Every workspace cgroup directory currently present under this host's parent, or
    `parent` (another host's; used by gc and the leak checks)."""
    out: list[str] = []
    p = parent or PARENT
    candidates = [root / p] if _is_cgroup2(root) else [root / c / p for c in (*V1_CONTROLLERS, CPU)]
    candidates.append(root / UNIFIED / p)
    for parent in candidates:
        with contextlib.suppress(FileNotFoundError):
            out.extend(str(parent / n) for n in sorted(os.listdir(parent)) if (parent / n).is_dir())
    return out
