"""Late pages: a large source's anonymous memory written into its images after it resumes.

Where the kernel tracks no dirty pages, CRIU writes every page with the source frozen (0.6 s
for 1 GiB here). For a source with at least min_bytes() of anonymous memory, the dump writes
none of it (criu/patches/0001), and while the tree is still frozen a fork is injected into
each process (holders.py: a copy-on-write image of the process as dumped, which never runs an
instruction and of which its parent hears nothing: a few hundred microseconds, where reading
even a small process's pages and images costs milliseconds). Then the source resumes, each
holder's pages are merged into its process's pagemap and pages images, and the holder is killed
and reaped inside its parent (whose leader thread alone stops for that one injected wait4). The
images are then what CRIU's own dump writes (present and swapped pages, never the shared zero
page, none of MADV_WIPEONFORK or MAP_DROPPABLE memory), and any image engine restores them.

Not taken where a pre-dump already shortens the freeze (dirty tracking), for a workspace its
user paused, where a memory limit leaves no room for a second copy of the held memory (the
source may rewrite all of it while its holders live), or a pids limit no room for the holders.
A process with MADV_DONTFORK memory (a fork would not copy it) is read while frozen.
Each holder counts against the pids limit and shows in `ps` until its pages are written.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..cgroups import Cgroup
from ..contract import Capture, Captured
from ..errors import ForkError
from ..native import ffi, lib
from ..process import criu, pages
from . import cow, holders
from .materialize import SPECIAL, TASK_SIZE, VMA_ANON_PRIVATE

MIN_ENV = "BUNSHIN_LATE_PAGES_MIN_MB"  # a number of MiB, or "off"
# Below it the freeze saves less than the slower write after the thaw costs the fork (docs/benchmarks.md).
DEFAULT_MIN = 256 << 20
KEY = "late"  # Captured.held: the holders, from the dump until their pages are written

PAGE, PE_PRESENT = pages.PAGE, pages.PE_PRESENT
# criu/include/image.h: a private anonymous VMA whose pages CRIU writes, less the areas it skips.
VMA_AREA_REGULAR, VMA_AREA_GUARD = 1 << 0, 1 << 16
SKIPPED = SPECIAL | VMA_AREA_GUARD  # vsyscall, vDSO, vvar, guard
MAP_DROPPABLE = 0x08
MADV_DONTFORK, MADV_WIPEONFORK = 10, 18
CHUNK = 1 << 20  # bytes per read of memory or old pages
PART = 16 << 20  # bytes per task of a reader thread
READERS = max(1, min(4, os.cpu_count() or 1))
SCAN = 1 << 14  # pagemap entries per read


def min_bytes() -> int | None:
    """The anonymous memory from which a dump writes its pages late; None: never."""
    v = os.environ.get(MIN_ENV, "").strip()
    if not v:
        return DEFAULT_MIN
    if v == "off":
        return None
    return int(float(v) * (1 << 20))


def rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _room(cg: Cgroup, held: int, n: int) -> bool:
    """Whether the workspace's limits hold a second copy of `held` bytes and `n` more processes."""
    limit = cg.memory_limit()
    if limit is not None and limit - cg.memory_usage() < held:
        return False
    pids_dir = cg.paths.get("pids") or cg.freezer_dir
    try:
        mx = (Path(pids_dir) / "pids.max").read_text().strip()
        cur = int((Path(pids_dir) / "pids.current").read_text())
    except FileNotFoundError:
        return True
    return mx == "max" or int(mx) - cur >= n


def plan(c: Capture) -> None:
    """The source still runs: decide whether its dump writes the anonymous pages late."""
    threshold = min_bytes()
    if threshold is None or not c.images_hold_memory or criu.dirty_tracking():
        return
    assert c.source.cgroups is not None
    cg = Cgroup(c.source.cgroups)
    if cg.frozen():
        return
    anon = {pid: rss_anon(pid) for pid in cg.pids()}
    if sum(anon.values()) < threshold:
        return
    if not _room(cg, sum(anon.values()), len(anon)):
        return
    c.dump_env.update(cow.DUMP_ENV)
    c.after_dump.append(lambda: _hold(c, cg))


def _hold(c: Capture, cg: Cgroup) -> None:
    """After the dump, still frozen: a holder for each process; the pages of one with
    MADV_DONTFORK memory, which its fork would not have, are read now."""
    images = c.snap.images
    pids = cg.pids()  # frozen: the same list for the holders below
    by_ns = {holders.ns_pid(pid): pid for pid in pids}
    vmas: dict[int, list[dict]] = {}  # decoded once, for the writes after the thaw too
    hold: list[int] = []
    written = 0
    with c.stage("late_frozen"):
        for mm in sorted(images.glob("mm-*.img")):
            ns = int(mm.stem.split("-")[1])
            host = by_ns.get(ns)
            if host is None:
                raise ForkError(f"dumped process {ns} is not in the workspace's cgroup")
            vmas[ns] = _vmas(images, ns)
            if not any(_madv(v) & (1 << MADV_DONTFORK) for v in vmas[ns]):
                hold.append(host)
                continue
            try:
                written += write(images, ns, host, vmas[ns])
            except (OSError, ValueError) as e:
                raise ForkError(f"reading the memory of dumped process {ns} failed: {e}") from e
    with c.stage("holders"):
        c.snap.held[KEY] = holders.capture_tree(pids, cg.freeze, cg.thaw, until=c.until, hold=hold,
                                                keep_processes=True)
    c.criu["late_frozen_pages"] = written
    # First of what runs after the thaw: every later step reads complete images.
    c.after_thaw.insert(0, lambda: _finish(c, vmas))


def _finish(c: Capture, vmas: dict[int, list[dict]]) -> None:
    """The source runs again: each holder's pages into its images, then the holder ends."""
    hs: dict[int, holders.Holder] = c.snap.held.pop(KEY, {})
    try:
        with c.stage("late_pages"):
            c.criu["late_pages"] = sum(write(c.snap.images, ns, h.child, vmas[ns]) for ns, h in hs.items())
    except BaseException as e:
        with contextlib.suppress(Exception):  # the write's error is the one to report
            _end(hs)
        if isinstance(e, (OSError, ValueError)):
            raise ForkError(f"writing the snapshot's memory after the thaw failed: {e}") from e
        raise
    _end(hs)


def release(snap: Captured) -> None:
    """A capture that failed between the dump and _finish: its holders end."""
    _end(snap.held.pop(KEY, {}))


def _end(hs: dict[int, holders.Holder]) -> None:
    errors = []
    for h in hs.values():
        try:
            h.release_running()
        except Exception as e:  # every holder gets its chance to end
            errors.append(e)
    if errors:
        raise ForkError(f"ending the snapshot's memory holders failed ({len(errors)} of {len(hs)}): "
                        f"{errors[0]}") from errors[0]


def _vmas(images: Path, ns: int) -> list[dict]:
    return pages.load_image(images / f"mm-{ns}.img")["entries"][0]["vmas"]


def _madv(v: dict) -> int:
    return int(v.get("madv", 0))  # pycriu leaves an unset field out


def _dumped(v: dict) -> bool:
    """Whether CRIU's own dump writes this VMA's pages, and its bunshin patches left them out."""
    st = v["status"]
    return (st & VMA_AREA_REGULAR and st & VMA_ANON_PRIVATE and not st & SKIPPED and v["end"] <= TASK_SIZE
            and not v["flags"] & MAP_DROPPABLE and not _madv(v) & (1 << MADV_WIPEONFORK))


_zero_pfn: int | None = None


def zero_pfn() -> int:
    """The shared zero page's frame, as /proc/PID/pagemap shows it to root: read-faulted
    anonymous memory maps it, and CRIU writes no such page."""
    global _zero_pfn
    if _zero_pfn is None:
        import mmap

        m = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            m.read_byte()  # a read fault maps the zero page
            view = ctypes.c_char.from_buffer(m)
            addr = ctypes.addressof(view)
            del view
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                e = int.from_bytes(os.pread(f.fileno(), 8, addr // PAGE * 8), "little")
        finally:
            m.close()
        _zero_pfn = e & ((1 << 55) - 1)
    return _zero_pfn


@dataclass(frozen=True)
class _Run:
    vaddr: int
    n: int
    flags: int
    old: int  # offset of its data in the old pages image; -1: none (not present); -2: memory


def _present(pagemap_fd: int, start: int, end: int, zero: int) -> list[_Run]:
    """Runs of [start, end) that a dump writes, from the process's pagemap."""
    out: list[_Run] = []
    first = start // PAGE
    total = (end - start) // PAGE
    buf = ffi.new("uint64_t[]", 2 * (SCAN // 2 + 1))
    done = 0
    while done < total:
        n = min(SCAN, total - done)
        raw = os.pread(pagemap_fd, n * 8, (first + done) * 8)
        if len(raw) != n * 8:
            raise ValueError(f"short pagemap read at {hex((first + done) * PAGE)}")
        nr = lib.bn_pagemap_runs(ffi.from_buffer("uint64_t[]", raw), n, zero, buf, SCAN // 2 + 1)
        for i in range(nr):
            va = (first + done + buf[2 * i]) * PAGE
            k = int(buf[2 * i + 1])
            if out and out[-1].vaddr + out[-1].n * PAGE == va:
                out[-1] = _Run(out[-1].vaddr, out[-1].n + k, PE_PRESENT, -2)
            else:
                out.append(_Run(va, k, PE_PRESENT, -2))
        done += n
    return out


def write(images: Path, ns: int, pid: int, vmas: list[dict]) -> int:
    """Merge the anonymous pages CRIU left out of process `ns`'s images (its VMAs: `vmas`), read
    from `pid` (the process itself, frozen, or its holder), into them; returns the pages written."""
    pm_path = images / f"pagemap-{ns}.img"
    pagemap = pages.load_image(pm_path)
    head, *entries = pagemap["entries"]
    pages_path = images / f"pages-{head['pages_id']}.img"
    runs: list[_Run] = []
    off = 0
    for e in entries:
        present = e["flags"] & PE_PRESENT
        runs.append(_Run(e["vaddr"], e["nr_pages"], e["flags"], off if present else -1))
        off += e["nr_pages"] * PAGE if present else 0
    zero = zero_pfn()
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pmf:
        new = [r for v in vmas if _dumped(v) for r in _present(pmf.fileno(), v["start"], v["end"], zero)]
    if not new:
        return 0
    runs = sorted([*runs, *new], key=lambda r: r.vaddr)
    for a, b in itertools.pairwise(runs):
        if a.vaddr + a.n * PAGE > b.vaddr:
            raise ValueError(f"process {ns}: pages at {hex(b.vaddr)} are in its images already")
    tmp_pages = pages_path.with_name(pages_path.name + ".late")
    _copy(runs, tmp_pages, pages_path, pid, ns)
    pagemap["entries"] = [head, *({"vaddr": r.vaddr, "compat_nr_pages": 0, "flags": r.flags, "nr_pages": r.n}
                                  for r in runs)]
    os.replace(tmp_pages, pages_path)
    pages.dump_image(pagemap, pm_path)
    return sum(r.n for r in new)


def _copy(runs: list[_Run], dest: Path, old_pages: Path, pid: int, ns: int) -> None:
    """The pages image for `runs`, each read from the old image or from process `pid`'s memory.
    /proc/PID/mem, never process_vm_readv: its pins would unshare every page the holder shares
    with the running source. Reading it is a page-by-page walk in the kernel (about 1.5 GB/s on
    one core here), so the reads are spread over the cores, each writing its own range."""
    parts: list[tuple[bool, int, int, int]] = []  # (from memory, source offset, dest offset, bytes)
    at = 0
    for r in runs:
        if r.old == -1:
            continue
        src = r.vaddr if r.old == -2 else r.old
        size = r.n * PAGE
        for off in range(0, size, PART):
            parts.append((r.old == -2, src + off, at + off, min(PART, size - off)))
        at += size
    local = threading.local()
    with open(dest, "w+b", buffering=0) as out, open(old_pages, "rb", buffering=0) as old, \
            open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        out.truncate(at)

        def one(part: tuple[bool, int, int, int]) -> None:
            from_mem, pos, to, left = part
            if not hasattr(local, "view"):
                local.view = memoryview(bytearray(CHUNK))
            view, fd = local.view, mem.fileno() if from_mem else old.fileno()
            while left:
                got = os.preadv(fd, [view[:min(CHUNK, left)]], pos)
                if got <= 0:
                    raise ValueError(f"process {ns}: short read of its pages at {hex(pos)}")
                os.pwrite(out.fileno(), view[:got], to)
                pos, to, left = pos + got, to + got, left - got

        with ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="bunshin-late") as pool:
            for _ in pool.map(one, parts):
                pass
