"""Process subsystem: capture and rebuild a workspace's whole process tree with CRIU.

The tree is rooted at the workspace's init. CRIU restores it inside fresh pid, mount,
net, ipc and uts namespaces, so every pid, parent link, session and thread inside the
namespace is identical in each clone while host pids differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import criu

GHOST_LIMIT = 512 << 20  # deleted-but-open files up to this size travel inside the image


def _common(opts: criu.rpc.criu_opts) -> None:
    opts.tcp_established = True
    opts.file_locks = True
    opts.network_lock = criu.rpc.NFTABLES
    opts.manage_cgroups = True
    opts.manage_cgroups_mode = criu.rpc.SOFT
    opts.log_level = 4


def dump_opts(init_pid: int, images: Path, freezer: str) -> criu.rpc.criu_opts:
    """Dump the tree rooted at `init_pid`, leaving it running; CRIU seizes it through the
    (already frozen) freezer cgroup so the tree never runs between freeze and dump."""
    opts = criu.new_opts()
    _common(opts)
    opts.images_dir = str(images)
    opts.pid = init_pid
    opts.leave_running = True
    opts.freeze_cgroup = freezer
    opts.ghost_limit = GHOST_LIMIT
    opts.log_file = "dump.log"
    return opts


def restore_opts(images: Path, work_dir_fd: int, root: str, cgroup_roots: Iterable[tuple[str, str]]
                 ) -> criu.rpc.criu_opts:
    """Restore into new namespaces with `root` as the mount namespace's root. rst_sibling makes
    the restored init our child rather than criu's, so it is reaped like a created init."""
    opts = criu.new_opts()
    _common(opts)
    opts.images_dir = str(images)
    opts.work_dir_fd = work_dir_fd
    opts.root = root
    opts.rst_sibling = True
    opts.log_file = "restore.log"
    for ctrl, path in cgroup_roots:
        cr = opts.cg_root.add()
        if ctrl != "unified":
            cr.ctrl = ctrl
        cr.path = path
    return opts


@dataclass(frozen=True)
class ProcInfo:
    """One task of a workspace as seen inside its pid namespace."""

    pid: int
    ppid: int
    sid: int
    pgid: int
    threads: int
    comm: str
    host_pid: int


def _ns_ids(host_pid: int) -> dict[str, int]:
    status = Path(f"/proc/{host_pid}/status").read_text()
    out: dict[str, int] = {}
    for line in status.splitlines():
        key, _, val = line.partition(":")
        if key in ("NSpid", "NSsid", "NSpgid"):
            out[key] = int(val.split()[-1])
        elif key in ("PPid", "Threads"):
            out[key] = int(val.split()[0])
    return out


def tree(host_pids: Iterable[int]) -> list[ProcInfo]:
    """Namespace-relative pid, ppid, sid, pgid and thread count of each task, sorted by pid."""
    hp = sorted(host_pids)
    ns_of = {}
    info = {}
    for p in hp:
        try:
            info[p] = _ns_ids(p)
            info[p]["comm"] = Path(f"/proc/{p}/comm").read_text().strip()  # type: ignore[assignment]
        except (FileNotFoundError, ProcessLookupError):
            continue
        ns_of[p] = info[p]["NSpid"]
    out = []
    for p, i in info.items():
        # The init's parent lives outside the namespace: its ppid there is 0.
        ppid = ns_of.get(i["PPid"], 0)
        out.append(ProcInfo(i["NSpid"], ppid, i["NSsid"], i["NSpgid"], i["Threads"], str(i["comm"]), p))
    return sorted(out, key=lambda x: x.pid)
