"""Workspace workloads shared by the benchmarks: a ~N MiB source spread over ~10 processes."""

from __future__ import annotations

import time

from bunshinfork import Workspace

# Runs inside the workspace (the host's /usr/bin/python3, stdlib only).
WORKER = r'''
import mmap, os, random, sys, time
kind, mib, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if kind == "heap":
    import signal
    rnd = random.Random(seed)
    # Distinct pseudo-random pages: nothing for the zero page or KSM to merge inside one process.
    heap = [bytearray(rnd.randbytes(1 << 20)) for _ in range(mib)]

    def scribble(_sig, _frame):
        # SIGUSR1: one byte in every page of the first quarter of the heap, then a marker file.
        for chunk in heap[: max(len(heap) // 4, 1)]:
            for off in range(0, len(chunk), 4096):
                chunk[off] ^= 0xFF
        open(f"/tmp/scribbled-{seed}", "a").write("x")

    signal.signal(signal.SIGUSR1, scribble)
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


def scribble(ws: Workspace, heap_procs: int = 8, timeout: float = 300) -> int:
    """Have every heap worker write a quarter of its pages; returns the bytes written."""
    rounds = {i: len(str(ws.files.read(f"/tmp/scribbled-{i}"))) if ws.files.exists(f"/tmp/scribbled-{i}") else 0
              for i in range(heap_procs)}
    ws.commands.run("pkill -USR1 -f 'worker.py heap'", timeout=30)
    deadline = time.monotonic() + timeout
    for i, n in rounds.items():
        path = f"/tmp/scribbled-{i}"
        while not (ws.files.exists(path) and len(str(ws.files.read(path))) > n):
            if time.monotonic() > deadline:
                raise TimeoutError("heap workers did not write their pages")
            time.sleep(0.1)
    mib = int(str(ws.files.read("/root/heap-mib")))
    return heap_procs * max(mib // 4, 1) << 20


def populate(ws: Workspace, size_mib: int, heap_procs: int = 8) -> int:
    """Start the mixed workload; returns the number of worker processes started."""
    ws.files.write("/root/worker.py", WORKER)
    file_mib = max(size_mib // 8, 1)
    heap_mib = heap_mib_per_proc(size_mib, heap_procs)
    ws.files.write("/root/heap-mib", str(heap_mib))
    for i in range(heap_procs):
        ws.commands.run(f"python3 /root/worker.py heap {heap_mib} {i}", background=True)
    ws.commands.run(f"python3 /root/worker.py file {file_mib} 0", background=True)
    ws.commands.run(SERVER, timeout=30)
    deadline = time.monotonic() + 300
    want = [f"/tmp/ready-heap-{i}" for i in range(heap_procs)] + ["/tmp/ready-file-0"]
    while not all(ws.files.exists(p) for p in want):
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark workload did not come up within 300 s")
        time.sleep(0.2)
    return heap_procs + 2
