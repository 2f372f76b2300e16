"""Snapshot holders by syscall injection, on this host (no kernel module needed): the injected
fork's memory is a copy-on-write image of the process, and the process never notices."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bunshinfork import native
from bunshinfork.memory import holders

PROG = r"""
import ctypes, hashlib, os, signal, sys, time
chld = []
signal.signal(signal.SIGCHLD, lambda *a: chld.append(1))
size = 8 << 20
buf = bytearray(hashlib.shake_256(b"seed").digest(size))
addr = ctypes.addressof((ctypes.c_char * size).from_buffer(buf))
print(addr, size, hashlib.sha256(buf).hexdigest(), flush=True)
n = 0
for line in sys.stdin:
    if line.startswith("write"):
        buf[0:16] = b"changed-after-sn"
        print("ok", flush=True)
    elif line.startswith("report"):
        fds = sorted(os.listdir("/proc/self/fd"))
        kids = open(f"/proc/self/task/{os.getpid()}/children").read().split()
        print(len(chld), len(fds), len(kids), flush=True)
"""


@pytest.fixture
def proc():
    p = subprocess.Popen([sys.executable, "-c", PROG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    addr, size, digest = p.stdout.readline().split()
    yield p, int(addr), int(size), digest
    p.kill()
    p.wait()


def ask(p: subprocess.Popen, line: str) -> str:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return p.stdout.readline().strip()


def stop(pid: int) -> list[int]:
    tids = holders.seize_all([pid])
    holders.wait_all(tids)
    return tids


def test_injected_fork_images_memory_and_stays_invisible(proc):
    p, addr, size, digest = proc
    before = ask(p, "report")
    tids = stop(p.pid)
    try:
        (h,) = holders.take([p.pid], keep_processes=True)
        assert h.child > 0 and h.child != p.pid
        # The holder is stopped before its first instruction and traced by us.
        status = Path(f"/proc/{h.child}/status").read_text()
        assert "\nState:\tt (tracing stop)" in status
        assert f"\nTracerPid:\t{os.getpid()}\n" in status
        assert any(s <= addr < e for s, e, _ in h.maps)
    finally:
        holders.detach_all(tids)
    # The source runs on and writes; the holder keeps the image of the freeze.
    assert ask(p, "write") == "ok"
    import hashlib

    snap = h.read(addr, size)
    assert hashlib.sha256(snap).hexdigest() == digest
    assert h.read(addr, 16) != b"changed-after-sn"
    with open(f"/proc/{p.pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        assert f.read(16) == b"changed-after-sn"
    # Killing and reaping the holder inside its stopped parent leaves nothing behind.
    tids = stop(p.pid)
    try:
        child = h.child
        h.release()
        assert not Path(f"/proc/{child}").exists()
    finally:
        holders.detach_all(tids)
    time.sleep(0.05)
    assert ask(p, "report") == before  # no SIGCHLD seen, same fds, no children


def test_holder_has_the_code_the_process_has(proc):
    """The fork is injected as `syscall; int3` over the bytes at the process's instruction
    pointer; the holder's copy of that text must be the original code, not the stub."""
    p, _, _, _ = proc
    tids = stop(p.pid)
    try:
        (h,) = holders.take([p.pid], keep_processes=True)
        regs = Path(f"/proc/{p.pid}/syscall").read_text().split()
        rip = int(regs[-1], 16)
        with open(f"/proc/{p.pid}/mem", "rb", buffering=0) as f:
            f.seek(rip)
            want = f.read(16)
        assert h.read(rip, 16) == want
        assert want[:3] != bytes.fromhex("0f05cc")
    finally:
        try:
            h.release()
        finally:
            holders.detach_all(tids)


def test_holder_memory_is_shared_until_written(proc):
    p, addr, _, _ = proc
    tids = stop(p.pid)
    try:
        (h,) = holders.take([p.pid], keep_processes=True)
    finally:
        holders.detach_all(tids)
    try:
        # Same physical frames right after the fork: read PFNs from pagemap.
        def pfns(pid: int) -> list[int]:
            out = []
            with open(f"/proc/{pid}/pagemap", "rb") as f:
                for page in range(addr // 4096, addr // 4096 + 8):
                    f.seek(page * 8)
                    entry = int.from_bytes(f.read(8), "little")
                    assert entry >> 63, "page not present"
                    out.append(entry & ((1 << 55) - 1))
            return out

        assert pfns(p.pid) == pfns(h.child)
        ask(p, "write")
        after_src, after_holder = pfns(p.pid), pfns(h.child)
        # The written page was copied for the writer; the untouched ones are still shared.
        assert after_src[0] != after_holder[0]
        assert after_src[2:] == after_holder[2:]
    finally:
        tids = stop(p.pid)
        try:
            h.release()
        finally:
            holders.detach_all(tids)


def test_inject_into_unstopped_process_fails_cleanly(proc):
    p, *_ = proc
    with pytest.raises(OSError):
        native.inject_fork(p.pid)
    assert ask(p, "report").split()[2] == "0"
