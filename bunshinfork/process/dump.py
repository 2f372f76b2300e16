"""Dump a frozen workspace's process tree into a snapshot's images, leaving it running."""

from __future__ import annotations

from ..cgroups import Cgroup
from ..contract import Capture
from . import criu
from .images import rearm_expired_timerfds
from .options import dump_opts


def dump_tree(c: Capture) -> None:
    """CRIU seizes the tree through its already frozen freezer cgroup, so it never runs between
    the freeze and the dump; what other parts queued for after the dump runs still frozen."""
    rec = c.source
    assert rec.process is not None and rec.cgroups is not None
    cg = Cgroup(rec.cgroups)
    images = c.snap.images
    images.mkdir()
    criu.request("dump", dump_opts(rec.process.pid, images, cg.paths.get("freezer") or cg.paths["unified"]),
                 log=images / "dump.log", env=c.dump_env or None)
    for step in c.after_dump:
        step()
    # Image fix-ups need not hold the source frozen.
    c.after_thaw.append(lambda: rearm_expired_timerfds(images))
