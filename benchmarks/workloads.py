"""Workspace workloads shared by the benchmarks: a ~N MiB source spread over ~10 processes."""

from __future__ import annotations

import time

from bunshinfork import Workspace

# Runs inside the workspace (the host's /usr/bin/python3, stdlib only).
WORKER = r'''
import mmap, os, random, sys, time
kind, mib, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
content_seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
if kind == "heap":
    import signal
    rnd = random.Random(seed + 1000 * content_seed)
    # Distinct pseudo-random pages: nothing for the zero page or KSM to merge inside one process.
    heap = [bytearray(rnd.randbytes(1 << 20)) for _ in range(mib)]

    def scribble(_sig, _frame):
        # SIGUSR1: one byte in every page of the first quarter of the heap, then a marker file.
        for chunk in heap[: max(len(heap) // 4, 1)]:
            for off in range(0, len(chunk), 4096):
                chunk[off] ^= 0xFF
        open(f"/tmp/scribbled-{seed}", "a").write("x")

    cursor = [0]

    def dirty(_sig, _frame):
        # SIGUSR2: one byte in each of the next N pages (N read from a file), then a marker file.
        n, per_chunk = int(open("/tmp/dirty-pages").read()), len(heap[0]) // 4096
        for k in range(n):
            i = (cursor[0] + k) % (len(heap) * per_chunk)
            chunk, off = heap[i // per_chunk], (i % per_chunk) * 4096
            chunk[off] = (chunk[off] + 1) & 0xFF
        cursor[0] += n
        open(f"/tmp/dirtied-{seed}", "a").write("x")

    signal.signal(signal.SIGUSR1, scribble)
    signal.signal(signal.SIGUSR2, dirty)
elif kind == "file":
    # File-backed pages from the shared read-only lower layer: one page cache for every clone.
    maps, left = [], mib << 20
    for root, _, files in os.walk("/usr/lib"):
        for f in sorted(files):
            p = os.path.join(root, f)
            try:
                if os.path.islink(p) or os.path.getsize(p) < (1 << 20):
                    continue
                with open(p, "rb") as fh:
                    m = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                continue
            for off in range(0, len(m), 4096):
                m[off]
            maps.append(m)
            left -= len(m)
            if left <= 0:
                break
        if left <= 0:
            break
open(f"/tmp/ready-{kind}-{seed}", "w").close()
while True:
    time.sleep(3600)
'''

SERVER = (
    "cd /tmp && python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & "
    "for i in $(seq 50); do python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/')\" "
    "2>/dev/null && break; sleep 0.1; done"
)


def heap_mib_per_proc(size_mib: int, heap_procs: int = 8) -> int:
    return max((size_mib - max(size_mib // 8, 1)) // heap_procs, 1)


def _signal_heaps(ws: Workspace, signal: str, marker: str, heap_procs: int, timeout: float) -> None:
    """Signal every heap worker and wait until each has appended to its marker file."""
    def rounds(i: int) -> int:
        path = f"/tmp/{marker}-{i}"
        return len(str(ws.files.read(path))) if ws.files.exists(path) else 0

    before = {i: rounds(i) for i in range(heap_procs)}
    ws.commands.run(f"pkill -{signal} -f 'worker.py heap'", timeout=30)
    deadline = time.monotonic() + timeout
    for i, n in before.items():
        while rounds(i) <= n:
            if time.monotonic() > deadline:
                raise TimeoutError("heap workers did not write their pages")
            time.sleep(0.05)


def scribble(ws: Workspace, heap_procs: int = 8, timeout: float = 300) -> int:
    """Have every heap worker write a quarter of its pages; returns the bytes written."""
    _signal_heaps(ws, "USR1", "scribbled", heap_procs, timeout)
    mib = int(str(ws.files.read("/root/heap-mib")))
    return heap_procs * max(mib // 4, 1) << 20


def dirty(ws: Workspace, mib: float, heap_procs: int = 8, timeout: float = 300) -> int:
    """Have the heap workers write one byte in `mib` MiB of pages they did not write last time,
    spread evenly; returns the bytes of pages dirtied."""
    per_worker = max(int(mib * 256) // heap_procs, 1)
    ws.files.write("/tmp/dirty-pages", str(per_worker))
    _signal_heaps(ws, "USR2", "dirtied", heap_procs, timeout)
    return per_worker * heap_procs * 4096


def populate(ws: Workspace, size_mib: int, heap_procs: int = 8, seed: int = 0) -> int:
    """Start the mixed workload (seed: its heaps' pseudo-random content); returns the number of
    worker processes started."""
    ws.files.write("/root/worker.py", WORKER)
    file_mib = max(size_mib // 8, 1)
    heap_mib = heap_mib_per_proc(size_mib, heap_procs)
    ws.files.write("/root/heap-mib", str(heap_mib))
    for i in range(heap_procs):
        ws.commands.run(f"python3 /root/worker.py heap {heap_mib} {i} {seed}", background=True)
    ws.commands.run(f"python3 /root/worker.py file {file_mib} 0", background=True)
    ws.commands.run(SERVER, timeout=30)
    deadline = time.monotonic() + 300
    want = [f"/tmp/ready-heap-{i}" for i in range(heap_procs)] + ["/tmp/ready-file-0"]
    while not all(ws.files.exists(p) for p in want):
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark workload did not come up within 300 s")
        time.sleep(0.2)
    return heap_procs + 2
