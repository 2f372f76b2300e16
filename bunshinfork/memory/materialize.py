"""Turn a cow snapshot's images into complete CRIU images, reading memory from its holders.

A cow dump writes no pages for anonymous private VMAs (the holders keep them). A durable
save must not depend on descriptors that die with this process, so those pages are read
from the holders (pread on the snapshot descriptor, never process_vm_readv) and merged into
each process's pagemap and pages images, which then restore with any engine.
"""

from __future__ import annotations

from pathlib import Path

from ..process import pages
from .holders import Holder

try:
    import pycriu.images as criu_images  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - set-up installs pycriu into the venv
    criu_images = None

PAGE = 4096
PE_PRESENT = 4
PROT_READ = 1
VMA_ANON_PRIVATE = 1 << 9
VMA_AREA_VSYSCALL = 1 << 2
VMA_AREA_VDSO = 1 << 3
VMA_AREA_VVAR = 1 << 12
# Kernel-provided mappings: never dumped, always supplied by the kernel on restore.
SPECIAL = VMA_AREA_VSYSCALL | VMA_AREA_VDSO | VMA_AREA_VVAR
TASK_SIZE = 1 << 47
CHUNK = 256  # pages per pread


def _existing_pages(images: Path, pagemap: dict) -> list[tuple[int, int, bytes | None]]:
    """(vaddr, nr_pages, data or None for non-present entries) in pagemap order."""
    head, *entries = pagemap["entries"]
    out = []
    with open(images / f"pages-{head['pages_id']}.img", "rb") as f:
        for e in entries:
            n = e["nr_pages"]
            data = f.read(n * PAGE) if e["flags"] & PE_PRESENT else None
            out.append((e["vaddr"], n, data))
    return out


def _holder_pages(h: Holder, start: int, end: int) -> list[tuple[int, int, bytes]]:
    """Runs of non-zero pages of [start, end) in the snapshot; untouched memory restores as zeros."""
    runs: list[tuple[int, list[bytes]]] = []
    zero = bytes(PAGE)
    addr = start
    while addr < end:
        size = min(CHUNK * PAGE, end - addr)
        data = h.read(addr, size)
        for off in range(0, len(data), PAGE):
            page = data[off:off + PAGE]
            if page == zero:
                continue
            va = addr + off
            if runs and runs[-1][0] + len(runs[-1][1]) * PAGE == va:
                runs[-1][1].append(page)
            else:
                runs.append((va, [page]))
        addr += size
    return [(va, len(pages), b"".join(pages)) for va, pages in runs]


def complete_images(src: Path, dest: Path, holders_by_ns_pid: dict[int, Holder]) -> None:
    """Copy the image directory `src` to `dest` with every holder's anonymous pages merged in."""
    if criu_images is None:
        raise RuntimeError("pycriu is not importable; run scripts/setup.sh")
    pages.flatten(src, dest)  # the written pages of file mappings may be in a parent's images
    for mm_path in sorted(dest.glob("mm-*.img")):
        pid = int(mm_path.stem.split("-")[1])
        h = holders_by_ns_pid.get(pid)
        if h is None:
            continue
        vmas = pages.load_image(mm_path)["entries"][0]["vmas"]
        pagemap_path = dest / f"pagemap-{pid}.img"
        pagemap = pages.load_image(pagemap_path)
        merged = _existing_pages(dest, pagemap)
        for v in vmas:
            st = v["status"]
            # PROT_NONE ranges are reservations (malloc arenas, guard pages): nothing to read.
            if st & VMA_ANON_PRIVATE and not st & SPECIAL and v["end"] <= TASK_SIZE and v["prot"] & PROT_READ:
                merged += _holder_pages(h, v["start"], v["end"])
        merged.sort(key=lambda r: r[0])
        head = pagemap["entries"][0]
        entries = [head]
        with open(dest / f"pages-{head['pages_id']}.img", "wb") as f:
            for vaddr, n, data in merged:
                flags = PE_PRESENT if data is not None else 0
                entries.append({"vaddr": vaddr, "compat_nr_pages": 0, "flags": flags, "nr_pages": n})
                if data is not None:
                    f.write(data)
        pagemap["entries"] = entries
        pages.dump_image(pagemap, pagemap_path)
