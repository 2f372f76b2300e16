"""Reaps workspace inits that this process created, so none lingers as a zombie.

The init is our child (clone3 from this process); whoever destroys it, this process or
another one that connected, the exit becomes visible on its pidfd and is reaped here.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading


class _Reaper:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._poll.register(self._wake_r, select.POLLIN)
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def watch(self, pid: int, pidfd: int) -> None:
        fd = os.dup(pidfd)
        with self._lock:
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="bunshin-reaper", daemon=True)
                self._thread.start()
        os.write(self._wake_w, b"x")

    def after_fork_in_child(self) -> None:
        """A forked child has no reaper thread, and its copy of the poll object still counts
        the parent's poll() as running (a new thread's poll() raised 'concurrent poll()
        invocation'): start afresh, with none of the parent's inits, which are not its children."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.__init__()  # type: ignore[misc]

    def reap_now(self, pid: int) -> None:
        """Reap `pid` if it is our child and has exited; never blocks (a dying pid namespace's
        init can wait on tasks that only some other party can release)."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)

    def _loop(self) -> None:
        while True:
            for fd, _ in self._poll.poll():
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    pid = self._fds.pop(fd, None)
                    self._poll.unregister(fd)
                os.close(fd)
                if pid is not None:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(pid, 0)


reaper = _Reaper()
os.register_at_fork(after_in_child=reaper.after_fork_in_child)
