"""The contract every subsystem implements, and what the pipeline hands each of them.

As CRIU gives each kernel object its own dump, restore and check (timerfd.c has check_timerfd,
dump_one_timerfd and the restore side, while cr-dump.c and cr-restore.c only sequence them),
each subsystem of a workspace (process, memory, fs, network, cgroups) is one Part:

- prepare(build): its share of a new workspace;
- before_freeze(capture): work that keeps its capture short, while the source still runs (writeback, CRIU's pre-dump);
- capture(capture): its share of a snapshot, while the source is frozen;
- restore(build): its share of a clone, from a snapshot;
- release(held): give back what it holds for a workspace or a snapshot (idempotent, and
  fine on a half-built one);
- gc(): remove its host-wide leftovers that no live workspace owns;
- check(): what the host offers it, for `bunshin doctor`.

`create` and `fork` are one assembly over the parts (pipeline.py); a snapshot is the parts'
captures in one freeze (snapshot.py); destroy, gc and doctor are loops over them. A part
reads the state other parts recorded before it, and contributes to later ones only through
the fields of Build and Capture below.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .state import Record, SnapshotMeta


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    required: bool

    @property
    def level(self) -> str:
        if self.ok:
            return "OK"
        return "FAIL" if self.required else "WARN"


Probe = Callable[[], Check]


def run_probe(probe: Probe) -> Check:
    """A probe that crashes is reported as failed rather than aborting the report."""
    try:
        return probe()
    except Exception as e:
        name = getattr(probe, "__name__", "check").removeprefix("check_")
        return Check(name, False, f"check crashed: {type(e).__name__}: {e}", required=False)


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the time the block takes to timings[name] (the fork profile and the snapshot's stages)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.monotonic() - t0


@dataclass
class Captured:
    """A snapshot: its persisted meta, its directory, and what lives only in this process."""

    meta: SnapshotMeta
    dir: Path
    owned: bool = True  # release() removes the directory; a loaded snapshot is used in place
    held: dict[str, Any] = field(default_factory=dict)  # part name -> in-memory state (cow holders)

    @property
    def images(self) -> Path:
        return self.dir / "images"


@dataclass
class Mount:
    """The root overlay of a workspace being built: where it goes and what it stacks."""

    path: Path
    options: str  # lowerdir=...,upperdir=...,workdir=...


@dataclass
class Build:
    """One workspace being assembled: by create (source is None) or by fork (from source)."""

    rec: Record
    source: Captured | None = None
    memory: str = ""  # memory: the engine a clone is restored with (empty: the snapshot's own)
    root: Mount | None = None  # fs: the overlay the process part starts or restores into
    ksm_merge: bool = False  # memory: its processes opt into KSM (inherited by all they start)
    # memory: run in CRIU's pre-resume notification with the clone's host pids, every task
    # still stopped under CRIU's ptrace, before any of them runs again.
    pre_resume: list[Callable[[list[int]], None]] = field(default_factory=list)
    pidfd: int | None = None  # process: the init's pidfd, once it runs
    # network: CRIU --external entries for a clone's restore (the veth whose host end it makes,
    # or a pre-made one it moves in).
    criu_external: list[str] = field(default_factory=list)
    # Run when the build ends, whether it succeeded or not (a mount the host no longer needs,
    # the end of a ksm burst).
    deferred: list[Callable[[], None]] = field(default_factory=list)

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a stage of this build into the workspace's timings (its fork profile)."""
        return timed(self.rec.timings, name)


@dataclass
class Capture:
    """One snapshot being taken: `source` stays frozen while every part's capture() runs."""

    source: Record
    snap: Captured
    # process: its pages may be a delta against a snapshot the source's memory last matched;
    # dedupe: compare the pages CRIU wrote with that snapshot's once the source has resumed
    # (a snapshot forked at once and released skips it).
    delta: bool = True
    dedupe: bool = True
    # memory: False when the engine keeps anonymous memory out of the images (cow's holders):
    # then the dump writes little, and a pre-dump would not shorten the freeze.
    images_hold_memory: bool = True
    dump_env: dict[str, str] = field(default_factory=dict)  # memory: for the CRIU dump
    # memory: run after the CRIU dump, the tree still frozen (CRIU keeps a frozen cgroup frozen).
    after_dump: list[Callable[[], None]] = field(default_factory=list)
    # Run once the source has resumed: work on the captured state that needs no freeze.
    after_thaw: list[Callable[[], None]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    dumped: float = 0.0  # when the dump and what runs after it ended
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (Timing.stages)
    criu: dict[str, int] = field(default_factory=dict)  # CRIU's dump statistics (Timing.criu)
    # time.monotonic() by which every step inside the freeze must be done (deadlines.frozen,
    # less a margin so that the freeze's watchdog acts only when we cannot).
    until: float = math.inf
    # Hands a helper process (CRIU) to the freeze's watchdog, which kills it past the deadline.
    watch: Callable[[int], None] = lambda _pid: None

    def left(self) -> float:
        """Seconds left to `until`, at least a moment, so that a late step fails fast."""
        return max(0.1, self.until - time.monotonic())

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        return timed(self.stages, name)


Held = Build | Captured


class Part:
    """One subsystem. Every method has a default that does nothing: a part overrides the stages
    it takes part in."""

    name: str = ""
    probes: tuple[Probe, ...] = ()

    def prepare(self, b: Build) -> None:
        """A new workspace: set this subsystem up and record its state in b.rec."""

    def before_freeze(self, c: Capture) -> None:
        """The source still runs, about to be frozen: do now what would otherwise lengthen the
        freeze (the file system writes back its dirty data; CRIU pre-dumps pages where the kernel tracks dirty ones)."""

    def capture(self, c: Capture) -> None:
        """The source is frozen: add this subsystem's state to c.snap."""

    def restore(self, b: Build) -> None:
        """A clone of b.source: rebuild this subsystem and record its state in b.rec."""

    def release(self, held: Held) -> None:
        """Give back what this subsystem holds for a workspace (a Build) or a snapshot."""

    def gc(self) -> list[str]:
        """Remove this subsystem's leftovers that no live workspace owns; returns what went."""
        return []

    def check(self) -> list[Check]:
        return [run_probe(p) for p in self.probes]
