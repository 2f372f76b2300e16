"""CRIU processes started before they are asked for: a few idle `criu swrk` per kind.

Starting CRIU (exec, loading its 22 shared libraries, reaching its request loop) took 5-10 ms
of every dump, with the source frozen, and of every restore. A swrk does nothing until it reads
its request, and nothing in that request is known at its start: the directories it works in
are named by descriptor through /proc/<our pid>/fd (CRIU's work_dir_fd and images_dir_fd), so
one started ahead serves any request of its kind. Kinds differ in how CRIU is started: the
KSM opt-in its restored tasks inherit, PR_SET_PDEATHSIG for restores, its environment and its
binary (Session's arguments), so each kind has its own few.

After the first request of a kind, IDLE of it wait; a request takes one (a hit) or, when none
is left, starts its own as before (a miss); a thread of ours starts the replacement. That
thread lives as long as the process: PR_SET_PDEATHSIG follows the thread that started a
process, so a restore's CRIU dies with this process, not with some worker thread. A dump's idle
CRIU has no such signal: it reads EOF on its socket when this process exits and ends (atexit
also closes them). Each idle CRIU is 6 MiB resident (under 1 MiB of it its own) and uses no CPU.
BUNSHIN_CRIU_IDLE=0 turns this off.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

IDLE_ENV = "BUNSHIN_CRIU_IDLE"
IDLE_DEFAULT = 1
KINDS_KEPT = 8  # kinds stocked at once; the least recently asked for goes first

Key = tuple[str, bool, bool, tuple[tuple[str, str], ...]]


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0


def idle_target() -> int:
    try:
        return max(0, int(os.environ.get(IDLE_ENV, IDLE_DEFAULT)))
    except ValueError:
        return IDLE_DEFAULT


class Prestarted:
    """Idle sessions per kind, made by `start(key)` on a thread of our own."""

    def __init__(self, start: Callable[[Key], object], alive: Callable[[object], bool],
                 close: Callable[[object], None]) -> None:
        self._start, self._alive, self._close = start, alive, close
        self._cond = threading.Condition()
        self._idle: dict[Key, collections.deque[object]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self.stats = Stats()

    def take(self, key: Key) -> object | None:
        """An idle session of `key`, or None (counted as a miss); either way the kind is kept
        stocked from now on."""
        if idle_target() == 0:
            return None
        evicted: list[object] = []
        with self._cond:
            if self._closed:
                return None
            idle = self._idle.pop(key, None) or collections.deque()
            self._idle[key] = idle  # last in the order: the most recently asked for
            while len(self._idle) > KINDS_KEPT:
                evicted.extend(self._idle.pop(next(iter(self._idle))))
            found = None
            while idle:
                s = idle.popleft()
                if self._alive(s):
                    found = s
                    break
                self._close(s)  # died while idle (killed from outside): never hand it out
            if found is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            self._ensure_thread()
            self._cond.notify()
        for s in evicted:
            with contextlib.suppress(Exception):
                self._close(s)
        return found

    def close(self) -> None:
        """End every idle session (atexit; tests)."""
        with self._cond:
            self._closed = True
            idle = [s for q in self._idle.values() for s in q]
            self._idle.clear()
            self._cond.notify()
        for s in idle:
            with contextlib.suppress(Exception):
                self._close(s)

    def idle(self) -> list[object]:
        """The sessions waiting now (our children that no request has yet)."""
        with self._cond:
            return [s for q in self._idle.values() for s in q]

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._fill, name="bunshin-criu-prestart", daemon=True)
            self._thread.start()

    def _wanted(self) -> Key | None:
        target = idle_target()
        for key, q in self._idle.items():
            if len(q) < target:
                return key
        return None

    def _fill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self._wanted() is None:
                    self._cond.wait()
                if self._closed:
                    return
                key = self._wanted()
            assert key is not None
            try:
                s = self._start(key)
            except Exception:
                # A CRIU that cannot start here fails the request that starts its own, with its
                # error; stop stocking this kind rather than retry in a loop.
                with self._cond:
                    self._idle.pop(key, None)
                continue
            with self._cond:
                if self._closed or key not in self._idle:
                    stale = True
                else:
                    self._idle[key].append(s)
                    stale = False
            if stale:
                self._close(s)

    def after_fork_in_child(self) -> None:
        # The idle sessions are the parent's; a forked child must start its own.
        self._cond = threading.Condition()
        self._idle = {}
        self._thread = None
        self._closed = False


def install(pool: Prestarted) -> Prestarted:
    atexit.register(pool.close)
    os.register_at_fork(after_in_child=pool.after_fork_in_child)
    return pool
