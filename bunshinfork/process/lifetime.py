"""Workspace lifetimes: a deadline (E2B's sandbox timeout) and an optional creator lease.

Both are enforced by the workspace's own init (csrc/init.c), which kills every process of the
workspace once the deadline passes, or once the lease has not been renewed for LEASE_MS: that
is how a workspace created with die_with_creator=True ends soon after its creator, however the
creator died. Nothing runs on the host to do this: no daemon. What a dead workspace leaves on
the host (mounts, cgroups, layers, state) is removed by the next bunshin operation on the host
(pipeline.collect()) or by gc.

The lifetime lives outside the workspace's file system, where root inside could delete or
rewrite it: in a page of the init's own memory at a fixed address (ADDRESS), written by the
host through /proc/<init>/mem. The init is not dumpable and root inside has no CAP_SYS_PTRACE,
so nothing inside can write it; the init reads it whenever it wakes and fails closed (a page
that does not check out, or none written within its grace, ends the workspace). A clone's
init is restored with its source's page and is given its own before any of its tasks runs
again (install(), from restore.py at CRIU's pre-resume). The creator renews its lease by
writing the page's renewal half from a thread of its own (Leases).
The deadline is also recorded in the workspace's state, so that get_info and the host-side
collection know it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import threading
import time
from collections.abc import Iterator

from .. import state
from ..errors import WorkspaceStateError
from ..state import InitState, Lifetime, Record, Status

# csrc/init.c: LIFETIME_ADDR, LIFE_MAGIC, RENEW_MAGIC and struct life_page.
ADDRESS = 0x4E00000000
MAGIC = int.from_bytes(b"bunshinL", "little")
RENEW_MAGIC = int.from_bytes(b"bunshinR", "little")
_MASK = (1 << 64) - 1
RENEWAL_OFFSET = 32  # renewed_ms, renew_check: what a renewal writes
# Sent to the init after its lifetime moved, so that it reads it before its next wake-up.
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


def _terms(lt: Lifetime) -> bytes:
    """deadline_ms, lease_ms and their check, as the page holds them after its magic."""
    deadline, lease = int(lt.deadline * 1000), int(lt.lease * 1000)
    return struct.pack("<qqQ", deadline, lease, (MAGIC ^ deadline ^ lease) & _MASK)


def _renewal() -> bytes:
    now = int(time.time() * 1000)
    return struct.pack("<qQ", now, (RENEW_MAGIC ^ now) & _MASK)


def _write(pid: int, starttime: int | None, data: bytes, offset: int) -> None:
    """Write `data` into the init's lifetime page. starttime: the init's, checked once its
    memory is open (a pid reused since names another process); None for a restored init that
    is our child, stopped under CRIU, which no one else can reap."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise WorkspaceStateError(f"cannot reach the lifetime of init {pid}: {e}") from e
    try:
        if starttime is not None and state.proc_starttime(pid) != starttime:
            raise WorkspaceStateError(f"init {pid} is gone")
        try:
            written = os.pwrite(fd, data, ADDRESS + offset)
        except OSError as e:
            # EIO: nothing mapped there, an init from before the lifetime left the file system.
            raise WorkspaceStateError(f"cannot write the lifetime of init {pid} ({e}); a snapshot taken "
                                      "with an older bunshin-init must be taken again") from e
        if written != len(data):
            raise WorkspaceStateError(f"short write of the lifetime of init {pid}")
    finally:
        os.close(fd)


def install(pid: int, starttime: int | None, lt: Lifetime) -> None:
    """Give the init its whole lifetime, renewed now: a created init once it answers, a restored
    one while CRIU still holds its tasks stopped (so it never obeys its source's). Then wake
    it: it sleeps until its first lifetime's grace ends, or for its source's wait (the signal
    stays pending, blocked, until a restored init runs)."""
    _write(pid, starttime, struct.pack("<Q", MAGIC) + _terms(lt) + _renewal(), 0)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, WAKE)


def apply(ws_id: str, init: InitState, lt: Lifetime) -> None:
    """Move a running (or frozen) workspace's lifetime, and wake its init to read it. Writers
    of the terms take turns (a lock beside the record): two interleaved writes would leave a
    page that never checks out, which ends the workspace."""
    lock = os.open(state.RUN_ROOT / ws_id / "lifetime.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _write(init.pid, init.starttime, _terms(lt), 8)
    finally:
        os.close(lock)
    with contextlib.suppress(ProcessLookupError):
        os.kill(init.pid, WAKE)  # read it before its next wake-up


def remaining(rec: Record) -> float | None:
    return None if not rec.lifetime.deadline else rec.lifetime.deadline - time.time()


# ---- the creator's lease ----


class Leases:
    """Renews the lease of every die_with_creator workspace this process created, a few times
    per lease, from one thread. When this process dies, the renewals stop and each init ends
    its workspace within LEASE_SECONDS."""

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
                with contextlib.suppress(WorkspaceStateError):
                    renew(pid, start)


def renew(init_pid: int, starttime: int) -> None:
    """Renew the lease of the init `init_pid` (started at `starttime`) from now."""
    _write(init_pid, starttime, _renewal(), RENEWAL_OFFSET)


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
