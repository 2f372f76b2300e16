"""What a workspace, a snapshot or a fork family costs the host in memory: defined once, here.

PSS is not that cost. It splits the pages processes map among them and counts nothing no process
maps: the files of a workspace's tmpfs mounts (/tmp, /dev/shm), the page cache of what it reads
and writes, a layer or a snapshot's images kept in memory. HostMemory counts what the host
pays, by kind:

- anon: anonymous memory (heaps, stacks) charged to the workspace's cgroup;
- shmem: tmpfs and shared memory charged to it: its /tmp and /dev/shm, memfds, SysV segments,
  and its private layer where the storage keeps layers in memory;
- page_cache: file pages charged to it (not shmem): what its processes read or wrote through
  the page cache. The kernel charges a page to the cgroup that first faults it in, so a page a
  fork family shares is charged to one member (to the parent cgroup once that member is gone);
- kernel: kernel memory charged to it (slab, page tables, kernel stacks, socket buffers);
- stores: what snapshots keep in memory: CRIU images and frozen layers on a tmpfs, and the pages
  only a cow snapshot's holders still map.

of_cgroup() is one workspace (Workspace.memory().host), of_snapshot() one snapshot
(Snapshot.host_memory()), family() a set of workspaces and snapshots with each frozen layer they
share counted once (bunshinfork.host_memory(workspaces, snapshots)), and host() the same kinds
host-wide from /proc/meminfo: a benchmark reports the difference of two host() readings as what
a configuration cost the host.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import memory as engines
from .cgroups import Cgroup
from .contract import Captured
from .fs.store import TMPFS_MAGIC, fs_magic
from .state import CgroupState, FsState, Record


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory, by kind (see the module's docstring)."""

    anon: int = 0
    shmem: int = 0
    page_cache: int = 0
    kernel: int = 0
    stores: int = 0

    @property
    def total(self) -> int:
        return self.anon + self.shmem + self.page_cache + self.kernel + self.stores

    def __add__(self, other: HostMemory) -> HostMemory:
        return HostMemory(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                                   strict=True)))

    def __sub__(self, other: HostMemory) -> HostMemory:
        return HostMemory(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other),
                                                   strict=True)))

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def _stat_file(path: Path) -> dict[str, int]:
    """A memory.stat's counters; none where the hierarchy has no memory controller."""
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def of_cgroup(cg: CgroupState) -> HostMemory:
    """What the kernel charges a workspace's cgroup, by kind."""
    if cg.version == "v1":
        d = Path(cg.paths["memory"])
        st = _stat_file(d / "memory.stat")
        kmem = d / "memory.kmem.usage_in_bytes"
        shmem = st.get("total_shmem", 0)
        return HostMemory(anon=st.get("total_rss", 0), shmem=shmem,
                          page_cache=st.get("total_cache", 0) - shmem,
                          kernel=int(kmem.read_text()) if kmem.exists() else 0)
    st = _stat_file(Path(cg.paths["unified"]) / "memory.stat")
    kernel = st["kernel"] if "kernel" in st else \
        sum(st.get(k, 0) for k in ("kernel_stack", "pagetables", "slab", "sock", "percpu"))
    return HostMemory(anon=st.get("anon", 0), shmem=st.get("shmem", 0),
                      page_cache=st.get("file", 0) - st.get("shmem", 0), kernel=kernel)


def host() -> HostMemory:
    """The same kinds host-wide (/proc/meminfo); stores are within its shmem and anon."""
    m = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        m[k] = int(v.split()[0]) * 1024
    return HostMemory(anon=m["AnonPages"], shmem=m["Shmem"],
                      page_cache=m["Cached"] + m["Buffers"] - m["Shmem"],
                      kernel=m["Slab"] + m["KernelStack"] + m["PageTables"])


def in_memory_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes the files under `path` occupy in memory: those on a tmpfs (by allocated blocks, so a
    sparse image counts what it holds), none on a disk."""
    if fs_magic(Path(path)) != TMPFS_MAGIC:
        return 0
    total = 0
    dev = os.lstat(path).st_dev
    for dirpath, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.st_dev == dev:
                total += st.st_blocks * 512
    return total


def _frozen_paths(fs: FsState | None) -> set[str]:
    if fs is None:
        return set()
    return {lay.path for lay in (fs.layer, *fs.lowers) if lay is not None}


def of_snapshot(snap: Captured, layers: bool = True) -> HostMemory:
    """What a snapshot keeps in memory: its images on the state root's tmpfs, its frozen layer
    where that is in memory (`layers`), and a cow snapshot's pages only its holders map."""
    stores = in_memory_bytes(snap.dir) + engines.held_bytes(snap)
    fs = snap.meta.fs
    if layers and fs is not None and fs.layer is not None and not Path(fs.layer.path).is_relative_to(snap.dir):
        stores += in_memory_bytes(fs.layer.path)
    return HostMemory(stores=stores)


def family(workspaces: Iterable[Record], snapshots: Iterable[Captured] = ()) -> HostMemory:
    """Workspaces and snapshots together: each one's charges, and each frozen layer any of them
    stacks or holds counted once."""
    total = HostMemory()
    shared: set[str] = set()
    for rec in workspaces:
        if rec.cgroups is not None and Cgroup(rec.cgroups).exists():
            total += of_cgroup(rec.cgroups)
        if rec.fs is not None:
            shared |= {lay.path for lay in rec.fs.lowers}
    for snap in snapshots:
        total += of_snapshot(snap, layers=False)
        shared |= _frozen_paths(snap.meta.fs)
    return total + HostMemory(stores=sum(in_memory_bytes(p) for p in sorted(shared) if os.path.exists(p)))
