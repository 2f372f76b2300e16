"""Dump a frozen workspace's process tree into a snapshot's images, leaving it running.

A workspace's snapshots store their pages as deltas against the snapshot its memory last
matched (state.Lineage: the one it was forked from, or its previous snapshot). Where the kernel
tracks dirty pages, every dump resets the tracking (--track-mem), and the next one names the
previous as its parent: CRIU then writes only the pages written since, while the source is
frozen. With no such parent (a workspace's first snapshot, a clone's), CRIU's pre-dump writes
the pages first with the source running, and the freeze writes only those written since the
pre-dump. Without dirty tracking CRIU writes every page while frozen. Either way, once the
source has resumed, the pages equal to the parent snapshot's are replaced by references to
them (pages.dedupe), and a pre-dump is merged into the snapshot's own images.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from .. import deadlines
from ..cgroups import Cgroup
from ..contract import Capture
from ..errors import CriuError
from ..state import Lineage, SnapshotMeta
from . import cgyard, chain, criu, forkcheck, pages
from .images import dump_stats, rearm_expired_timerfds
from .options import dump_opts, fresh_net

LINEAGE_KEPT = 4  # earlier snapshots a workspace remembers, should the newest be released


def _freezer(c: Capture) -> str:
    assert c.source.cgroups is not None
    return Cgroup(c.source.cgroups).freezer_dir


def prepare_dump(c: Capture) -> None:
    """What the frozen dump needs and can be made with the source running: its cgroup yard."""
    assert c.source.process is not None
    with c.stage("dump_yard"):
        cgyard.prepare_dump(c.snap.dir, c.source.process.pid)


def predump_tree(c: Capture) -> None:
    """The source still runs: where the frozen dump would write every page although the kernel
    tracks dirty pages, CRIU's pre-dump writes them now. It stops the tasks (ptrace) only while
    it collects their pages into pipes, and resets the tracking."""
    rec = c.source
    assert rec.process is not None and rec.cgroups is not None
    # A workspace its user paused stays frozen: CRIU could not stop its tasks itself.
    if not (c.delta and c.images_hold_memory and criu.dirty_tracking()) or Cgroup(rec.cgroups).frozen() \
            or _tracked_candidate(c, rec.lineage or Lineage()):
        return
    level = c.snap.dir / chain.PREDUMP
    level.mkdir()
    opts = dump_opts(rec.process.pid, level, _freezer(c), rec.spec.userns)
    opts.ClearField("freeze_cgroup")  # the source is not frozen: CRIU stops it itself, briefly
    opts.track_mem = True
    try:
        with c.stage("predump"):
            criu.request("pre_dump", opts, log=level / "dump.log", env=c.dump_env or None)
    except CriuError:
        # Only an optimisation: the frozen dump then writes every page, as without tracking.
        # CRIU's log stays beside the snapshot's own (predump-failed.log).
        with contextlib.suppress(OSError):
            os.replace(level / "dump.log", c.snap.dir / "predump-failed.log")
        shutil.rmtree(level, ignore_errors=True)
        c.criu["predump_failed"] = 1
        return
    c.criu.update({f"predump_{k}": v for k, v in dump_stats(level).items()})


def dump_tree(c: Capture) -> None:
    """CRIU seizes the tree through its already frozen freezer cgroup, so it never runs between
    the freeze and the dump; what other parts queued for after the dump runs still frozen.
    What CRIU cannot checkpoint is refused first (forkcheck); CRIU runs under the `criu`
    deadline, cut to what is left of the freeze's, and is handed to the freeze's watchdog."""
    rec = c.source
    assert rec.process is not None and rec.cgroups is not None
    forkcheck.check(Cgroup(rec.cgroups).pids(), rec.id)
    images = c.snap.images
    images.mkdir()
    yard = c.snap.dir / cgyard.DUMP_YARD
    opts = dump_opts(rec.process.pid, images, _freezer(c), rec.spec.userns, empty_net=fresh_net(rec.spec),
                     cgroup_yard=yard if yard.is_dir() else None)
    lineage = rec.lineage or Lineage()
    tracking = criu.dirty_tracking()
    predump = c.snap.dir / chain.PREDUMP
    if tracking:
        opts.track_mem = True  # resets the dirty bits, so that the next dump can be incremental
        if predump.is_dir():
            os.symlink(os.path.relpath(predump, images), images / chain.PARENT)
            parent: Path | None = predump
        else:
            parent = _tracked_parent(c, images, lineage)
        if parent is not None:
            opts.parent_img = os.path.relpath(parent, images)
    with c.stage("dump"):
        criu.request("dump", opts, log=images / "dump.log", env=c.dump_env or None,
                     session_hook=lambda s: c.watch(s.pid), timeout=min(deadlines.current().criu, c.left()))
    c.criu.update(dump_stats(images))
    # Every dump resets the tracking: whatever the snapshot's fate, the next one starts from it.
    rec.lineage = Lineage((c.snap.meta.id, *lineage.snapshots[:LINEAGE_KEPT - 1]), tracked=tracking)
    rec.save()
    for step in c.after_dump:
        step()
    # Image fix-ups need not hold the source frozen, nor what every clone's restore reuses.
    c.after_thaw.append(lambda: rearm_expired_timerfds(images))
    if c.delta and c.dedupe:
        c.after_thaw.append(lambda: _dedupe(c, lineage))
    else:
        _record_parent(c)


def _tracked_candidate(c: Capture, lineage: Lineage) -> bool:
    """Whether lineage's newest snapshot can be CRIU's parent: this workspace's previous dump,
    which reset the dirty bits, retained, and dumped the same way (the cow engine's dump leaves
    anonymous memory out: its parent lacks those pages)."""
    if not (lineage.tracked and lineage.snapshots):
        return False
    d = chain.snapshot_dir(lineage.snapshots[0])
    try:
        return not chain.released(d) and SnapshotMeta.load(d).memory == c.snap.meta.memory
    except (FileNotFoundError, ValueError):
        return False


def _tracked_parent(c: Capture, images: Path, lineage: Lineage) -> Path | None:
    """lineage's newest snapshot, linked as CRIU's parent, where _tracked_candidate allows."""
    if not (c.delta and _tracked_candidate(c, lineage)):
        return None
    return chain.adopt(images, lineage.snapshots[0])


def _record_parent(c: Capture) -> None:
    p = chain.external_parent(c.snap.dir)
    c.snap.meta.parent = p.parent.name if p is not None else None


def _adopt_lineage(level: Path, lineage: Lineage) -> Path | None:
    for snap_id in lineage.snapshots:
        if (p := chain.adopt(level, snap_id)) is not None:
            return p
    return None


def _dedupe(c: Capture, lineage: Lineage) -> None:
    images = c.snap.images
    predump = c.snap.dir / chain.PREDUMP
    with c.stage("dedupe"):
        if predump.is_dir():
            # The pre-dump holds the pages; the frozen dump, those written since. Compare the
            # pre-dump's with the parent's, then fold what remains of it into the images.
            parent = _adopt_lineage(predump, lineage)
            if parent is not None:
                pages.dedupe(predump)
            merged = c.snap.dir / "images.merged"
            pages.squash(images, merged, until=parent)
            if parent is not None:
                os.symlink(os.path.relpath(parent, images), merged / chain.PARENT)
            chain.replace_levels(c.snap.dir, merged)
        elif chain.parent_images(images) is None:
            _adopt_lineage(images, lineage)
        if chain.parent_images(images) is not None:
            stats = pages.dedupe(images)
            c.criu["pages_kept"] = stats.pages_kept
            if not stats.pages_in_parent:
                chain.unlink(images)
    _record_parent(c)
