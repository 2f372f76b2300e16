"""Memory subsystem (paper §4.4): how a clone's anonymous memory relates to its source's.

Engines (engines/, one module each, registered in ENGINES):
- "copy": plain CRIU restore, a private copy per clone (the paper's CRIU baseline).
- "ksm":  the same restore, with every restored process opted into kernel samepage merging,
          which deduplicates the clones' identical pages after the fact (ksm.py).
- "cow":  the bunshin kernel module maps the source's pages copy-on-write (cow.py, holders.py;
          needs /dev/bunshin).
- "auto": the available engine of the highest rank: cow when /dev/bunshin exists, else ksm
          where processes can opt in (Linux 6.4), else copy.

The engine is chosen once, when a snapshot is taken, and recorded in it; this package is
the only place that reads its name, and ENGINES the only list of them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..contract import Build, Capture, Captured, Check, Held, Part
from ..errors import KernelFeatureError, SpecError
from . import ksm, late
from .engines import ENGINES, Engine, best

__all__ = ["ENGINES", "MemoryPart", "for_fork", "for_images", "resolve"]


def resolve(name: str) -> str:
    """The engine `name` stands for on this host; raises where it cannot run here."""
    if name == "auto":
        return best().name
    engine = ENGINES.get(name)
    if engine is None:
        *others, last = (repr(n) for n in ("auto", *ENGINES))
        raise SpecError(f"unknown memory engine {name!r}; use {', '.join(others)} or {last}")
    if why := engine.unavailable_reason():
        raise KernelFeatureError(why)
    return name


def for_images(saved: str) -> str:
    """The engine a saved snapshot (its memory in complete images) records once loaded here: the
    one it was taken with where images serve it and this host runs it, else the best image engine."""
    engine = ENGINES.get(saved)
    if engine is not None and engine.kind == "image" and engine.available():
        return saved
    return best("image").name


def for_fork(snap: str, snap_id: str, name: str | None) -> str:
    """The engine a fork of a snapshot recorded with `snap` restores with. None or 'auto' is the
    snapshot's own; another engine must be able to restore it (copy and ksm both restore from
    images), else it is a clear error."""
    if name in (None, "auto", snap):
        return snap
    name = resolve(name)
    if kind(name) == kind(snap):
        return name
    if kind(snap) != "image":
        raise SpecError(f"snapshot {snap_id} keeps its memory for the {snap} engine; fork it with "
                        f"memory={snap!r} or 'auto', or take the snapshot with memory={name!r}")
    raise SpecError(f"snapshot {snap_id} holds its memory in images; take it with memory={name!r} to fork "
                    f"with it")


def engine(snap: Captured) -> Engine:
    """The engine the snapshot was taken for."""
    return ENGINES[snap.meta.memory]


def kind(name: str) -> str:
    return ENGINES[name].kind


def held_bytes(snap: Captured) -> int:
    return engine(snap).held_bytes(snap)


def write_images(snap: Captured, dest: Path, incremental: bool = False) -> bool:
    """The snapshot's images for a durable save at `dest`; True when only its own pages were
    written (incremental, where its engine keeps all its memory in images)."""
    return engine(snap).write_images(snap, dest, incremental)


def check_userfaultfd() -> Check:
    # The sysctl exists exactly when the kernel was built with CONFIG_USERFAULTFD.
    sysctl = Path("/proc/sys/vm/unprivileged_userfaultfd")
    if Path("/dev/userfaultfd").exists():
        return Check("userfaultfd", True, "/dev/userfaultfd present", required=False)
    if sysctl.exists():
        with contextlib.suppress(OSError):
            return Check("userfaultfd", True, f"syscall available (unprivileged_userfaultfd="
                         f"{sysctl.read_text().strip()})", required=False)
        return Check("userfaultfd", True, "syscall available", required=False)
    return Check("userfaultfd", False, "not available (kernel without CONFIG_USERFAULTFD); CRIU lazy "
                 "restore cannot be used", required=False)


class MemoryPart(Part):
    name = "memory"
    # Each engine's probes, then what lazy restore would need.
    probes = (*(p for e in ENGINES.values() for p in e.probes), check_userfaultfd)

    def prepare(self, b: Build) -> None:
        # spec.ksm: the workspace's processes opt in, so that a ksm fork can merge it with its clones.
        b.ksm_merge = b.rec.spec.ksm

    def before_freeze(self, c: Capture) -> None:
        engine(c.snap).before_freeze(c)
        if engine(c.snap).kind == "image":
            late.plan(c)  # a large source's pages written after the thaw

    def capture(self, c: Capture) -> None:
        engine(c.snap).capture(c)

    def restore(self, b: Build) -> None:
        assert b.source is not None
        ENGINES[b.memory or b.source.meta.memory].restore(b)

    def release(self, held: Held) -> None:
        if isinstance(held, Captured):
            late.release(held)
            engine(held).release(held)

    def gc(self) -> list[str]:
        """ksmd boosted for a process that was killed: drop it, and restore the knobs when none is left."""
        return [f"ksm boost of pid {pid}" for pid in ksm.prune()]
