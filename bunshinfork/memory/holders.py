"""Snapshot holders: a copy-on-write image of each process's memory, without a visible process.

While a workspace is frozen, a fork() is injected into each of its processes. With the
bunshin module the child's mm is taken as a snapshot descriptor, and the child is killed
and reaped inside its still-stopped parent; without it the child stays a stopped, traced
holder process (used by tests of the injection itself).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from .. import deadlines, native
from ..errors import DeadlineExceeded, KernelFeatureError
from . import cow

WALL = 0x40000000
T = TypeVar("T")


@dataclass
class Holder:
    parent: int  # host pid of the process the holder images
    child: int = 0  # the holder process (host pid) while it lives
    child_ns: int = 0  # the same, as its parent sees it
    fd: int | None = None  # snapshot descriptor (module) once taken
    maps: list[tuple[int, int, str]] = field(default_factory=list)

    def read(self, addr: int, size: int) -> bytes:
        """Snapshot memory at `addr`: pread on the descriptor, or /proc/PID/mem of a live holder
        (never process_vm_readv, which pins pages and unshares them)."""
        if self.fd is not None:
            return os.pread(self.fd, size, addr)
        with open(f"/proc/{self.child}/mem", "rb", buffering=0) as f:
            f.seek(addr)
            return f.read(size)

    def stats(self) -> tuple[int, int]:
        """(pages the snapshot maps, pages only it maps): what keeping it costs."""
        if self.fd is None:
            raise KernelFeatureError(cow.unavailable_reason())
        return cow.stats(self.fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.child:
            _kill_holder(self.parent, self.child, self.child_ns, _Budget(None))
            self.child = 0

    def release_running(self) -> None:
        """Kill and reap a holder process whose parent runs again: the parent's leader alone is
        stopped (ptrace), for the injected wait4, and let go. Where the parent has died (before
        or while we stop it), the holder was handed to the namespace's init with a SIGCHLD
        exit signal: once we have seen it die as its tracer, that init reaps it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.child:
            return
        budget = _Budget(None)
        seized = True
        try:
            try:
                native.ptrace_seize(self.parent)
                budget.call("waiting for the ptrace stop of", self.parent,
                            lambda t: native.ptrace_wait_stop(self.parent, t))
            except ProcessLookupError:
                seized = False
            if seized:
                _kill_holder(self.parent, self.child, self.child_ns, budget)
            else:
                self._end_unreaped()
        except BaseException:
            # Never leave it alive (a parent traced by someone else refuses our seize): dead, a
            # holder with exit signal 0 stays a zombie of a live parent until it waits with __WALL.
            self._end_unreaped()
            raise
        finally:
            if seized:
                with contextlib.suppress(OSError):
                    native.ptrace_detach(self.parent)

    def _end_unreaped(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.child, WALL)
        self.child = 0


class _Budget:
    """Per-call timeouts: the `inject` deadline, cut to what is left of an overall one."""

    def __init__(self, until: float | None) -> None:
        self.until = until

    def next(self, what: str, pid: int) -> float:
        t = deadlines.current().inject
        if self.until is not None:
            left = self.until - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"{what} {_comm(pid)}: the source's freeze deadline passed")
            t = min(t, left)
        return t

    def call(self, what: str, pid: int, fn: Callable[[float], T]) -> T:
        t = self.next(what, pid)
        try:
            return fn(t)
        except TimeoutError as e:
            raise DeadlineExceeded(f"{what} {_comm(pid)} did not finish within {t:.1f}s "
                                   "(deadline 'inject', see bunshinfork.deadlines)") from e


def _comm(pid: int) -> str:
    try:
        return f"process {pid} ({Path(f'/proc/{pid}/comm').read_text().strip()})"
    except OSError:
        return f"process {pid}"


def threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def anon_maps(pid: int) -> list[tuple[int, int, str]]:
    """Private anonymous ranges (and the heap/stack) of a process, as /proc/PID/maps lists them."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        perms, name = parts[1], parts[5] if len(parts) > 5 else ""
        if perms[3] == "p" and (not name or name in ("[heap]", "[stack]")):
            out.append((start, end, name))
    return out


def _kill_holder(parent: int, child: int, child_ns: int, budget: _Budget) -> None:
    """Kill a holder and reap it inside its parent, which must be stopped and traced by us."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)
    # As tracer we see the death first; only then is the zombie the parent's to reap.
    end = time.monotonic() + budget.next("reaping the holder of", parent)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(child, WALL | os.WNOHANG) == (0, 0):
            if time.monotonic() > end:
                raise DeadlineExceeded(f"holder {child} of {_comm(parent)} did not die after SIGKILL")
            time.sleep(0.0005)
    while True:
        try:
            budget.call("reaping the holder inside", parent, lambda t: native.inject_reap(parent, child_ns, t))
            return
        except BlockingIOError:
            if time.monotonic() > end:
                raise DeadlineExceeded(f"{_comm(parent)} could not reap its holder {child_ns}") from None
            time.sleep(0.0005)


def take(leaders: Iterable[int], keep_processes: bool = False, until: float | None = None) -> list[Holder]:
    """Make a holder for each process in `leaders` (thread-group leaders, all already stopped
    by ptrace through seize_all). With the module and keep_processes False, each holder is
    turned into a descriptor and its process killed and reaped at once; a kept holder process
    ends with release_running() once its parent runs again. Every injected syscall has the
    `inject` deadline, and none starts after `until` (time.monotonic())."""
    holders = []
    budget = _Budget(until)
    use_module = cow.available() and not keep_processes
    for pid in leaders:
        h = Holder(parent=pid, maps=anon_maps(pid))
        h.child, h.child_ns = budget.call("injecting a fork into", pid, lambda t, pid=pid: native.inject_fork(pid, t))
        if use_module:
            try:
                h.fd = cow.snapshot_fd(h.child)
            finally:
                _kill_holder(pid, h.child, h.child_ns, budget)
                h.child = 0
        holders.append(h)
    return holders


def seize_all(pids: Iterable[int]) -> list[int]:
    """Seize every thread of every process; returns the tids. Works on frozen tasks: they
    enter the ptrace stop as soon as they are thawed."""
    tids = []
    for pid in pids:
        for tid in threads(pid):
            native.ptrace_seize(tid)
            tids.append(tid)
    return tids


def wait_all(tids: Iterable[int], until: float | None = None) -> None:
    budget = _Budget(until)
    for tid in tids:
        budget.call("waiting for the ptrace stop of", tid, lambda t, tid=tid: native.ptrace_wait_stop(tid, t))


def detach_all(tids: Iterable[int]) -> None:
    for tid in tids:
        with contextlib.suppress(OSError):
            native.ptrace_detach(tid)


TASK_SIZE = 1 << 47  # x86-64 user address space with 4-level paging


def ns_pid(host_pid: int) -> int:
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise ProcessLookupError(host_pid)


def capture_tree(pids: list[int], freeze: Callable[[], None], thaw: Callable[[], None],
                 until: float | None = None, hold: Iterable[int] | None = None,
                 keep_processes: bool = False) -> dict[int, Holder]:
    """Holders for every process of a frozen tree, keyed by pid inside its namespace.

    The tree is frozen on entry and on return. Every thread is seized while frozen; a thaw
    lets them reach their ptrace stop (no user code runs: the interrupt is taken on the way
    back to user space); holders are forked and, with the module, turned into descriptors;
    the tree is frozen again before the threads are detached into the freezer. Each step has
    the `inject` deadline and none starts after `until` (DeadlineExceeded). `hold`: the
    processes (host pids) to make holders for, where not all of `pids`; every one is stopped.
    """
    tids = seize_all(pids)
    out: dict[int, Holder] = {}
    try:
        thaw()
        wait_all(tids, until)
        for h in take(pids if hold is None else list(hold), keep_processes=keep_processes, until=until):
            out[ns_pid(h.parent)] = h
        freeze()
    except BaseException:
        for h in out.values():
            h.release()
        raise
    finally:
        detach_all(tids)
    return out


def share_tree(holders_by_ns_pid: dict[int, Holder], clone_pids: list[int]) -> int:
    """Map each holder's private memory into the clone process with the same namespace pid
    (all stopped under CRIU's ptrace, before it resumes them); returns the number of VMAs shared.

    Anonymous VMAs were not dumped, so they get the holder's pages. The written pages of
    private file mappings (libraries' data and relocations) were dumped and restored as
    copies; where the clone maps the same inode (the shared lower layer) those copies are
    replaced by the holder's pages too, so a clone does not pay for them again."""
    shared = 0
    for pid in clone_pids:
        h = holders_by_ns_pid.get(ns_pid(pid))
        if h is None or h.fd is None:
            raise KernelFeatureError(f"no memory snapshot for clone process {pid}")
        # CRIU's restorer may have touched the clone's anonymous memory; the snapshot is what
        # the process had at freeze time, so whatever is there now is discarded.
        vmas, _ = cow.share(h.fd, pid, 0, TASK_SIZE, reset=True, files=True)
        shared += vmas
    return shared
