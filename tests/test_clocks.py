"""Clocks across a fork: CRIU restores each clone into a time namespace of its own whose offsets
continue the dumped CLOCK_MONOTONIC and CLOCK_BOOTTIME, so a process timing something sees no
jump, not even when a saved snapshot is loaded a minute after its source was destroyed;
CLOCK_REALTIME is not namespaced and stays the host's.

One recorder process in the source appends its three clocks and its time namespace every 100
ms to a file; the file and the process go into every clone, so each clone's file holds the one
series across every fork it descends from, its samples told apart by their time namespace.
The module's fixture does all the forking and the one 60 s wait the saved snapshot needs (the
live forks are checked on the same timeline); the tests read it."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fork_support import COW, forked
from helpers import wait_for

from bunshinfork import Snapshot, Workspace

LOG = "/root/clocks"
RECORDER = f"""
import os, time
fd = os.open({LOG!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
while True:
    # One write per sample: a freeze falls between two system calls, never inside a line.
    os.write(fd, ("%.6f %.6f %.6f %d\\n" % (time.clock_gettime(time.CLOCK_MONOTONIC),
                  time.clock_gettime(time.CLOCK_BOOTTIME), time.time(),
                  os.stat("/proc/self/ns/time").st_ino)).encode())
    time.sleep(0.1)
"""
GAP = 60.0  # host seconds between the saved snapshot's dump and its load
# The largest step a continuing series may show across a fork, beyond the time the fork itself
# held the lineage frozen: a clone's clocks may advance by the freeze and the restore (real time
# passed for its process too), never by the saved snapshot's GAP. Under TCG in the guest a cow
# restore alone takes seconds, so a fixed bound would measure the emulator, not the clocks.
MAX_STEP = 2.0
AFTER = 5  # samples a clone must have recorded itself


Sample = tuple[float, float, float, int]  # monotonic, boottime, realtime, time namespace


@dataclass
class Series:
    """A clone's samples: those recorded in its own time namespace (the newest sample's), after
    those it inherited."""
    samples: list[Sample]

    def own(self) -> list[Sample]:
        return [s for s in self.samples if s[3] == self.samples[-1][3]]

    def inherited(self) -> list[Sample]:
        return [s for s in self.samples if s[3] != self.samples[-1][3]]

    def namespaces(self) -> list[int]:
        """Its time namespaces in the order the samples went through them."""
        return [s[3] for i, s in enumerate(self.samples) if i == 0 or self.samples[i - 1][3] != s[3]]


def read(ws: Workspace) -> list[Sample]:
    rows = [line.split() for line in str(ws.files.read(LOG)).splitlines()]
    return [(float(m), float(b), float(r), int(ns)) for m, b, r, ns in rows]


def recorded(ws: Workspace, parent: Series) -> Series:
    """The clone's series once it has recorded AFTER samples of its own. Its own are those in a
    time namespace its parent's series never showed: until the restored recorder's first write,
    the newest samples in its file are the parent's, and a fast fork returns before that write."""
    def ready() -> bool:
        series = Series(read(ws))
        return series.samples[-1][3] not in parent.namespaces() and len(series.own()) >= AFTER
    wait_for(ready, timeout=60, interval=0.1)
    return Series(read(ws))


@dataclass
class Timeline:
    clone: Series  # a live fork of the source
    clone_of_clone: Series  # a live fork of that clone
    loaded: Series  # a clone of a snapshot saved, its source destroyed, and loaded GAP s later
    gap: float  # host monotonic seconds between that snapshot and its load
    frozen: float  # the longest fork, snapshot or load+fork call (host seconds), which a step may include
    host_realtime: float  # the host's realtime when the loaded clone's series was read


@pytest.fixture(scope="module", params=["auto", COW])
def timeline(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Timeline]:
    engine = request.param
    saved = tmp_path_factory.mktemp("clocks") / "saved"
    clones: list[Workspace] = []
    try:
        with Workspace.create() as src:
            src.commands.run(["python3", "-c", RECORDER], background=True)
            wait_for(lambda: src.files.exists(LOG) and len(read(src)) >= AFTER, timeout=30, interval=0.1)
            took: list[float] = []
            source = Series(read(src))
            t0 = time.monotonic()
            clones += forked(src.fork(1, engine))
            took.append(time.monotonic() - t0)
            clone = recorded(clones[0], source)
            t0 = time.monotonic()
            clones += forked(clones[0].fork(1, engine))
            took.append(time.monotonic() - t0)
            clone_of_clone = recorded(clones[1], clone)
            t0 = time.monotonic()
            with src.snapshot(engine) as snap:
                dumped = time.monotonic()
                took.append(dumped - t0)
                snap.save(saved).result(timeout=300)
        # The source is destroyed; what is left of it is on disk. Host time must pass: the
        # subject of the test, not a stand-in for a condition to poll.
        time.sleep(max(0.0, GAP - (time.monotonic() - dumped)))
        t0 = time.monotonic()
        with Snapshot.load(saved) as snap:
            gap = time.monotonic() - dumped
            clones += forked(snap.fork(1))
        took.append(time.monotonic() - t0)
        loaded = recorded(clones[2], source)
        yield Timeline(clone, clone_of_clone, loaded, gap, max(took), time.time())
    finally:
        for c in clones:
            c.destroy()
        shutil.rmtree(saved, ignore_errors=True)


def steps(samples: list[Sample], clock: int) -> list[float]:
    return [b[clock] - a[clock] for a, b in itertools.pairwise(samples)]


def assert_continues(series: Series, frozen: float) -> None:
    """Monotonic and boottime rise through the inherited samples into the clone's own, by no
    step over MAX_STEP plus the longest freeze (`frozen`) the lineage went through."""
    assert len(series.inherited()) >= AFTER and len(series.own()) >= AFTER
    # The clone runs in a time namespace of its own, not its source's.
    assert len(set(series.namespaces())) == len(series.namespaces()) >= 2, series.namespaces()
    for clock, name in ((0, "CLOCK_MONOTONIC"), (1, "CLOCK_BOOTTIME")):
        s = steps(series.samples, clock)
        assert min(s) > 0, f"{name} went backwards: {min(s):.3f} s"
        assert max(s) <= MAX_STEP + frozen, f"{name} stepped {max(s):.3f} s (forks held it {frozen:.3f} s)"


def test_a_live_forks_clone_continues_monotonic_and_boottime(timeline: Timeline) -> None:
    assert_continues(timeline.clone, timeline.frozen)


def test_a_clone_of_a_clone_continues_them(timeline: Timeline) -> None:
    assert_continues(timeline.clone_of_clone, timeline.frozen)
    # Its series holds the source's samples, then the first clone's, then its own.
    assert timeline.clone_of_clone.namespaces()[:2] == timeline.clone.namespaces()[:2]
    assert len(timeline.clone_of_clone.namespaces()) == 3


def test_a_saved_snapshot_loaded_a_minute_later_continues_them(timeline: Timeline) -> None:
    assert timeline.gap >= GAP
    # The bound stays far below the gap: a clone re-based on the host's clock would step by GAP.
    assert MAX_STEP + timeline.frozen < GAP / 2, timeline.frozen
    assert_continues(timeline.loaded, timeline.frozen)


def test_realtime_stays_the_hosts(timeline: Timeline) -> None:
    """CLOCK_REALTIME is not in the time namespace: across the saved snapshot's gap it jumps by
    the host's gap, and the clone's newest sample is the host's time."""
    before, after = timeline.loaded.inherited()[-1], timeline.loaded.own()[0]
    assert after[2] - before[2] >= GAP
    newest = timeline.loaded.samples[-1][2]
    assert timeline.host_realtime - MAX_STEP <= newest <= timeline.host_realtime
    for series in (timeline.clone, timeline.clone_of_clone):
        assert series.own()[-1][2] <= time.time()
