"""Incremental snapshot images: pages stored as a delta against a parent's, in CRIU's own format.

A pagemap entry flagged PE_PARENT (CRIU's in_parent) says "these pages are the parent
images' ones": CRIU's restore reads them through the `parent` link (chain.py), as it does for
its own pre-dump chains. Where the kernel tracks dirty pages CRIU writes such entries itself
(--track-mem with a parent); elsewhere it writes every page, and dedupe() turns the pages equal
to what the parent chain holds at the same address of the same process into PE_PARENT entries,
once the source has resumed. Equality of content is what makes this right whatever the pages'
history (a clone's first snapshot against the one it was forked from, a process that exited
and a new one with its pid): restore reads back exactly the bytes compared. flatten() writes
the complete images a durable save needs.
"""

from __future__ import annotations

import bisect
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..native import ffi, lib
from . import chain
from .images import PAGEMAP_PREFIX, PAGES_PREFIX

try:
    import pycriu.images as criu_images  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - set-up installs pycriu into the venv
    criu_images = None

PAGE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4  # criu/include/pagemap.h


@dataclass(frozen=True)
class Run:
    """Pages [vaddr, vaddr + n * PAGE) of one process lie in file `src` of a _Files at `offset`."""

    vaddr: int
    n: int
    src: int
    offset: int
    flags: int

    @property
    def end(self) -> int:
        return self.vaddr + self.n * PAGE


class _Runs:
    """The runs of one pagemap through its chain, sorted by address."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs
        self._starts = [r.vaddr for r in runs]

    def clip(self, vaddr: int, n: int) -> list[Run]:
        """The parts of the runs inside [vaddr, vaddr + n pages)."""
        end = vaddr + n * PAGE
        i = max(bisect.bisect_right(self._starts, vaddr) - 1, 0)
        out = []
        while i < len(self.runs) and self.runs[i].vaddr < end:
            r = self.runs[i]
            lo, hi = max(r.vaddr, vaddr), min(r.end, end)
            if lo < hi:
                out.append(Run(lo, (hi - lo) // PAGE, r.src, r.offset + lo - r.vaddr, r.flags))
            i += 1
        return out


class _Files:
    """Page files mapped read-only, each once, with a C pointer for comparisons."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self._index: dict[Path, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._ptrs: dict[int, object] = {}

    def index(self, path: Path) -> int:
        if path not in self._index:
            self._index[path] = len(self.paths)
            self.paths.append(path)
        return self._index[path]

    def map(self, i: int) -> mmap.mmap:
        if i not in self._maps:
            with open(self.paths[i], "rb") as f:
                self._maps[i] = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        return self._maps[i]

    def ptr(self, i: int) -> object:
        if i not in self._ptrs:
            self._ptrs[i] = ffi.from_buffer("unsigned char[]", self.map(i))
        return self._ptrs[i]

    def close(self) -> None:
        for p in self._ptrs.values():
            ffi.release(p)
        for m in self._maps.values():
            m.close()
        self._ptrs.clear()
        self._maps.clear()


def load_image(path: Path) -> dict:
    """A CRIU image, decoded by pycriu."""
    if criu_images is None:
        raise RuntimeError("pycriu is not importable; run scripts/setup.sh")
    with open(path, "rb") as f:
        return criu_images.load(f)


def dump_image(img: dict, path: Path) -> None:
    """Write a CRIU image whole or not at all (a temporary file renamed over `path`)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        criu_images.dump(img, f)
    os.replace(tmp, path)


def pagemaps(images: Path) -> list[str]:
    """The pagemap images of a directory: one per process (pagemap-PID) and per shared memory
    object (pagemap-shmem-ID); a parent's pagemap of the same name describes the same memory."""
    return sorted(p.name for p in images.glob(f"{PAGEMAP_PREFIX}*.img"))


def _pages_file(images: Path, pagemap: dict) -> Path:
    return images / f"{PAGES_PREFIX}{pagemap['entries'][0]['pages_id']}.img"


IN_STOP = -1  # Run.src of pages that lie in the level a resolution stops at


def _resolve(images: Path | None, name: str, files: _Files, stop: Path | None = None, level: int = 0) -> list[Run]:
    """Where every page `name` lists in `images` lies, following PE_PARENT entries down its chain;
    pages it reads from `stop` (a level of that chain) are runs with src IN_STOP."""
    if images is None or not (images / name).exists() or level > chain.MAX_DEPTH:
        return []
    pm = load_image(images / name)
    src = files.index(_pages_file(images, pm))
    out: list[Run] = []
    off = 0
    below: _Runs | None = None
    parent = chain.parent_images(images)
    for e in pm["entries"][1:]:
        va, n, flags = e["vaddr"], e["nr_pages"], e.get("flags", PE_PRESENT)
        if flags & PE_PRESENT:
            out.append(Run(va, n, src, off, flags))
            off += n * PAGE
        elif flags & PE_PARENT:
            if stop is not None and parent == stop:
                out.append(Run(va, n, IN_STOP, 0, PE_PARENT))
                continue
            if below is None:
                below = _Runs(_resolve(parent, name, files, stop, level + 1))
            out.extend(below.clip(va, n))
    return out


@dataclass(frozen=True)
class Dedup:
    pages_written: int  # pages the dump wrote
    pages_kept: int  # of those, pages that differ from the parent's and stay in this image
    pages_in_parent: int  # pages the image now reads from its parent (CRIU's and dedupe's)


def dedupe(images: Path) -> Dedup:
    """Store only the pages of `images` that differ from its parent chain's (chain.parent_images);
    the others become PE_PARENT entries. Entries CRIU already wrote as PE_PARENT stay."""
    parent = chain.parent_images(images)
    total = [0, 0, 0]
    files = _Files()
    try:
        for name in pagemaps(images):
            for i, n in enumerate(_dedupe_one(images, name, _Runs(_resolve(parent, name, files)), files)):
                total[i] += n
    finally:
        files.close()
    return Dedup(*total)


class _Writer:
    """A new pagemap's entries and the page data they keep, merged where contiguous."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.chunks: list[list[int]] = []  # [offset, length] in the old pages file

    def add(self, vaddr: int, n: int, flags: int, data_off: int | None = None) -> None:
        last = self.entries[-1] if self.entries else None
        if last is not None and last["flags"] == flags and last["vaddr"] + last["nr_pages"] * PAGE == vaddr:
            last["nr_pages"] += n
        else:
            self.entries.append({"vaddr": vaddr, "compat_nr_pages": 0, "flags": flags, "nr_pages": n})
        if data_off is not None:
            if self.chunks and sum(self.chunks[-1]) == data_off:
                self.chunks[-1][1] += n * PAGE
            else:
                self.chunks.append([data_off, n * PAGE])


def _in_parent(entries: list[dict]) -> int:
    return sum(e["nr_pages"] for e in entries if e.get("flags", PE_PRESENT) & PE_PARENT)


def _dedupe_one(images: Path, name: str, parent: _Runs, files: _Files) -> tuple[int, int, int]:
    path = images / name
    pm = load_image(path)
    pages_path = _pages_file(images, pm)
    entries = pm["entries"][1:]
    written = sum(e["nr_pages"] for e in entries if e.get("flags", PE_PRESENT) & PE_PRESENT)
    if not parent.runs or written == 0:
        return written, written, _in_parent(entries)
    me = files.index(pages_path)
    mine = files.ptr(me)
    out = _Writer()
    off = 0
    for e in entries:
        va, n, flags = e["vaddr"], e["nr_pages"], e.get("flags", PE_PRESENT)
        if not flags & PE_PRESENT:
            out.add(va, n, flags)
            continue
        cursor = va
        for r in parent.clip(va, n):
            if r.vaddr > cursor:  # not in the parent: keep
                out.add(cursor, (r.vaddr - cursor) // PAGE, flags, off + cursor - va)
            eq = ffi.new("unsigned char[]", r.n)
            lib.bn_pages_equal(mine + off + (r.vaddr - va), files.ptr(r.src) + r.offset, r.n, PAGE, eq)  # type: ignore[operator]
            same = bytes(ffi.buffer(eq))
            i = 0
            while i < r.n:
                j = same.find(b"\x00" if same[i] else b"\x01", i)
                j = r.n if j < 0 else j
                at = r.vaddr + i * PAGE
                if same[i]:
                    out.add(at, j - i, PE_PARENT)
                else:
                    out.add(at, j - i, flags, off + at - va)
                i = j
            cursor = r.end
        if cursor < va + n * PAGE:
            out.add(cursor, (va + n * PAGE - cursor) // PAGE, flags, off + cursor - va)
        off += n * PAGE
    kept = sum(length for _, length in out.chunks) // PAGE
    if kept == written:
        return written, kept, _in_parent(entries)
    src = files.map(me)
    tmp = pages_path.with_name(pages_path.name + ".tmp")
    with open(tmp, "wb") as f:
        for start, length in out.chunks:
            f.write(src[start:start + length])
    pm["entries"] = [pm["entries"][0], *out.entries]
    # The pagemap names the new page file's layout: both are replaced before anything restores.
    os.replace(tmp, pages_path)
    dump_image(pm, path)
    return written, kept, _in_parent(out.entries)


def squash(images: Path, dest: Path, until: Path | None = None) -> None:
    """`images` as one level at the new directory `dest`: every page its chain holds for it is
    written into dest's own page files, except those it reads from the level `until`, which
    stay PE_PARENT entries (dest then needs `until` as its parent). dest gets no parent link."""
    dest.mkdir()
    names = set(pagemaps(images))
    page_files = set()
    files = _Files()
    try:
        for name in names:
            pm = load_image(images / name)
            page_files.add(_pages_file(images, pm).name)
            out = _Writer()
            with open(_pages_file(dest, pm), "wb") as f:
                for r in _resolve(images, name, files, stop=until):
                    if r.src == IN_STOP:
                        out.add(r.vaddr, r.n, PE_PARENT)
                        continue
                    out.add(r.vaddr, r.n, r.flags & ~PE_PARENT)
                    m = files.map(r.src)
                    f.write(m[r.offset:r.offset + r.n * PAGE])
            pm["entries"] = [pm["entries"][0], *out.entries]
            dump_image(pm, dest / name)
    finally:
        files.close()
    for entry in os.scandir(images):
        if entry.name in names or entry.name in page_files or entry.name == chain.PARENT:
            continue
        if entry.is_file(follow_symlinks=False):
            shutil.copy2(entry.path, dest / entry.name)


def flatten(images: Path, dest: Path) -> None:
    """Complete images of `images` at the new directory `dest`, reading nothing from another."""
    squash(images, dest, until=None)
