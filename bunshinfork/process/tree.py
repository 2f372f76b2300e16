"""A workspace's process tree as seen inside its pid namespace."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


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
            ids = _ns_ids(p)
            ids["comm"] = Path(f"/proc/{p}/comm").read_text().strip()  # type: ignore[assignment]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile: between its status and its comm, too
        info[p] = ids
        ns_of[p] = info[p]["NSpid"]
    out = []
    for p, i in info.items():
        # The init's parent lives outside the namespace: its ppid there is 0.
        ppid = ns_of.get(i["PPid"], 0)
        out.append(ProcInfo(i["NSpid"], ppid, i["NSsid"], i["NSpgid"], i["Threads"], str(i["comm"]), p))
    return sorted(out, key=lambda x: x.pid)
