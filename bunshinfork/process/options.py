"""CRIU options for dumping a workspace's process tree and restoring it into a clone."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..spec import WorkspaceSpec
from . import criu

CLONE_NEWNET = 0x40000000

GHOST_LIMIT = 512 << 20  # deleted-but-open files up to this size travel inside the image
# An inotify watch is dumped by file handle; overlayfs cannot reopen handles of some of its
# files (a GTK editor watching the file it edits under /root), and CRIU's fallback then
# looks for the inode only under system paths (/etc, /var/log, ...). These are where a
# workspace's own files live.
IRMAP_SCAN_PATHS = ("/root", "/home", "/tmp", "/opt")


# A userns workspace's /dev nodes are the host's, bound in (mknod is refused in a user
# namespace), and its masked /proc files are binds of one of them (csrc/native.c: devices[]
# and proc_masked[]). CRIU cannot dump a bind whose source lies outside the namespace's root
# unless told it is external: each gets a key at dump, and the key names the host file to
# bind again at restore.
USERNS_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# The masked /proc files (directories are masked with a tmpfs of their own, which CRIU dumps).
PROC_MASKED = ("kcore", "keys", "timer_list", "timer_stats", "sched_debug", "latency_stats", "sysrq-trigger",
               "interrupts")
_EXTERNAL = {f"/dev/{d}": (f"bunshin-dev-{d}", f"/dev/{d}") for d in USERNS_DEVICES} | {
    f"/proc/{p}": (f"bunshin-mask-{p}", "/dev/null") for p in PROC_MASKED
}


def userns_dump_externals(init_pid: int) -> list[str]:
    """CRIU's `mnt[MOUNTPOINT]:KEY` for each of those binds the workspace's init has."""
    with open(f"/proc/{init_pid}/mountinfo") as f:
        points = {line.split()[4] for line in f}
    return [f"mnt[{mp}]:{key}" for mp, (key, _) in _EXTERNAL.items() if mp in points]


def userns_restore_externals() -> list[str]:
    """CRIU's `mnt[KEY]:HOST_PATH` for every key a dump may have given."""
    return [f"mnt[{key}]:{host}" for key, host in _EXTERNAL.values()]


def _common(opts: criu.rpc.criu_opts) -> None:
    opts.tcp_established = True
    opts.file_locks = True
    opts.network_lock = criu.rpc.NFTABLES
    opts.manage_cgroups = True
    opts.manage_cgroups_mode = criu.rpc.SOFT
    opts.log_level = 4


def fresh_net(spec: WorkspaceSpec) -> bool:
    """Whether a workspace's network namespace cannot differ from a new one with lo up (see
    restore_opts): without CAP_NET_ADMIN (and with a read-only /proc/sys) on network="none" it
    cannot change its own. Its dump then skips the namespace's contents and its clones' restore
    makes it anew; both read the same spec, the snapshot's."""
    return not spec.privileged and spec.network == "none"


def dump_opts(init_pid: int, images: Path, freezer: str, userns: bool = False, empty_net: bool = False,
              cgroup_yard: Path | None = None) -> criu.rpc.criu_opts:
    """Dump the tree rooted at `init_pid`, leaving it running; CRIU seizes it through the
    (already frozen) freezer cgroup so the tree never runs between freeze and dump.

    empty_net (fresh_net's workspaces): CRIU's --empty-ns net at dump too, which skips the
    namespace's links, addresses, routes, rules, iptables, nftables and sysctls (eight execs of
    `ip` and `iptables-save` and two libnftables walks: 18 ms of the frozen dump on this host)
    and, with CRIU patch 0008, its conntrack entries (20 ms): contents no restore of such a
    snapshot reads (restore_opts' fresh_net).

    cgroup_yard (cgyard.prepare_dump): where the source's cgroup hierarchies are already
    mounted, so that the dump mounts none of its own (ten mounts, 15 ms frozen here)."""
    opts = criu.new_opts()
    _common(opts)
    if userns:
        opts.external.extend(userns_dump_externals(init_pid))
    if empty_net:
        opts.empty_ns = CLONE_NEWNET
    if cgroup_yard is not None:
        opts.cgroup_yard = str(cgroup_yard)
    opts.images_dir = str(images)
    opts.pid = init_pid
    opts.leave_running = True
    # A connection whose handshake completed but that its server has not accepted yet is left
    # out: CRIU cannot restore one and refuses the whole dump otherwise, and a server under
    # load always has some (a fork of one failed one time in five to fifteen). The source keeps
    # it; a clone's client end of it, if inside the workspace, finds no peer and is reset, and a
    # paused workspace resumes without it (docs/network.md).
    opts.tcp_skip_in_flight = True
    opts.freeze_cgroup = freezer
    opts.ghost_limit = GHOST_LIMIT
    # A file from a lower layer deleted while open (an editor's swap file, pip, sqlite) has
    # st_nlink 1 through overlayfs, so CRIU takes it for a linked file and refuses unless
    # link remaps are allowed; with them it tries a link, then falls back to a ghost file.
    opts.link_remap = True
    opts.irmap_scan_paths.extend(IRMAP_SCAN_PATHS)
    opts.log_file = "dump.log"
    return opts


def restore_opts(images: Path, work_dir_fd: int, root: str, cgroup_roots: Iterable[tuple[str, str]],
                 fresh_net: bool = False, cgroup_yard: Path | None = None,
                 userns: bool = False) -> criu.rpc.criu_opts:
    """Restore into new namespaces with `root` as the mount namespace's root. rst_sibling makes
    the restored init our child rather than criu's, so it is reaped like a created init.

    fresh_net: the network namespace is made empty (CRIU's --empty-ns net) and its loopback
    brought up by the caller at setup-namespaces, instead of CRIU restoring links, addresses,
    routes, rules and tables by running `ip` and probing for `iptables-restore` (ten execs
    per clone: 12 ms on this host, most of the mount-and-network phase). Only for a namespace
    that cannot differ from a new one with lo up: a workspace without CAP_NET_ADMIN (and with
    a read-only /proc/sys) on network="none" cannot change its own.

    cgroup_yard: the snapshot's yard (cgyard.py), so that CRIU mounts no cgroup hierarchy.

    userns: the host files its external binds come from (userns_dump_externals)."""
    opts = criu.new_opts()
    _common(opts)
    if userns:
        opts.external.extend(userns_restore_externals())
    if fresh_net:
        opts.empty_ns = CLONE_NEWNET
    if cgroup_yard is not None:
        opts.cgroup_yard = str(cgroup_yard)
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
