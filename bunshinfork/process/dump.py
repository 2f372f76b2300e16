"""Dump a frozen workspace's process tree into a snapshot's images, leaving it running.

A workspace's snapshots store their pages as deltas against the snapshot its memory last
matched (state.Lineage: the one it was forked from, or its previous snapshot). Where the kernel
tracks dirty pages, every dump resets the tracking (--track-mem), and the next one names the
previous as its parent: CRIU then writes only the pages written since, while the source is
frozen. Elsewhere CRIU writes every page and, once the source has resumed, the pages equal to
the parent's are replaced by references to them (pages.dedupe).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..cgroups import Cgroup
from ..contract import Capture
from ..state import Lineage, SnapshotMeta
from . import chain, criu, pages
from .images import dump_stats, rearm_expired_timerfds
from .options import dump_opts

LINEAGE_KEPT = 4  # earlier snapshots a workspace remembers, should the newest be released


def dump_tree(c: Capture) -> None:
    """CRIU seizes the tree through its already frozen freezer cgroup, so it never runs between
    the freeze and the dump; what other parts queued for after the dump runs still frozen."""
    rec = c.source
    assert rec.process is not None and rec.cgroups is not None
    cg = Cgroup(rec.cgroups)
    images = c.snap.images
    images.mkdir()
    opts = dump_opts(rec.process.pid, images, cg.paths.get("freezer") or cg.paths["unified"])
    lineage = rec.lineage or Lineage()
    tracking = criu.dirty_tracking()
    if tracking:
        opts.track_mem = True  # resets the dirty bits, so that the next dump can be incremental
        parent = _tracked_parent(c, images, lineage)
        if parent is not None:
            opts.parent_img = os.path.relpath(parent, images)
    with c.stage("dump"):
        criu.request("dump", opts, log=images / "dump.log", env=c.dump_env or None)
    c.criu.update(dump_stats(images))
    # Every dump resets the tracking: whatever the snapshot's fate, the next one starts from it.
    rec.lineage = Lineage((c.snap.meta.id, *lineage.snapshots[:LINEAGE_KEPT - 1]), tracked=tracking)
    rec.save()
    for step in c.after_dump:
        step()
    # Image fix-ups need not hold the source frozen.
    c.after_thaw.append(lambda: rearm_expired_timerfds(images))
    if c.delta and c.dedupe:
        c.after_thaw.append(lambda: _dedupe(c, images, lineage))
    elif parent_id := _linked_parent(images):
        c.snap.meta.parent = parent_id


def _tracked_parent(c: Capture, images: Path, lineage: Lineage) -> Path | None:
    """The previous snapshot of this workspace, linked as CRIU's parent, when the dirty bits were
    reset by its dump and it was dumped the same way (the cow engine's dump leaves anonymous
    memory out: its parent lacks those pages)."""
    if not (c.delta and lineage.tracked and lineage.snapshots):
        return None
    parent = chain.adopt(images, lineage.snapshots[0])
    if parent is not None and SnapshotMeta.load(parent.parent).memory != c.snap.meta.memory:
        chain.unlink(images)
        return None
    return parent


def _linked_parent(images: Path) -> str | None:
    p = chain.parent_images(images)
    return p.parent.name if p is not None else None


def _dedupe(c: Capture, images: Path, lineage: Lineage) -> None:
    with c.stage("dedupe"):
        if chain.parent_images(images) is None:
            for snap_id in lineage.snapshots:
                if chain.adopt(images, snap_id) is not None:
                    break
            else:
                return
        stats = pages.dedupe(images)
        c.criu["pages_kept"] = stats.pages_kept
        if stats.pages_in_parent:
            c.snap.meta.parent = _linked_parent(images)
        else:
            chain.unlink(images)
