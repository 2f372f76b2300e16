"""What a memory engine is: its share of a snapshot and of a clone, and what it says about this host.

An engine is chosen once, when a snapshot is taken, and recorded in it by name; every clone
of that snapshot is restored with it. The defaults are those of plain CRIU images (copy).
"""

from __future__ import annotations

import os
from pathlib import Path

from ...contract import Build, Capture, Captured, Probe
from ...process import chain, pages

PAGE = os.sysconf("SC_PAGE_SIZE")
# Where a snapshot may keep its anonymous memory: CRIU's page images, or the cow module's holders.
KINDS = ("image", "cow")


class Engine:
    """One memory engine. Subclasses set name, kind and rank, and override the stages they take
    part in; every method but unavailable_reason() has a default that keeps memory in images."""

    name = ""
    # Where a snapshot keeps its anonymous memory: one of KINDS.
    kind = "image"
    # memory='auto' picks the available engine of the highest rank; ranks are distinct.
    rank = 0
    # doctor's probes of what this engine needs from the host (never raise).
    probes: tuple[Probe, ...] = ()

    def unavailable_reason(self) -> str:
        """Why this host cannot run the engine, as the error says it; "" where it can."""
        raise NotImplementedError

    def available(self) -> bool:
        return not self.unavailable_reason()

    def before_freeze(self, c: Capture) -> None:
        pass

    def capture(self, c: Capture) -> None:
        pass

    def restore(self, b: Build) -> None:
        pass

    def held_bytes(self, snap: Captured) -> int:
        """What the memory this process holds for the snapshot costs now, beyond its images."""
        return 0

    def write_images(self, snap: Captured, dest: Path, incremental: bool) -> bool:
        """CRIU images of the snapshot at `dest`, for a durable save: complete (the pages its
        images read from a parent snapshot included), or with `incremental` one level holding
        all but the pages it reads from its parent snapshot, without the parent link (True)."""
        pages.squash(snap.images, dest, until=chain.external_parent(snap.dir) if incremental else None)
        return incremental

    def release(self, snap: Captured) -> None:
        pass


# The one table of engines, by name in rank order (the least preferred first): each engine's
# module registers its instance; engines/__init__.py imports every such module.
ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    if engine.name in ENGINES or any(e.rank == engine.rank for e in ENGINES.values()):
        raise ValueError(f"memory engine {engine.name!r} (rank {engine.rank}) clashes with a registered one")
    ranked = sorted([*ENGINES.values(), engine], key=lambda e: e.rank)
    ENGINES.clear()
    ENGINES.update((e.name, e) for e in ranked)
    return engine


def best(kind: str | None = None) -> Engine:
    """The highest-ranked engine this host runs (of `kind`, where given): what 'auto' stands for."""
    for e in reversed(ENGINES.values()):
        if (kind is None or e.kind == kind) and e.available():
            return e
    raise LookupError(f"no memory engine of kind {kind!r} is available")
