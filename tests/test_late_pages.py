"""A large source's anonymous pages are written after it resumes (bunshinfork/memory/late.py):
its clone still gets the memory exactly as it was at the dump, while the source rewrites it;
a process with MADV_DONTFORK memory (which a holder would not have) and one with
MADV_WIPEONFORK memory are carried as a plain dump carries them; no holder outlives the fork.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fork_support import forked
from helpers import wait_for

from bunshinfork import Workspace
from bunshinfork.cgroups import Cgroup
from bunshinfork.errors import ForkError
from bunshinfork.memory import late
from bunshinfork.process import criu

MIB = 1 << 20
RESULT = "/root/late-result.json"
READY = "/root/late-ready"
# A writer that sweeps its 48 MiB buffer without end, stamping each page's first 8 bytes with
# the sweep's number. At any instant the stamps read g+1 on a prefix and g after it. Once it
# finds itself in a clone (a new time namespace), it ends the sweep it is in and records the
# stamps: one number everywhere, unless the clone's memory was read at more than one instant.
# A second process keeps 8 MiB of MADV_DONTFORK and 1 MiB of MADV_WIPEONFORK memory filled with
# a pattern, beside 8 MiB of plain memory (large enough to be held, were it not for DONTFORK).
WRITER = f"""
import os, time
N = 48 << 20
P = 4096
b = bytearray(os.urandom(N))
ns = os.readlink('/proc/self/ns/time')
open('{READY}-w', 'w').close()
g = 0
while True:
    g += 1
    stamp = g.to_bytes(8, 'little')
    for off in range(0, N, P):
        b[off:off + 8] = stamp
    if os.readlink('/proc/self/ns/time') != ns:
        stamps = sorted({{int.from_bytes(b[o:o + 8], 'little') for o in range(0, N, P)}})
        open('{RESULT}.tmp', 'w').write(repr(stamps[:20]) + ' ' + str(len(stamps)))
        os.rename('{RESULT}.tmp', '{RESULT}')
        while True:
            time.sleep(3600)
"""
KEEPER = f"""
import ctypes, json, mmap, os, time
N = 8 << 20
PATTERN = (bytes(range(1, 256)) * (N // 255 + 1))[:N]
plain = bytearray(os.urandom(N))
dontfork = mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
dontfork.madvise(mmap.MADV_DONTFORK)
dontfork[:] = PATTERN
wipe = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
wipe.madvise(18)  # MADV_WIPEONFORK (not in mmap before 3.12)
wipe[:] = PATTERN[:1 << 20]
digest = hash(bytes(plain))
ns = os.readlink('/proc/self/ns/time')
open('{READY}-k', 'w').close()
while os.readlink('/proc/self/ns/time') == ns:
    time.sleep(0.01)
out = {{"dontfork": dontfork[:] == PATTERN, "wipe_zero": wipe[:] == bytes(1 << 20),
        "plain": hash(bytes(plain)) == digest}}
open('{RESULT}-k.tmp', 'w').write(json.dumps(out))
os.rename('{RESULT}-k.tmp', '{RESULT}-k')
while True:
    time.sleep(3600)
"""


def processes(ws: Workspace) -> list[tuple[str, str]]:
    """(state, command) of every process in the workspace but the ps that lists them."""
    out = str(ws.commands.run(["ps", "-eo", "stat=,args="]).stdout)
    return sorted(((line.split(None, 1)[0][0], line.split(None, 1)[1]) for line in out.splitlines()
                   if line.split() and "ps -eo" not in line), key=lambda p: p[1])


def traced(ws: Workspace) -> list[str]:
    """The status of each process in the workspace's cgroup that a tracer holds. A pid that is
    gone by the time its status is read (the exec session of the ps above, still ending) is no
    holder left behind: CI once listed one and then failed to read it."""
    assert ws.record.cgroups is not None
    held = []
    for pid in Cgroup(ws.record.cgroups).pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        if "TracerPid:\t0" not in status:
            held.append(status)
    return held


@pytest.fixture(params=["root", "userns"])
def source(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Workspace]:
    monkeypatch.setenv(late.MIN_ENV, "32")
    spec = {"rootfs": "debian", "userns": True} if request.param == "userns" else {}
    with Workspace.create(**spec) as ws:
        ws.files.write("/root/writer.py", WRITER)
        ws.files.write("/root/keeper.py", KEEPER)
        ws.commands.run("exec python3 /root/writer.py", background=True)
        ws.commands.run("exec python3 /root/keeper.py", background=True)
        wait_for(lambda: ws.files.exists(f"{READY}-w") and ws.files.exists(f"{READY}-k"), timeout=60)
        yield ws


@pytest.mark.skipif(criu.dirty_tracking(), reason="the kernel tracks dirty pages: a pre-dump shortens the freeze "
                    "instead (late.plan)")
@pytest.mark.parametrize("engine", ["copy", "ksm"])
def test_a_clone_gets_the_memory_as_dumped_while_the_source_rewrites_it(source: Workspace, engine: str) -> None:
    before = processes(source)
    clone = forked(source.fork(1, engine))[0]
    try:
        wait_for(lambda: clone.files.exists(RESULT) and clone.files.exists(f"{RESULT}-k"), timeout=60)
        stamps, distinct = str(clone.files.read(RESULT)).split(" ")
        assert distinct == "1", f"the clone's buffer holds stamps of several sweeps: {stamps}"
        assert json.loads(str(clone.files.read(f"{RESULT}-k"))) == {"dontfork": True, "wipe_zero": True,
                                                                     "plain": True}
        timings = clone.info().timings
        # The pages were written late: holders were made while frozen.
        assert timings.get("snapshot.holders", 0) > 0, timings
        assert not source.files.exists(RESULT)  # the source never saw itself as a clone
    finally:
        clone.destroy()
    # No holder left: the same processes, none stopped or traced (t, T) and no zombie (Z).
    after = processes(source)
    assert [cmd for _, cmd in after] == [cmd for _, cmd in before]
    assert not [p for p in after if p[0] in "tTZ"], after
    assert traced(source) == []


def test_a_small_source_is_dumped_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(late.MIN_ENV, "off")
    assert late.min_bytes() is None
    monkeypatch.setenv(late.MIN_ENV, "")
    assert late.min_bytes() == late.DEFAULT_MIN
    with Workspace.create() as ws:
        clone = forked(ws.fork(1))[0]
        try:
            assert "snapshot.holders" not in clone.info().timings
        finally:
            clone.destroy()
    assert os.environ.get(late.MIN_ENV) == ""


KILLER = """
import os, signal, time
# Kills every process it sees stopped under a tracer (state t) with exit signal 0 (field 38 of
# /proc/PID/stat): a holder, from inside. (Its parents, stopped a moment for the reap, are not
# holders: killing those would be the workspace killing its own processes.)
while True:
    for pid in os.listdir('/proc'):
        if pid.isdigit():
            try:
                fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
                if fields[0] == 't' and fields[35] == '0':
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, IndexError):
                pass
    time.sleep(0.001)
"""


@pytest.mark.skipif(criu.dirty_tracking(), reason="the kernel tracks dirty pages: no late pages")
def test_a_workspace_that_kills_its_holders_gets_a_fork_error_and_loses_nothing(source: Workspace) -> None:
    """Code in the workspace sees its holders (stopped, traced) and kills them: the fork fails with
    a typed error or, where the killer was too late, succeeds whole; the source runs on, and no
    holder, zombie or tracer is left behind."""
    source.files.write("/root/killer.py", KILLER)
    source.commands.run("exec python3 /root/killer.py", background=True)
    # The list to compare with once the killer runs as itself: CI once listed the bash that had
    # not yet exec'd it.
    before = wait_for(lambda: (cmds := [cmd for _, cmd in processes(source)])
                      and "python3 /root/killer.py" in cmds and cmds, timeout=30)
    outcomes = []
    for _ in range(3):
        try:
            clone = forked(source.fork(1, "copy"))[0]
        except (ForkError, AssertionError) as e:
            outcomes.append(type(e).__name__)
            continue
        try:
            wait_for(lambda c=clone: c.files.exists(RESULT), timeout=60)
            assert str(clone.files.read(RESULT)).split(" ")[1] == "1"
            outcomes.append("clone")
        finally:
            clone.destroy()
    assert "ForkError" in outcomes, outcomes  # the killer caught a holder at least once
    assert source.is_running()
    after = processes(source)
    assert [cmd for _, cmd in after] == before, outcomes
    assert not [p for p in after if p[0] in "tTZ"], after
    assert traced(source) == []


@pytest.mark.parametrize("parent", ["lives", "dies"])
def test_a_holder_ends_without_a_trace_whether_its_parent_lives_or_died(parent: str) -> None:
    """release_running(): a kept holder is killed and reaped with its parent running again, and
    where the parent died meanwhile (the holder then belongs to the namespace's init)."""
    from bunshinfork.memory import holders

    with Workspace.create() as ws:
        ws.commands.run("exec sleep 600", background=True)
        assert ws.record.cgroups is not None
        cg = Cgroup(ws.record.cgroups)
        wait_for(lambda: any(Path(f"/proc/{p}/comm").read_text().strip() == "sleep" for p in cg.pids()))
        sleeper = next(p for p in cg.pids() if Path(f"/proc/{p}/comm").read_text().strip() == "sleep")
        cg.freeze()
        try:
            hs = holders.capture_tree(cg.pids(), cg.freeze, cg.thaw, hold=[sleeper], keep_processes=True)
        finally:
            cg.thaw()
        (h,) = hs.values()
        assert h.child and Path(f"/proc/{h.child}/status").exists()
        if parent == "dies":
            os.kill(sleeper, 9)
            wait_for(lambda: not Path(f"/proc/{sleeper}").exists())  # reaped by its command's init
        child = h.child
        h.release_running()
        wait_for(lambda: not Path(f"/proc/{child}").exists(), timeout=10)
        left = processes(ws)
        assert not [p for p in left if p[0] in "tTZ"], left
        assert ("S", "sleep 600") in left if parent == "lives" else all("sleep" not in c for _, c in left)
