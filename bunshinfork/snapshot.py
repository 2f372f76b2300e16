"""A snapshot: every subsystem's capture within one short freeze of the source.

What can be done with the source running is done first (each part's before_freeze: the file
system writes back its dirty data, CRIU pre-dumps where the kernel tracks dirty pages). The
source is then frozen through its cgroup; each part captures its share in pipeline.CAPTURE
order (CRIU dumps the process tree, leaving it running; the memory engine keeps what the dump
leaves out; the private file-system layer is frozen); the source resumes, the images are
compacted against their parent, and only then is any clone built. save() and load() make a
snapshot durable in a directory of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import deadlines, fs, memory, network, pipeline, state
from .cgroups import Cgroup, watchdog
from .contract import Capture, Captured
from .errors import CgroupError, CriuError, DeadlineExceeded, ForkError, ForkTimeout, SpecError
from .process import chain
from .process.images import LOG_SUFFIX, PAGES_PREFIX
from .state import Record, SnapshotMeta, Timing

_saver = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bunshin-save")
# Our own steps inside a freeze end this long before the watchdog's `frozen` deadline, so that
# the watchdog acts only when we cannot (killed, stuck).
FREEZE_MARGIN = 1.0


def take(rec: Record, engine: str, *, delta: bool = True, dedupe: bool = True) -> Captured:
    """Freeze `rec`'s workspace briefly and capture it for the memory engine `engine` (resolved).
    delta: its pages may be stored as a delta against the snapshot the workspace's memory last
    matched; dedupe: compare the pages CRIU wrote with that one's after the thaw (Capture)."""
    assert rec.cgroups is not None
    meta = SnapshotMeta(id=state.new_snapshot_id(), source=rec.id, created_at=time.time(), owner_pid=os.getpid(),
                        hostname=rec.hostname, spec=rec.spec, memory=engine)
    snap = Captured(meta, state.snapshots_root() / meta.id)
    snap.dir.mkdir(parents=True)
    meta.save(snap.dir)  # owner recorded first, so gc never takes a snapshot still being made
    c = Capture(rec, snap, delta=delta, dedupe=dedupe)
    cg = Cgroup(rec.cgroups)
    dl = deadlines.current()
    # A workspace the user paused stays paused, and its freeze is not ours to watch.
    was_paused = cg.frozen()
    try:
        for part in pipeline.capture_order():
            part.before_freeze(c)
        c.started = time.monotonic()
        c.until = c.started + dl.frozen - FREEZE_MARGIN
        guard = contextlib.nullcontext() if was_paused else watchdog.guard(cg.freezer_dir, dl.frozen, rec.id)
        with guard as wd:
            if wd is not None:
                c.watch = wd.register
            with c.stage("freeze"):
                cg.freeze(dl.freeze)
            try:
                for part in pipeline.capture_order():
                    part.capture(c)
            finally:
                c.dumped = time.monotonic()
                if not was_paused:
                    with c.stage("thaw"):
                        cg.thaw(dl.freeze)
        thawed = time.monotonic()
        for step in c.after_thaw:
            step()
    except BaseException as e:
        pipeline.release(snap)
        if isinstance(e, DeadlineExceeded):
            raise ForkTimeout(f"snapshot of {rec.id} ran past its deadline; the workspace was thawed and "
                              f"keeps running: {e}") from e
        if isinstance(e, (CriuError, CgroupError)):
            raise ForkError(f"snapshot of {rec.id} failed; the workspace keeps running: {e}") from e
        raise
    meta.timing = Timing(frozen_seconds=thawed - c.started, dump_seconds=c.dumped - c.started,
                         stages=dict(c.stages), criu=dict(c.criu))
    meta.save(snap.dir)
    return snap


def file_bytes(snap: Captured) -> int:
    """Its own images and file-system layer, by file size: what a snapshot keeps whatever its
    source does later. Pages its images read from a parent are the parent's."""
    layer = snap.meta.fs.layer if snap.meta.fs else None
    paths = [snap.dir]
    if layer is not None and not Path(layer.path).is_relative_to(snap.dir):
        paths.append(Path(layer.path))  # a btrfs snapshot lives beside the other layers
    return sum(state.tree_bytes(p) for p in paths)


def pinned_bytes(snap: Captured) -> int:
    """Its share of released snapshots that stay on the host because its images read their pages."""
    return chain.pinned_bytes(snap.dir) if snap.owned else 0


def save(snap: Captured, path: str | os.PathLike[str], incremental: bool = False) -> Future[str]:
    """Write a durable copy to `path` (a new directory) in the background: complete, or with
    `incremental` only the snapshot's own pages where its images read the rest from a parent."""
    dest = Path(path)
    if dest.exists():
        raise SpecError(f"{dest} already exists; save() writes a new directory")

    def write() -> str:
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            delta = memory.write_images(snap, tmp / LAYOUT.images, incremental and snap.meta.parent is not None)
            assert snap.meta.fs is not None
            if (snap.dir / network.CAPTURE_FILE).exists():
                shutil.copy2(snap.dir / network.CAPTURE_FILE, tmp / network.CAPTURE_FILE)
            dataclasses.replace(snap.meta, fs=fs.save(snap.meta.fs, tmp),
                                parent=snap.meta.parent if delta else None).save(tmp)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return str(dest)

    return _saver.submit(write)


def load(path: str | os.PathLike[str], engine: str | None = None) -> Captured:
    """A snapshot written by save(), used in place: release() never deletes it. `engine`: what
    its clones fork with (None: the engine it was taken with, where its images serve it). One
    saved incrementally needs its parent's saved images at LAYOUT.parent."""
    d = Path(path)
    try:
        meta = SnapshotMeta.load(d)
    except FileNotFoundError:
        raise SpecError(f"{d} holds no saved snapshot ({SnapshotMeta.FILE} missing)") from None
    except ValueError as e:
        raise SpecError(f"{d} holds no snapshot this version can read: {e}") from e
    if meta.parent is not None and not (d / LAYOUT.parent).is_dir():
        raise SpecError(f"{d} holds snapshot {meta.id} saved as a delta against {meta.parent}: put the saved "
                        f"images of {meta.parent} at {LAYOUT.parent} first")
    assert meta.fs is not None
    meta.fs = fs.load(meta.fs, d, meta.id, meta.spec.storage_dir)
    meta.memory = memory.for_fork(memory.for_images(meta.memory), meta.id, engine)
    return Captured(meta, d, owned=False)


@dataclass(frozen=True)
class SavedLayout:
    """What a saved snapshot's directory holds, for tools that store or ship them (bunshinrl's
    delta store): paths are relative to the directory."""

    meta: str = SnapshotMeta.FILE
    images: str = "images"  # CRIU's images
    fs: str = fs.SAVED_LAYER  # the private layer, overlay whiteouts and xattrs included
    # Where a snapshot saved with incremental=True (its meta's parent set) reads the pages it
    # does not hold: the images directory of its parent's saved copy, moved or linked there.
    parent: str = f"images/{chain.PARENT}"

    def is_page_image(self, rel: str) -> bool:
        """CRIU's page contents, rewritten whole by every dump even where few pages changed."""
        name = os.path.basename(rel)
        return rel.startswith(self.images + "/") and name.startswith(PAGES_PREFIX) and name.endswith(".img")

    def is_log(self, rel: str) -> bool:
        """CRIU's logs: differ on every dump, and no restore reads them."""
        return rel.startswith(self.images + "/") and rel.endswith(LOG_SUFFIX)


LAYOUT = SavedLayout()
