"""Process subsystem: capture and rebuild a workspace's whole process tree with CRIU.

The tree is rooted at the workspace's init. CRIU restores it inside fresh pid, mount,
net, ipc and uts namespaces, so every pid, parent link, session and thread inside the
namespace is identical in each clone while host pids differ.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import criu

try:
    from pycriu.images import fdinfo_pb2  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - set-up installs pycriu into the venv
    fdinfo_pb2 = None

GHOST_LIMIT = 512 << 20  # deleted-but-open files up to this size travel inside the image
IMG_COMMON_MAGIC, FILES_MAGIC = 0x54564319, 0x56303138  # criu/include/magic.h
# An inotify watch is dumped by file handle; overlayfs cannot reopen handles of some of its
# files (a GTK editor watching the file it edits under /root), and CRIU's fallback then
# looks for the inode only under system paths (/etc, /var/log, ...). These are where a
# workspace's own files live.
IRMAP_SCAN_PATHS = ("/root", "/home", "/tmp", "/opt")


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
    opts.irmap_scan_paths.extend(IRMAP_SCAN_PATHS)
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
    roots = dict(cgroup_roots)
    for ctrl, path in roots.items():
        cr = opts.cg_root.add()
        if ctrl != "unified":
            cr.ctrl = ctrl
        elif len(roots) > 1:
            # Beside v1 controllers the cgroup2 hierarchy is named by the empty controller name
            # (CRIU's cgroup_contains); an unnamed root would move every v1 hierarchy too.
            cr.ctrl = ""
        cr.path = path
    return opts


def rearm_expired_timerfds(images: Path) -> int:
    """Make periodic timerfds keep firing in clones; returns how many entries were changed.

    The kernel stops a timerfd's hrtimer when it expires and re-arms a periodic one only when
    the ticks are read. CRIU dumps such a timer (expired, ticks unread) with it_value 0 and
    restores it with timerfd_settime(it_value=0), which disarms it: the clone reads the pending
    ticks once and the timer never fires again. Giving it one interval to its next expiry
    keeps the ticks and the period, and adds no expiration that has not happened.
    """
    path = images / "files.img"
    if fdinfo_pb2 is None or not path.exists():
        return 0
    data = path.read_bytes()
    if data[:8] != struct.pack("<II", IMG_COMMON_MAGIC, FILES_MAGIC):
        return 0  # not the image layout this parser knows: leave it alone
    head = pos = 8
    entries: list[bytes] = []
    changed = 0
    while pos < len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        raw = data[pos + 4:pos + 4 + size]
        pos += 4 + size
        fe = fdinfo_pb2.file_entry()
        fe.ParseFromString(raw)
        if fe.type == fdinfo_pb2.TIMERFD and fe.HasField("tfd"):
            t = fe.tfd
            # ticks > 0 tells "expired, unread" from "disarmed": settime() to zero clears ticks.
            if t.vsec == 0 and t.vnsec == 0 and (t.isec or t.insec) and t.ticks > 0:
                t.vsec, t.vnsec = t.isec, t.insec
                raw = fe.SerializeToString()
                changed += 1
        entries.append(raw)
    if changed:
        out = bytearray(data[:head])
        for raw in entries:
            out += struct.pack("<I", len(raw)) + raw
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(out)
        tmp.replace(path)
    return changed


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
