"""Workspace lifetimes: a deadline (E2B's sandbox timeout) and an optional creator lease.

Both are enforced by the workspace's own init (csrc/init.c), which reads /.bunshin/lifetime
("DEADLINE_MS LEASE_MS", wall clock) whenever it wakes and kills every process of the
workspace once the deadline passes, or once the file has not been touched for LEASE_MS: that
is how a workspace created with die_with_creator=True ends soon after its creator, however the
creator died. The creator touches the file from a thread of its own (Leases). Nothing runs on
the host to do this: no daemon. What a dead workspace leaves on the host (mounts, cgroups,
layers, state) is removed by the next bunshin operation on the host (pipeline.collect())
or by gc.
The deadline is also recorded in the workspace's state, so that get_info and the host-side
collection know it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .. import inroot, state
from ..state import Lifetime, Record, Status

FILE = "/.bunshin/lifetime"
# Sent to the init after the deadline moved, so that it re-reads the file before its next wake-up.
WAKE = signal.SIGRTMIN + 1
# How long a die_with_creator workspace outlives its creator at most.
LEASE_SECONDS = 10.0


def deadline_after(timeout: float | None) -> float:
    """The wall-clock deadline `timeout` seconds from now; 0.0 (none) for None or 0."""
    if timeout is None or timeout == 0:
        return 0.0
    if timeout < 0:
        from ..errors import InvalidArgumentException

        raise InvalidArgumentException(f"timeout must be >= 0 seconds, got {timeout!r}")
    return time.time() + float(timeout)


def asked(timeout: float | None, die_with_creator: bool) -> Lifetime:
    """The lifetime a create or fork asks for."""
    return Lifetime(deadline_after(timeout), LEASE_SECONDS if die_with_creator else 0.0)


def encode(lt: Lifetime) -> str:
    return f"{int(lt.deadline * 1000)} {int(lt.lease * 1000)}\n"


def seed(upper: Path, lt: Lifetime) -> None:
    """Write the lifetime into a layer before its init starts (create) or is restored (fork):
    a clone's init runs with its source's memory, and this file is what it obeys."""
    d = upper / ".bunshin"
    d.mkdir(mode=0o700, exist_ok=True)
    tmp = d / "lifetime.tmp"
    tmp.write_text(encode(lt))
    os.replace(tmp, d / "lifetime")


def remaining(rec: Record) -> float | None:
    return None if not rec.lifetime.deadline else rec.lifetime.deadline - time.time()


# ---- the creator's lease ----


class Leases:
    """Touches the lifetime file of every die_with_creator workspace this process created, a few
    times per lease, from one thread. When this process dies, the touching stops and each init
    ends its workspace within LEASE_SECONDS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, int]] = {}  # id -> (init pid, its start time)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def hold(self, rec: Record) -> None:
        assert rec.process is not None
        with self._lock:
            self._held[rec.id] = (rec.process.pid, rec.process.starttime)
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._loop, name="bunshin-lease", daemon=True)
                self._thread.start()
        self._wake.set()

    def drop(self, ws_id: str) -> None:
        with self._lock:
            self._held.pop(ws_id, None)

    def _loop(self) -> None:
        while True:
            self._wake.wait(LEASE_SECONDS / 4)
            self._wake.clear()
            with self._lock:
                held = dict(self._held)
            for ws_id, (pid, start) in held.items():
                if state.proc_starttime(pid) != start:
                    self.drop(ws_id)
                    continue
                with contextlib.suppress(OSError):
                    touch(pid)


def touch(init_pid: int) -> None:
    # bunshin's own path: no symlink followed (inroot.NotBunshins, an OSError, if one is there).
    with inroot.root(init_pid) as root:
        fd = inroot.fixed(root, FILE, os.O_RDONLY)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


leases = Leases()


# ---- host-side collection ----


@contextlib.contextmanager
def cleanup_lock(rec: Record) -> Iterator[bool]:
    """Serialises the removal of one workspace between its owner's destroy() and another
    process's collection; yields False when the workspace is gone already."""
    try:
        fd = os.open(rec.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield (rec.dir / "state.json").exists() or rec.status is Status.CREATING
    finally:
        os.close(fd)


def ended(rec: Record) -> bool:
    """Its lifetime is over: past the deadline, or a lease whose holder is gone."""
    lt = rec.lifetime
    if lt.deadline and time.time() >= lt.deadline:
        return True
    return bool(lt.lease) and not rec.init_alive() and not rec.creator_alive()
