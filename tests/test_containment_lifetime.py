"""Containment of a workspace's lifetime (issue 36 #16): root inside cannot outlive it.

The init enforced the deadline and the creator's lease from /.bunshin/lifetime, a file in the
workspace's own writable layer: root inside deleted it (no lifetime: the workspace ran on), or
replaced it with a later deadline, or touched it to renew the lease of a creator that was
gone. The host's collection (pipeline.collect) ended such a workspace only at the next bunshin
operation, which a library or CLI user may never make. The lifetime now lives in the init's
memory, written by the host alone (the init is not dumpable, and root inside has no
CAP_SYS_PTRACE), and fails closed: a lifetime the init cannot read ends the workspace.

Each attack runs in a created workspace, a clone and a workspace resumed from disk; the only
wait is for the init to end, with a deadline. Nothing here runs a bunshin operation on the
host while it waits, since that would end the workspace from the host's side.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest
from fork_support import forked
from helpers import run_ok

from bunshinfork import state
from bunshinfork.process import lifetime
from bunshinfork.workspace import Workspace

KINDS = ["created", "clone", "resumed"]
LIFE = 3.0  # seconds: the deadline (or lease) each workspace is given
SLACK = 2.0  # how late past it the init may end it
WAKE = int(lifetime.WAKE)
# Root inside, in turn: the lifetime file deleted, replaced by a far deadline and no lease,
# touched (a lease renewed), the init woken to read what it finds; then the init's memory
# written through /proc/1/mem, and its descriptors looked at (the way to any fd it holds).
FAR = "9999999999999 0"
ATTACK = (
    f"rm -rf /.bunshin/lifetime; kill -{WAKE} 1; "
    f"printf '{FAR}\\n' > /.bunshin/lifetime; kill -{WAKE} 1; "
    f"(while :; do touch /.bunshin/lifetime; printf '{FAR}\\n' > /.bunshin/lifetime; kill -{WAKE} 1; sleep 0.2; done)"
    " >/dev/null 2>&1 &"
)
POKE = (
    f"printf '\\377\\377\\377\\377\\377\\377\\377\\177' | dd of=/proc/1/mem bs=1 seek={lifetime.ADDRESS + 8} "
    "conv=notrunc 2>&1; echo rc=$?; readlink /proc/1/fd/0 2>&1; echo rc=$?"
)


@contextlib.contextmanager
def _subject(kind: str, timeout: float | None, die_with_creator: bool = False) -> Iterator[Workspace]:
    """A workspace of `kind` with the lifetime asked: created with it, a clone forked with it
    from a created workspace without one, or one paused to disk and resumed with it."""
    if kind == "created":
        with Workspace.create(timeout=timeout, die_with_creator=die_with_creator) as ws:
            yield ws
        return
    with Workspace.create() as src:
        if kind == "clone":
            (clone,) = forked(src.fork(1, memory="copy", timeout=timeout, die_with_creator=die_with_creator))
            with clone:
                yield clone
            return
        src.pause_to_disk()
        src.resume_from_disk(timeout=timeout)
        yield src


def _init_ended(ws: Workspace, by: float) -> bool:
    """Whether the init ended by the wall-clock time `by`: polled from its /proc entry, not by
    a bunshin operation (which would collect the workspace from the host's side)."""
    init = ws._rec.process
    assert init is not None
    while time.time() < by:
        if state.proc_starttime(init.pid) != init.starttime or _zombie(init.pid):
            return True
        time.sleep(0.05)
    return state.proc_starttime(init.pid) != init.starttime or _zombie(init.pid)


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1][0] == "Z"
    return True


@pytest.mark.parametrize("kind", KINDS)
def test_root_inside_cannot_outlive_its_deadline(kind: str) -> None:
    with _subject(kind, LIFE) as ws:
        ends = ws.ends_at()
        assert ends is not None
        run_ok(ws, ATTACK)
        poked = run_ok(ws, POKE).stdout
        assert _init_ended(ws, ends + SLACK), f"{kind}: root inside kept the workspace past its deadline"
        # The init's memory and descriptors are out of reach: it is not dumpable.
        assert poked.count("rc=0") == 0, poked


@pytest.mark.parametrize("kind", ["created", "clone"])
def test_an_idle_workspace_ends_on_time(kind: str) -> None:
    """No command wakes the init after its lifetime is given (each one does): the host's
    install wakes it, or it would sleep out its first lifetime's grace (or its source's wait)."""
    with _subject(kind, LIFE) as ws:
        ends = ws.ends_at()
        assert ends is not None
        assert _init_ended(ws, ends + SLACK), f"{kind}: the init slept past its deadline"


@pytest.mark.parametrize("kind", ["created", "clone"])
def test_root_inside_cannot_renew_a_lapsed_lease(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifetime, "LEASE_SECONDS", LIFE)
    with _subject(kind, None, die_with_creator=True) as ws:
        run_ok(ws, ATTACK)
        # The creator stops renewing, as a dead one does.
        lifetime.leases.drop(ws.id)
        stopped = time.time()
        assert _init_ended(ws, stopped + LIFE + SLACK), f"{kind}: root inside renewed a lapsed lease"


def test_a_lifetime_the_init_cannot_read_ends_the_workspace() -> None:
    """Fail closed: what the init finds where its lifetime lives does not check out (here the
    host's own write, garbled), and the workspace ends rather than run without a lifetime."""
    with Workspace.create() as ws:
        init = ws._rec.process
        assert init is not None
        fd = os.open(f"/proc/{init.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        try:
            os.pwrite(fd, b"\x5a" * 8, lifetime.ADDRESS + 8)
        finally:
            os.close(fd)
        os.kill(init.pid, lifetime.WAKE)
        assert _init_ended(ws, time.time() + SLACK)
