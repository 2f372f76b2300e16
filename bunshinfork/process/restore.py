"""Restore a snapshot's process tree into a clone: its own namespaces, root, cgroup and memory."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import native
from ..cgroups import Cgroup
from ..contract import Build
from ..errors import BunshinError
from . import cgyard, criu, lifetime, options
from .options import restore_opts

# Called with each restore's live criu.Session right after it starts; failure-injection tests use
# it to kill a real CRIU mid-restore. None in normal operation.
RESTORE_HOOK: Callable[[criu.Session], None] | None = None

# The restore's phases in the fork profile, each named by the notification that ends it (CRIU's
# cr-restore.c runs them in this order); a notification not listed here (network-lock, ...)
# falls into the phase it happens in. The memory engine's pre-resume work is its own stage.
PHASES = {
    "pre-restore": "criu.start",  # criu swrk started, the request read, images opened
    "setup-namespaces": "criu.namespaces",  # the root task forked into new namespaces
    "post-setup-namespaces": "criu.mounts",  # mount namespace and network set up
    "post-restore": "criu.tasks",  # every task forked; memory, files and sockets restored
    "pre-resume": "criu.creds",  # credentials and the last restorer stage
    "post-resume": "criu.resume",  # tasks resumed (the memory engine's share excluded)
}
END = "criu.finish"  # tasks detached, criu's answer read and its process reaped


def restore_tree(b: Build) -> int:
    """Run CRIU's restore into b.root and b.rec's cgroup; returns the restored init's host pid.

    rst_sibling makes the restored init our child rather than criu's, so it is reaped like a
    created init. b.pre_resume runs while every thread is stopped under CRIU's ptrace at its
    final sigreturn, then the init is given b.rec's lifetime; should either fail, the clone's
    tasks are killed before they run again.
    """
    assert b.source is not None and b.root is not None and b.rec.cgroups is not None
    cg = Cgroup(b.rec.cgroups)
    work = b.rec.dir / "criu"
    work.mkdir()
    wfd = os.open(work, os.O_DIRECTORY | os.O_RDONLY)
    restored_init: list[int] = []
    failed: list[BaseException] = []
    clock = _PhaseClock(b.rec.timings)
    spec = b.source.meta.spec
    fresh_net = options.fresh_net(spec)

    def on_notify(script: str, pid: int) -> None:
        clock.mark(script)
        # setup-namespaces names the restored init. From here on, if the restore fails (criu
        # killed, a later step failing) only we can reap it.
        if script == "setup-namespaces" and pid > 0:
            restored_init.append(pid)
            if fresh_net:
                native.loopback_up_in(pid)
        elif script == "pre-resume":
            try:
                if b.pre_resume:
                    pids = cg.pids()
                    with clock.aside("memory.share"):
                        for step in b.pre_resume:
                            step(pids)
                # The clone's own lifetime over its source's, in memory the engine has shared in
                # by now: the init never obeys the source's, nor runs without one.
                lifetime.install(restored_init[0], None, b.rec.lifetime)
            except BaseException as e:
                # CRIU resumes the tasks whatever this hook says; SIGKILL reaches traced tasks.
                failed.append(e)
                for p in cg.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGKILL)

    try:
        opts = restore_opts(b.source.images, wfd, str(b.root.path), cg.hierarchy_paths(), fresh_net,
                            cgyard.of(b.source.dir, b.source.images), spec.userns)
        opts.external.extend(b.criu_external)  # eth0's veth (the network part)
        started = time.time()
        try:
            # CRIU opens the work directory as /proc/<our pid>/fd/<wfd> (work_dir_fd): nothing
            # to inherit, so an idle CRIU started ahead serves it (prestart.py).
            resp = criu.request("restore", opts, on_notify, ksm_merge=b.ksm_merge,
                                log=work / "restore.log", session_hook=RESTORE_HOOK)
            clock.mark(None)
            b.rec.restore_window = (started, time.time())
        except BunshinError as e:
            # Tasks killed for a failed pre-resume step can fail CRIU's detach: name the first cause.
            if failed:
                raise failed[0] from e
            raise
        if failed:
            raise failed[0]
        return int(resp.restore.pid)
    except BaseException:
        _abandon(restored_init, cg, work)
        raise
    finally:
        os.close(wfd)


class _PhaseClock:
    """Times a restore's phases from CRIU's notifications into a fork profile."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings = timings
        self.last = time.monotonic()
        self.excluded = 0.0  # time spent in our own notification handlers since the last mark

    def mark(self, script: str | None) -> None:
        name = END if script is None else PHASES.get(script)
        if name is None:
            return
        now = time.monotonic()
        self.timings[name] = self.timings.get(name, 0.0) + now - self.last - self.excluded
        self.last, self.excluded = now, 0.0

    @contextlib.contextmanager
    def aside(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - t0
            self.timings[name] = self.timings.get(name, 0.0) + took
            self.excluded += took


def _abandon(restored_init: list[int], cg: Cgroup, work: Path) -> None:
    """Undo what a CRIU that died or failed mid-restore could not.

    rst_sibling made its half-restored init our child: unless we kill and reap it, it waits
    forever for a criu that is gone, or stays a zombie. It is known from setup-namespaces, or
    before that recognised as our child in the clone's cgroup or holding criu's descriptors
    into this clone's work directory. Its cgroup yard, mounted in our mount namespace under
    the work directory, would keep the clone's state directory busy.
    """
    in_cgroup = set(cg.pids())
    orphans = set(restored_init)
    for pid in _children():
        if pid in in_cgroup or _holds_fd_under(pid, work):
            orphans.add(pid)
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a pid namespace's init: takes every task with it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    native.unmount_below(work)


def _children() -> set[int]:
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            out.update(int(p) for p in (task / "children").read_text().split())
    return out


def _holds_fd_under(pid: int, directory: Path) -> bool:
    prefix = str(directory) + "/"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                return True
    return False
