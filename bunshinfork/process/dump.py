"""Dump a frozen workspace's process tree into a snapshot's images, leaving it running."""

from __future__ import annotations

from .. import deadlines
from ..cgroups import Cgroup
from ..contract import Capture
from . import criu, forkcheck
from .images import rearm_expired_timerfds
from .options import dump_opts


def dump_tree(c: Capture) -> None:
    """CRIU seizes the tree through its already frozen freezer cgroup, so it never runs between
    the freeze and the dump; what other parts queued for after the dump runs still frozen.
    What CRIU cannot checkpoint is refused first (forkcheck); CRIU runs under the `criu`
    deadline, cut to what is left of the freeze's, and is handed to the freeze's watchdog."""
    rec = c.source
    assert rec.process is not None and rec.cgroups is not None
    cg = Cgroup(rec.cgroups)
    forkcheck.check(cg.pids(), rec.id)
    images = c.snap.images
    images.mkdir()
    criu.request("dump", dump_opts(rec.process.pid, images, cg.freezer_dir),
                 log=images / "dump.log", env=c.dump_env or None,
                 session_hook=lambda s: c.watch(s.pid), timeout=min(deadlines.current().criu, c.left()))
    for step in c.after_dump:
        step()
    # Image fix-ups need not hold the source frozen.
    c.after_thaw.append(lambda: rearm_expired_timerfds(images))
