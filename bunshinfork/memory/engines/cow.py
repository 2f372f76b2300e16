"""cow: the bunshin kernel module maps the source's pages copy-on-write into each clone."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ...cgroups import Cgroup
from ...contract import Build, Capture, Captured, Check
from ...errors import ForkError
from .. import cow, holders, materialize
from .base import PAGE, Engine, best, register


def check_cow_module() -> Check:
    if cow.available():
        return Check(cow.DEVICE, True, "copy-on-write kernel module loaded", required=False)
    return Check(cow.DEVICE, False, f'absent: memory="auto" will use {best().name}; build with '
                 "`make -C kernel` and insmod on hosts that can load modules", required=False)


class Cow(Engine):
    """The bunshin module maps the source's pages copy-on-write into each clone (/dev/bunshin).

    The dump writes no anonymous private pages (criu/patches/0001): holders, taken while the
    source is still frozen after the dump, keep them, and CRIU's pre-resume hands them to each
    restored process."""

    name = "cow"
    kind = "cow"
    rank = 2
    probes = (check_cow_module,)

    def unavailable_reason(self) -> str:
        return "" if cow.available() else cow.unavailable_reason()

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


register(Cow())
