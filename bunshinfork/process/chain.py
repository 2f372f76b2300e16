"""Parent chains of snapshot images, and when a released snapshot's directory may go.

A snapshot's images may store only the pages that differ from an earlier snapshot's: CRIU's
`parent` link (images/parent -> ../../<parent id>/images) names where the others are, and its
restore reads them from there, level by level (pages.py writes such images; CRIU writes them
itself with --track-mem). A chain therefore outlives the release of its middle: a released
snapshot whose images a retained one still reads keeps its pages (and only them) in place,
marked released, and goes with the last snapshot that reads it, whatever the order of
releases. What it keeps is charged to the retained snapshots that read it (pinned_bytes).

Only snapshots under the snapshots root, owned by this host's processes, are parents; the
chain lock orders linking against removal, across processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .. import state
from ..state import SnapshotMeta
from .images import PAGEMAP_PREFIX, PAGES_PREFIX

PARENT = "parent"  # CRIU's CR_PARENT_LINK
RELEASED = state.RELEASED  # in a released snapshot's directory that others' images still read
IMAGES = "images"
# A level of images below IMAGES inside the same snapshot's directory: CRIU's pre-dump, taken
# with the source running, that the frozen dump's images read (dump.py merges it when it can).
PREDUMP = "predump"
MAX_DEPTH = 64  # CRIU opens every level of a chain on restore: a deeper parent is not linked


def _lock() -> contextlib.AbstractContextManager[None]:
    return state.lock("snapshot-chains")


def _root() -> Path:
    return state.RUN_ROOT / state.SNAPSHOTS


def snapshot_dir(snap_id: str) -> Path:
    return _root() / snap_id


def parent_images(images: Path) -> Path | None:
    """The images directory `images` reads its PE_PARENT pages from, or None."""
    link = images / PARENT
    if not os.path.lexists(link):
        return None
    return Path(os.path.realpath(link))


def depth(images: Path) -> int:
    """Levels below `images` (0: it holds all its pages itself)."""
    n = 0
    p = parent_images(images)
    while p is not None and n <= MAX_DEPTH:
        n += 1
        p = parent_images(p)
    return n


def external_parent(snap_dir: Path) -> Path | None:
    """The first level of images below snap_dir's own (its pre-dump's) in another snapshot."""
    p = parent_images(snap_dir / IMAGES)
    while p is not None and p.parent == snap_dir:
        p = parent_images(p)
    return p


def _parent_name(snap_dir: Path) -> str | None:
    p = external_parent(snap_dir)
    return p.parent.name if p is not None and p.parent.parent == _root() else None


def released(snap_dir: Path) -> bool:
    return (snap_dir / RELEASED).exists()


def adopt(images: Path, parent_id: str) -> Path | None:
    """Link `images` to the images of the retained snapshot `parent_id`, pinning them; None (and
    no link) when that snapshot is gone or released, or its chain is already MAX_DEPTH deep."""
    d = _root() / parent_id
    with _lock():
        pimages = d / IMAGES
        if not pimages.is_dir() or released(d) or not (d / SnapshotMeta.FILE).exists():
            return None
        if depth(pimages) + 1 >= MAX_DEPTH:
            return None
        os.symlink(os.path.relpath(pimages, images), images / PARENT)
    return pimages


def replace_levels(snap_dir: Path, merged: Path) -> None:
    """Put the single level `merged` (already linked to the same external parent) in place of
    snap_dir's images and pre-dump, with no moment at which that parent is not pinned."""
    with _lock():
        shutil.rmtree(snap_dir / IMAGES)
        os.rename(merged, snap_dir / IMAGES)
        shutil.rmtree(snap_dir / PREDUMP, ignore_errors=True)


def unlink(images: Path) -> None:
    """Drop `images`' parent link: it holds every page itself."""
    with _lock(), contextlib.suppress(FileNotFoundError):
        os.unlink(images / PARENT)


def _children() -> dict[str, list[str]]:
    """parent snapshot -> the snapshots whose images link to its own."""
    out: dict[str, list[str]] = {}
    root = _root()
    for name in sorted(os.listdir(root)) if root.is_dir() else []:
        parent = _parent_name(root / name)
        if parent is not None:
            out.setdefault(parent, []).append(name)
    return out


def _trim(snap_dir: Path) -> None:
    """What a released snapshot keeps for the images that read it: its pages and their maps."""
    for entry in os.scandir(snap_dir):
        if entry.name in (IMAGES, PREDUMP, RELEASED, SnapshotMeta.FILE):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    for level in (snap_dir / IMAGES, snap_dir / PREDUMP):
        for entry in os.scandir(level) if level.is_dir() else ():
            name = entry.name
            if name != PARENT and not name.startswith((PAGEMAP_PREFIX, PAGES_PREFIX)):
                os.unlink(entry.path)


def retire(snap_dir: Path) -> None:
    """A released snapshot's directory: removed, then each released parent no other snapshot's
    images read any more; kept (trimmed to its pages, marked released) while some still do."""
    with _lock():
        _retire(snap_dir, _children())


def _retire(d: Path, children: dict[str, list[str]]) -> None:
    while d.exists():
        if children.get(d.name):
            (d / RELEASED).touch()
            _trim(d)
            return
        parent = _parent_name(d)
        state.remove_dir(d)
        if parent is None:
            return
        children[parent].remove(d.name)
        d = _root() / parent
        if not released(d):
            return


def sweep() -> list[str]:
    """Released snapshots that no retained snapshot's images read any more (a reader's owner
    crashed before releasing it)."""
    removed = []
    root = _root()
    with _lock():
        children = _children()
        for name in sorted(os.listdir(root)) if root.is_dir() else []:
            d = root / name
            if released(d) and not children.get(name):
                _retire(d, children)
                removed.append(name)
    return removed


def _ancestors(snap_dir: Path) -> Iterator[Path]:
    """The snapshot directories whose pages snap_dir's images read, nearest first."""
    p = external_parent(snap_dir)
    while p is not None:
        yield p.parent
        p = external_parent(p.parent)


def pinned_bytes(snap_dir: Path) -> int:
    """What released snapshots whose pages this one's images still read keep on the host, split
    evenly among the retained snapshots that read them (so that the shares add up to the whole)."""
    held = []
    for a in _ancestors(snap_dir):
        if not released(a):
            break  # a retained ancestor pays for itself and what it reads
        held.append(a)
    if not held:
        return 0
    total = 0
    with _lock():
        children = _children()
        for r in held:
            readers = _retained_readers(r.name, children)
            if readers:
                total += state.tree_bytes(r) // len(readers)
    return total


def _retained_readers(name: str, children: dict[str, list[str]]) -> list[str]:
    """The retained snapshots that read `name`'s pages, directly or through released ones."""
    out, todo = [], list(children.get(name, ()))
    while todo:
        c = todo.pop()
        if released(_root() / c):
            todo.extend(children.get(c, ()))
        else:
            out.append(c)
    return out
