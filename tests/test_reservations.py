"""A PROT_NONE reservation larger than RAM + swap (Chromium reserves its PartitionAlloc pools
so: one 32 GiB ---p VMA without "nr") forks from an incremental snapshot too.

Restoring images that have a parent, CRIU premaps every private VMA writable; without
MAP_NORESERVE (criu/patches/0004) a writable private mapping that large is refused under
heuristic overcommit: "Unable to map ANON_VMA: Cannot allocate memory"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fork_support import fork_of

from bunshinfork import Workspace
from bunshinfork.process import chain

pytestmark = pytest.mark.skipif(Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2",
                                reason="strict overcommit ignores MAP_NORESERVE: such a reservation "
                                       "cannot be restored writable there")

# Maps SIZE bytes PROT_NONE (private, anonymous, reserved: no MAP_NORESERVE) and waits.
RESERVE = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, int(sys.argv[1]), 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
open("/tmp/reservation", "w").write(hex(addr))
while True:
    time.sleep(3600)
"""
# The reservation as the workspace's process sees it: (size, perms) of the VMA at its address.
VMA = """
import json, os
addr = int(open("/tmp/reservation").read(), 16)
for d in filter(str.isdigit, os.listdir("/proc")):
    try:
        maps = open(f"/proc/{d}/maps").read().splitlines()
    except OSError:
        continue
    for line in maps:
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start == addr:
            print(json.dumps([end - start, perms]))
"""


def _beyond_commit() -> int:
    """More than RAM + swap, which heuristic overcommit refuses in one chargeable mapping."""
    lines = Path("/proc/meminfo").read_text().splitlines()
    kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines)}
    return ((kib["MemTotal"] + kib["SwapTotal"]) * 1024 * 2 + (1 << 30)) & ~((1 << 30) - 1)


def _vma(ws: Workspace) -> list[object]:
    ws.files.write("/tmp/vma.py", VMA)
    return json.loads(ws.commands.run("python3 /tmp/vma.py").stdout)


def test_a_reservation_beyond_ram_forks_from_an_incremental_snapshot() -> None:
    size = _beyond_commit()
    with Workspace.create() as ws:
        ws.files.write("/tmp/reserve.py", RESERVE)
        ws.commands.run(f"exec python3 /tmp/reserve.py {size}", background=True)
        ws.commands.run("for i in $(seq 100); do [ -s /tmp/reservation ] && exit 0; sleep 0.1; done; exit 1")
        assert _vma(ws) == [size, "---p"]
        full = ws.snapshot("copy")
        delta = ws.snapshot("copy")
        try:
            # The second one reads its unchanged pages from the first: CRIU premaps on restore.
            assert chain.external_parent(delta.dir) is not None
            with fork_of(delta) as (clone,):
                assert _vma(clone) == [size, "---p"]
                # and the clone's own incremental snapshot (what the tool-call cache keeps) forks too
                again = clone.snapshot("copy")
                try:
                    with fork_of(again) as (grandchild,):
                        assert _vma(grandchild) == [size, "---p"]
                finally:
                    again.release()
        finally:
            delta.release()
            full.release()
