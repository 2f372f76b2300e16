"""Memory subsystem (paper §4.4): how a clone's anonymous memory relates to its source's.

Engines (engines.py):
- "copy": plain CRIU restore, a private copy per clone (the paper's CRIU baseline).
- "ksm":  the same restore, with every restored process opted into kernel samepage merging,
          which deduplicates the clones' identical pages after the fact (ksm.py).
- "cow":  the bunshin kernel module maps the source's pages copy-on-write (cow.py, holders.py;
          needs /dev/bunshin).
- "auto": cow when /dev/bunshin exists, else ksm where processes can opt in (Linux 6.4),
          else copy.

The engine is chosen once, when a snapshot is taken, and recorded in it; this package is
the only place that reads its name.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..contract import Build, Capture, Captured, Check, Held, Part
from ..errors import KernelFeatureError, SpecError
from . import cow, ksm
from .engines import ENGINES, Engine

__all__ = ["ENGINES", "MemoryPart", "for_fork", "for_images", "resolve"]

NAMES = ("copy", "ksm", "cow")


def resolve(name: str) -> str:
    """The engine `name` stands for on this host; raises where it cannot run here."""
    if name == "auto":
        if cow.available():
            return "cow"
        return "ksm" if ksm.merge_supported() else "copy"
    if name not in NAMES:
        raise SpecError(f"unknown memory engine {name!r}; use 'auto', 'copy', 'ksm' or 'cow'")
    if name == "cow" and not cow.available():
        raise KernelFeatureError(cow.unavailable_reason())
    if name == "ksm" and (why := ksm.unavailable_reason()):
        raise KernelFeatureError(f"memory='ksm' is unavailable: {why}")
    return name


def _image_engine() -> str:
    return "ksm" if ksm.merge_supported() else "copy"


def for_images(saved: str) -> str:
    """The engine a saved snapshot (its memory in complete images) records once loaded here: the
    one it was taken with where images serve it and this host runs it, else the best image engine."""
    if saved in ("copy", "ksm") and (saved == "copy" or ksm.merge_supported()):
        return saved
    return _image_engine()


def for_fork(snap: str, snap_id: str, name: str | None) -> str:
    """The engine a fork of a snapshot recorded with `snap` restores with. None or 'auto' is the
    snapshot's own; another engine must be able to restore it (copy and ksm both restore from
    images), else it is a clear error."""
    if name in (None, "auto", snap):
        return snap
    name = resolve(name)
    if kind(name) == kind(snap):
        return name
    if snap == "cow":
        raise SpecError(f"snapshot {snap_id} keeps its memory for the cow engine; fork it with memory='cow' "
                        f"or 'auto', or take the snapshot with memory={name!r}")
    raise SpecError(f"snapshot {snap_id} holds its memory in images; take it with memory='cow' to fork "
                    "copy-on-write")


def engine(snap: Captured) -> Engine:
    """The engine the snapshot was taken for."""
    return ENGINES[snap.meta.memory]


def kind(name: str) -> str:
    return ENGINES[name].kind


def held_bytes(snap: Captured) -> int:
    return engine(snap).held_bytes(snap)


def write_images(snap: Captured, dest: Path) -> None:
    engine(snap).write_images(snap, dest)


def check_ksm() -> Check:
    run_file = ksm.KSM / "run"
    if not run_file.exists():
        return Check("ksm", False, "/sys/kernel/mm/ksm is absent (kernel without CONFIG_KSM)", required=False)
    try:
        run = run_file.read_text().strip()
    except OSError as e:
        run = f"unreadable ({e.strerror})"
    meaning = {"0": "stopped", "1": "running", "2": "unmerging"}.get(run, "")
    detail = f"run={run}" + (f" ({meaning})" if meaning else "")
    if why := ksm.unavailable_reason():
        return Check("ksm", False, f"{detail}; {why}, so memory='ksm' and ksm=True are unavailable",
                     required=False)
    return Check("ksm", True, f"{detail}; prctl(PR_GET_MEMORY_MERGE) works", required=False)


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


def check_cow_module() -> Check:
    if cow.available():
        return Check(cow.DEVICE, True, "copy-on-write kernel module loaded", required=False)
    return Check(cow.DEVICE, False, f'absent: memory="auto" will use {resolve("auto")}; build with '
                 "`make -C kernel` and insmod on hosts that can load modules", required=False)


class MemoryPart(Part):
    name = "memory"
    probes = (check_ksm, check_userfaultfd, check_cow_module)

    def prepare(self, b: Build) -> None:
        # spec.ksm: the workspace's processes opt in, so that a ksm fork can merge it with its clones.
        b.ksm_merge = b.rec.spec.ksm

    def capture(self, c: Capture) -> None:
        engine(c.snap).capture(c)

    def restore(self, b: Build) -> None:
        assert b.source is not None
        ENGINES[b.memory or b.source.meta.memory].restore(b)

    def release(self, held: Held) -> None:
        if isinstance(held, Captured):
            engine(held).release(held)

    def gc(self) -> list[str]:
        """ksmd boosted for a process that was killed: drop it, and restore the knobs when none is left."""
        return [f"ksm boost of pid {pid}" for pid in ksm.prune()]
