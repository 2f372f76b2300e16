"""The memory engines: what each contributes to a snapshot and to a clone.

An engine is chosen once, when a snapshot is taken, and recorded in it by name; every clone
of that snapshot is restored with it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..cgroups import Cgroup
from ..contract import Build, Capture, Captured
from ..errors import ForkError
from ..process import chain, pages
from . import cow, holders, ksm, materialize

PAGE = os.sysconf("SC_PAGE_SIZE")


class Engine:
    """copy: plain CRIU restore, a private copy per clone (the paper's CRIU baseline)."""

    name = "copy"
    # Where a snapshot keeps its anonymous memory: "image" (CRIU's page images) or "cow".
    kind = "image"

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


class Ksm(Engine):
    """The copy restore, with every restored process opted into kernel samepage merging, which
    deduplicates the clones' identical pages after the fact; ksmd is boosted meanwhile."""

    name = "ksm"

    def restore(self, b: Build) -> None:
        ksm.tuner.boost()
        b.deferred.append(ksm.tuner.release)
        b.ksm_merge = True


class Cow(Engine):
    """The bunshin module maps the source's pages copy-on-write into each clone (/dev/bunshin).

    The dump writes no anonymous private pages (criu/patches/0001): holders, taken while the
    source is still frozen after the dump, keep them, and CRIU's pre-resume hands them to each
    restored process."""

    name = "cow"
    kind = "cow"

    def before_freeze(self, c: Capture) -> None:
        c.dump_env.update(cow.DUMP_ENV)
        c.images_hold_memory = False

    def capture(self, c: Capture) -> None:
        assert c.source.cgroups is not None
        cg = Cgroup(c.source.cgroups)

        def take_holders() -> None:
            # The holders image exactly the state the dump describes.
            with c.stage("holders"):
                c.snap.held["memory"] = holders.capture_tree(cg.pids(), cg.freeze, cg.thaw, until=c.until)

        c.after_dump.append(take_holders)

    def _holders(self, snap: Captured) -> dict[int, holders.Holder]:
        return snap.held.get("memory") or {}

    def restore(self, b: Build) -> None:
        assert b.source is not None
        hs = self._holders(b.source)
        if not hs:
            raise ForkError(f"snapshot {b.source.meta.id} has no memory holders left (released, or loaded from disk)")

        def share(pids: list[int]) -> None:
            try:
                holders.share_tree(hs, pids)
            except BaseException as e:
                raise ForkError(f"sharing the snapshot's memory into the clone failed: {e}") from e

        b.pre_resume.append(share)

    def held_bytes(self, snap: Captured) -> int:
        """The pages only its holders still map: those the source wrote since."""
        return sum(h.stats()[1] for h in self._holders(snap).values()) * PAGE

    def write_images(self, snap: Captured, dest: Path, incremental: bool) -> bool:
        # Holders die with this process, and are no chain: read their memory into complete images.
        materialize.complete_images(snap.images, dest, self._holders(snap))
        return False

    def release(self, snap: Captured) -> None:
        for h in self._holders(snap).values():
            with contextlib.suppress(OSError):
                h.release()
        snap.held.pop("memory", None)


ENGINES: dict[str, Engine] = {e.name: e for e in (Engine(), Ksm(), Cow())}
