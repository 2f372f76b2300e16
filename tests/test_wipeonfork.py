"""Wipe-on-fork memory has fork()'s semantics on every engine: a MADV_WIPEONFORK mapping, and a
MAP_DROPPABLE one (Linux 6.11+, which is wipe-on-fork too), is empty in every clone, whether
forked live, from a retained snapshot or from a saved and loaded one, and keeps its contents in
the source; the clone's mapping keeps its flags, so the clone's own forks wipe it too. The vDSO's
getrandom() state and userspace RNGs keep their state in such mappings so that a forked child
does not repeat its parent's random stream. copy and ksm restore CRIU images, whose dumps skip
these pages (criu/patches/0005); the cow module skips the VMAs (kernel/bunshin.c)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fork_support import COW, forked
from helpers import wait_for

from bunshinfork import Snapshot, Workspace
from bunshinfork.memory import ksm

REPORT = "/root/wipe.json"
# Three 1 MiB anonymous private mappings filled with one pattern: plain, MADV_WIPEONFORK and
# MAP_DROPPABLE (None where the kernel refuses the flag). On SIGUSR1 it writes what each holds
# now, and its VmFlags, to REPORT; on SIGUSR2 it fills them with the pattern again first.
PROGRAM = f"""
import ctypes, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
N = 1 << 20
PATTERN = (bytes(range(1, 256)) * (N // 255 + 1))[:N]
MAP_PRIVATE, MAP_ANONYMOUS, MAP_DROPPABLE, MADV_WIPEONFORK = 0x02, 0x20, 0x08, 18

def mapping(kind):
    addr = libc.mmap(None, N, 3, (MAP_DROPPABLE if kind == "droppable" else MAP_PRIVATE) | MAP_ANONYMOUS, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    if kind == "wipeonfork":
        assert libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(N), MADV_WIPEONFORK) == 0
    ctypes.memmove(addr, PATTERN, N)
    return addr

maps = {{k: mapping(k) for k in ("plain", "wipeonfork", "droppable")}}

def flags(addr):
    cur = None
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            cur = int(line.split("-")[0], 16)
        elif line.startswith("VmFlags:") and cur == addr:
            return line.split()[1:]

def holds(addr):
    data = ctypes.string_at(addr, N)
    return "pattern" if data == PATTERN else "zeros" if data.count(0) == N else "other"

def report(*_):
    out = {{k: None if a is None else {{"holds": holds(a), "flags": flags(a)}} for k, a in maps.items()}}
    with open({REPORT!r} + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename({REPORT!r} + ".tmp", {REPORT!r})

def refill(*_):
    for a in maps.values():
        if a is not None:
            ctypes.memmove(a, PATTERN, N)
    report()

signal.signal(signal.SIGUSR1, report)
signal.signal(signal.SIGUSR2, refill)
report()
while True:
    signal.pause()
"""
KSM = pytest.param("ksm", marks=pytest.mark.skipif(not ksm.available(), reason="kernel without KSM"))


def state(ws: Workspace, signal: str = "USR1") -> dict[str, Any]:
    """What the program holds now: a fresh report, asked for by signal (USR2: after a refill)."""
    ws.files.remove(REPORT)
    ws.commands.run(["pkill", f"-{signal}", "-f", "wipe-program"])
    wait_for(lambda: ws.files.exists(REPORT), timeout=30)
    return dict(json.loads(str(ws.files.read(REPORT))))


def assert_source(s: dict[str, Any]) -> None:
    assert s["plain"]["holds"] == s["wipeonfork"]["holds"] == "pattern", s
    assert s["droppable"] is None or s["droppable"]["holds"] == "pattern", s


def assert_clone(s: dict[str, Any]) -> None:
    """Empty wipe-on-fork memory with its flags, the rest carried."""
    assert s["plain"]["holds"] == "pattern", s
    assert s["wipeonfork"]["holds"] == "zeros" and "wf" in s["wipeonfork"]["flags"], s
    if s["droppable"] is not None:
        assert s["droppable"]["holds"] == "zeros" and {"wf", "dp"} <= set(s["droppable"]["flags"]), s


@pytest.fixture(scope="module", params=["copy", KSM, COW])
def src(request: pytest.FixtureRequest) -> Iterator[tuple[Workspace, str]]:
    with Workspace.create() as ws:
        ws.files.write("/root/wipe-program", PROGRAM)
        ws.commands.run("exec python3 /root/wipe-program", background=True)
        wait_for(lambda: ws.files.exists(REPORT), timeout=30)
        assert_source(state(ws))
        yield ws, request.param


def test_a_live_forks_clone_finds_wipe_on_fork_memory_empty(src: tuple[Workspace, str]) -> None:
    ws, engine = src
    clones = forked(ws.fork(2, engine))
    try:
        for c in clones:
            assert_clone(state(c))
        assert_source(state(ws))
        # The clone's mapping is still wipe-on-fork: filled again, it is empty in the clone's
        # own clone.
        assert_source(state(clones[0], "USR2"))
        grandchild = forked(clones[0].fork(1, engine))
        try:
            assert_clone(state(grandchild[0]))
        finally:
            grandchild[0].destroy()
    finally:
        for c in clones:
            c.destroy()


def test_a_retained_and_a_saved_snapshots_clones_do_too(src: tuple[Workspace, str], tmp_path: Path) -> None:
    ws, engine = src
    saved = tmp_path / "saved"
    try:
        with ws.snapshot(engine) as snap:
            assert_source(state(ws))
            snap.save(saved).result(timeout=300)
            clones = forked(snap.fork(1))
            try:
                assert_clone(state(clones[0]))
            finally:
                clones[0].destroy()
        with Snapshot.load(saved) as loaded:
            clones = forked(loaded.fork(1))
            try:
                assert_clone(state(clones[0]))
            finally:
                clones[0].destroy()
        assert_source(state(ws))
    finally:
        shutil.rmtree(saved, ignore_errors=True)
