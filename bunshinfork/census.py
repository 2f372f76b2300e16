"""What bunshin holds on the host, by kind: the leak count of the soak benchmark (compared
before a run and after its gc) and of the test suite's leak check.

Each probe returns a set of names, so that two censuses subtract: what is in the later one
only is what was left behind. Byte counts (tmpfs, layers) are single-element sets of their
total, which subtract to the new total whenever it changed; `leaks()` turns them back into
the growth in bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from . import state
from .cgroups import leftover_cgroups
from .cgroups.watchdog import LOG_NAME
from .fs import btrfs, quota, store
from .fs.btrfs import btrfsutil
from .memory import ksm
from .network import clones, egress, leftover_interfaces, nat, ports, proxies

INIT_COMMS = ("bunshin-init", "init")


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def mounts() -> set[str]:
    """Workspace mount points: those under a ws- directory and bunshin's overlays."""
    out = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4]
        if "/ws-" in mp or ("overlay" in line.split(" - ")[1] and "bunshin" in line):
            out.add(mp)
    return out


def _is_bunshin_init(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return exe.endswith("/.bunshin/init") or "bunshin-init" in exe


def init_processes() -> set[int]:
    """Workspace inits (and freeze watchdogs, which are the same binary)."""
    return {p for p in _pids() if _read(f"/proc/{p}/comm").strip() in INIT_COMMS and _is_bunshin_init(p)}


def processes() -> set[str]:
    """Every process bunshin started or confines: inits and watchdogs, CRIU, and anything in a
    workspace cgroup (a holder, a workspace's own processes), as "pid comm"."""
    out = set()
    for p in _pids():
        comm = _read(f"/proc/{p}/comm").strip()
        if not comm:
            continue
        if (comm == "criu" or (comm in INIT_COMMS and _is_bunshin_init(p))
                or "/bunshin/ws-" in _read(f"/proc/{p}/cgroup")):
            out.add(f"{p} {comm}")
    return out


def interfaces() -> set[str]:
    """Host ends of workspace veths."""
    return set(leftover_interfaces())


def net_namespaces() -> set[str]:
    """Network namespaces: the distinct ones processes are in, and those pinned in /run/netns."""
    out = {f"/run/netns/{n}" for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])}
    for p in _pids():
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/{p}/ns/net"))
    return out


def nft_rules() -> set[str]:
    """The rules of bunshin's nftables tables: NAT, clones' links, egress policies."""
    if not nat.nft_available():
        return set()
    rules = [*nat.nat_rules(), *clones.table_rules()]
    return {json.dumps(r, sort_keys=True) for r in rules} | egress.all_rules()


def ip_rules() -> set[str]:
    """The clones' policy-routing rules."""
    return clones.leftover_rules()


def published_ports() -> set[str]:
    """Published-port forwarders listening in this process."""
    return ports.active()


def egress_proxies() -> set[str]:
    """Domain-rule egress proxies running on this machine, as "pid ws"."""
    return {f"{pid} {ws}" for pid, ws in proxies.running().items()}


def loop_devices() -> set[str]:
    """Every attached loop device, with its backing file."""
    out = set()
    for d in Path("/sys/block").glob("loop*"):
        backing = _read(str(d / "loop" / "backing_file")).strip()
        if backing:
            out.add(f"{d.name} {backing}")
    return out


def store_loops() -> set[str]:
    return set(btrfs.loop_devices_for(str(store.IMAGE)))


def host_fds() -> set[str]:
    """Descriptors any process holds on bunshin's state, layers or snapshot device, as
    "pid fd target" (the watchdog log and lock files excluded: they are opened per call)."""
    out = set()
    roots = (str(state.RUN_ROOT), str(store.STORE), "/dev/bunshin", "bunshin-snapshot")
    for p in _pids():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{p}/fd/{fd}")
                    if any(r in target for r in roots) and not target.endswith((LOG_NAME, ".lock")):
                        out.add(f"{p} {fd} {target}")
    return out


def cow_holders() -> set[str]:
    """Open snapshot descriptors of the bunshin module (what keeps a cow snapshot's pages)."""
    return {f for f in host_fds() if "/dev/bunshin" in f or "bunshin-snapshot" in f}


def tmpfs_bytes() -> int:
    """Bytes of files on the state root's tmpfs, less the watchdog's append-only log."""
    log = state.RUN_ROOT / LOG_NAME
    size = log.stat().st_size if log.exists() else 0
    return state.tree_bytes(state.RUN_ROOT) - size if state.RUN_ROOT.is_dir() else 0


def layer_bytes() -> int:
    """Bytes of files in the layer store and in the tmpfs layer fallback."""
    return sum(state.tree_bytes(r) for r in (store.STORE, store.fallback_root()) if r.is_dir())


def subvolumes() -> set[str]:
    if not store.mounted():
        return set()
    with contextlib.suppress(btrfsutil.BtrfsUtilError):
        return {p for p, _ in btrfsutil.SubvolumeIterator(str(store.STORE))}
    return set()


def qgroups() -> set[str]:
    """The layer store's qgroups whose subvolume is gone (those of live subvolumes are counted as
    subvolumes; none while its quotas are disabled)."""
    return set(quota.stale(store.STORE)) if store.mounted() else set()


def ksm_boost_holders() -> set[str]:
    try:
        return set(json.loads(ksm.BOOST_PATH.read_text()).get("holders", {}))
    except (FileNotFoundError, ValueError):
        return set()


def ws_dirs() -> set[str]:
    return set(state.all_ids())


def paused_states() -> set[str]:
    """Saved states of workspaces paused to disk (their records are state dirs)."""
    root = state.PAUSED_ROOT
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


PROBES: dict[str, Callable[[], set]] = {
    "mounts": mounts,
    "cgroups": lambda: set(leftover_cgroups()),
    "state dirs": ws_dirs,
    "paused states": paused_states,
    "loop devices": loop_devices,
    "network namespaces": net_namespaces,
    "veths": interfaces,
    "nft rules": nft_rules,
    "ip rules": ip_rules,
    "published ports": published_ports,
    "egress proxies": egress_proxies,
    "processes": processes,
    "host fds": host_fds,
    "tmpfs bytes": lambda: {tmpfs_bytes()},
    "layer bytes": lambda: {layer_bytes()},
    "subvolumes": subvolumes,
    "qgroups": qgroups,
    "KSM boost holders": ksm_boost_holders,
    "cow holders": cow_holders,
}
BYTES = ("tmpfs bytes", "layer bytes")


def take() -> dict[str, set]:
    return {name: probe() for name, probe in PROBES.items()}


def leaks(before: dict[str, set], after: dict[str, set]) -> dict[str, int]:
    """Per kind, how many things (bytes for the byte counts) `after` holds that `before` did not."""
    out = {}
    for k in PROBES:
        if k in BYTES:
            out[k] = max(0, next(iter(after[k])) - next(iter(before[k])))
        else:
            out[k] = len(after[k] - before[k])
    return out
