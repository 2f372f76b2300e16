"""Incremental snapshots: a chain of deltas restores what a complete snapshot restores, survives
releases in any order, and costs what changed; the fork profile names every stage."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fork_support import COW, agent, fork_of, own_snapshots, report, start_agent

from bunshinfork import Snapshot, SpecError, Workspace, state
from bunshinfork.memory import ksm
from bunshinfork.pipeline import gc
from bunshinfork.process import chain, criu

PAGE = 4096
DIRTY_PAGES = 64
KSM = pytest.param("ksm", marks=pytest.mark.skipif(ksm.unavailable_reason() is not None,
                                                   reason="needs PR_SET_MEMORY_MERGE"))
# Where the kernel tracks dirty pages (the guest's Debian kernels), CRIU itself writes only the
# pages dirtied since the previous snapshot; `make test-guest` selects this with -m guest.
NO_TRACKING = pytest.mark.skipif(not criu.dirty_tracking(), reason="no soft-dirty tracking here "
                                 "(`criu check --feature mem_dirty_track`); run `make test-guest`")


@pytest.fixture
def src() -> Iterator[Workspace]:
    with Workspace.create() as ws:
        start_agent(ws, 8)
        yield ws


def _state(ws: Workspace) -> dict[str, Any]:
    """Everything the agent checks from the inside, its memory hashed; per-process facts dropped."""
    r = report(ws, sha=True)
    return {k: v for k, v in r.items() if k not in ("timer_expirations", "workers_advancing")}


def _chain(ws: Workspace, memory: str, n: int) -> list[tuple[Snapshot, str]]:
    """n snapshots, DIRTY_PAGES pages rewritten before each; with each, the agent's memory hash."""
    out = []
    for _ in range(n):
        sha = agent(ws, "dirty", pages=DIRTY_PAGES)
        out.append((ws.snapshot(memory), sha))
    return out


def _big_sha(ws: Workspace) -> str:
    return str(agent(ws, "big_sha"))


@pytest.mark.parametrize("memory", ["copy", KSM, COW])
def test_restore_from_a_chain_of_ten_equals_a_full_restore(src: Workspace, memory: str) -> None:
    before = own_snapshots()
    base = src.snapshot(memory)
    snaps = _chain(src, memory, 10)
    full = src.snapshot(memory, incremental=False)
    try:
        tip = snaps[-1][0]
        # Each links to the one before: ten levels of deltas over the first snapshot.
        assert [s.parent for s, _ in snaps] == [base.id] + [s.id for s, _ in snaps[:-1]]
        assert full.parent is None and base.parent is None
        assert chain.depth(tip.images_dir) == 10
        with fork_of(tip, memory=memory) as (a,), fork_of(full, memory=memory) as (b,):
            assert _state(a) == _state(b)
            assert report(a, sha=True)["big_sha"] == snaps[-1][1]
        # A delta costs a small fraction of a complete snapshot of the same workspace (a cow
        # snapshot's memory is its holders': only the pages its images hold are compared).
        assert all(s.image_bytes() < full.image_bytes() / 2 for s, _ in snaps), \
            [(s.image_bytes(), full.image_bytes()) for s, _ in snaps]
        if full.kind == "image":
            assert all(s.retained_bytes() < full.retained_bytes() / 2 for s, _ in snaps)
        # Every snapshot of the chain restores its own state.
        with fork_of(snaps[4][0], memory=memory) as (c,):
            assert _big_sha(c) == snaps[4][1]
    finally:
        for s in (base, *(s for s, _ in snaps), full):
            s.release()
    assert own_snapshots() == before


def test_releasing_the_middle_keeps_descendants_forkable(src: Workspace) -> None:
    before = own_snapshots()
    root = src.snapshot("copy")
    snaps = [root] + [s for s, _ in _chain(src, "copy", 3)]
    tip_sha = _big_sha(src)
    try:
        tip = snaps[-1]
        own = [s.retained_bytes() for s in snaps]
        # Out of order: the root and a middle one first.
        snaps[1].release()
        root.release()
        d1, d0 = (state.snapshots_root() / s.id for s in (snaps[1], root))
        assert chain.released(d1) and chain.released(d0), "their pages are still read"
        assert not any(p.name.startswith("core-") for p in (d0 / "images").iterdir()), "kept only its pages"
        # The nearest retained reader pays for the released levels below it, the tip for itself.
        assert snaps[2].retained_bytes() > own[2] + own[0] / 2 and tip.retained_bytes() == own[3]
        with fork_of(tip) as (c,):
            assert _big_sha(c) == tip_sha
        snaps[2].release()
        assert tip.retained_bytes() > own[3] + own[0] / 2
        with fork_of(tip) as (c,):
            assert _big_sha(c) == tip_sha
    finally:
        for s in snaps:
            s.release()
    # The last reader took every released level with it.
    assert own_snapshots() == before


def test_gc_takes_a_chain_whose_owner_died(src: Workspace) -> None:
    """A crashed owner's snapshots are collected, and with them the released levels they read."""
    root = src.snapshot("copy")
    child = src.snapshot("copy")
    assert child.parent == root.id
    root.release()
    d0, d1 = state.snapshots_root() / root.id, child.dir
    assert chain.released(d0)
    # As if its owner had crashed: a pid that no longer exists.
    meta = state.SnapshotMeta.load(d1)
    meta.owner_pid = _dead_pid()
    meta.save(d1)
    removed = gc()["snapshots"]
    assert child.id in removed and root.id in removed
    assert not d0.exists() and not d1.exists()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_clone_stores_what_differs_from_the_snapshot_it_came_from(src: Workspace) -> None:
    with src.snapshot("copy", incremental=False) as base, fork_of(base) as (clone,):
        agent(clone, "dirty", pages=DIRTY_PAGES)
        with clone.snapshot("copy") as s:
            assert s.parent == base.id
            assert s.retained_bytes() < base.retained_bytes() / 2
            with fork_of(s) as (c,):
                assert _big_sha(c) == _big_sha(clone)


def test_saved_complete_or_as_a_delta(src: Workspace, tmp_path: Path) -> None:
    with src.snapshot("copy") as base:
        sha = agent(src, "dirty", pages=DIRTY_PAGES)
        with src.snapshot("copy") as s:
            assert s.parent == base.id
            full = Path(s.save(tmp_path / "full").result())
            delta = Path(s.save(tmp_path / "delta", incremental=True).result())
            parent = Path(base.save(tmp_path / "parent").result())
    assert sum(f.stat().st_size for f in (delta / "images").iterdir()) < \
        sum(f.stat().st_size for f in (full / "images").iterdir()) / 2
    with pytest.raises(SpecError, match="delta against"):
        Snapshot.load(delta)
    os.rename(parent / Snapshot.layout.images, delta / Snapshot.layout.parent)
    for d in (full, delta):
        with Snapshot.load(d) as loaded, fork_of(loaded) as (c,):
            assert _big_sha(c) == sha


@pytest.mark.guest
@NO_TRACKING
def test_with_dirty_tracking_the_freeze_writes_only_what_changed(src: Workspace) -> None:
    with src.snapshot("copy", incremental=False) as full:
        snaps = _chain(src, "copy", 3)
        try:
            for s, _ in snaps:
                written = s.timing.criu["pages_written"]
                # CRIU skipped the clean pages itself: the agent's 8 MiB are not written again.
                assert s.timing.criu["pages_skipped_parent"] > (8 << 20) // PAGE
                assert written < full.timing.criu["pages_written"] / 4
            with fork_of(snaps[-1][0]) as (c,):
                assert _big_sha(c) == snaps[-1][1]
        finally:
            for s, _ in snaps:
                s.release()


@pytest.mark.guest
@NO_TRACKING
def test_with_dirty_tracking_a_first_snapshot_is_predumped(src: Workspace) -> None:
    """A clone's first snapshot has no dump of its own to be incremental against: CRIU's pre-dump
    writes its pages with the clone running, and the freeze writes only what changed since."""
    with src.snapshot("copy", incremental=False) as base, fork_of(base) as (clone,):
        sha = agent(clone, "dirty", pages=DIRTY_PAGES)
        with clone.snapshot("copy") as s:
            t = s.timing
            assert t.stages["predump"] > 0 and t.criu["predump_pages_written"] > (8 << 20) // PAGE
            assert t.criu["pages_written"] < t.criu["predump_pages_written"] / 4
            # The pre-dump was folded into the snapshot's images, and those compared with base's.
            assert s.parent == base.id and not (s.dir / chain.PREDUMP).exists()
            assert s.retained_bytes() < base.retained_bytes() / 2
            with fork_of(s) as (c,):
                assert _big_sha(c) == sha


@pytest.mark.parametrize("memory", ["copy", COW])
def test_fork_profile_names_every_stage(src: Workspace, memory: str) -> None:
    with src.snapshot(memory) as snap, fork_of(snap, memory=memory) as (c,):
        t = c.info().timings
        stages = {"snapshot.freeze", "snapshot.dump", "snapshot.layer", "fs.layer", "fs.mount", "cgroups",
                  "criu.start", "criu.namespaces", "criu.mounts", "criu.tasks", "criu.creds", "criu.resume",
                  "criu.finish", "process.ready", "network"}
        if memory == "cow":
            stages |= {"snapshot.holders", "memory.share"}
        assert stages <= set(t), stages - set(t)
        assert all(v >= 0 for v in t.values()), t
        criu_total = sum(v for k, v in t.items() if k.startswith("criu."))
        assert criu_total <= t["process"] and t["fs.layer"] + t["fs.mount"] <= t["fs"]
        assert snap.timing.stages["dump"] <= snap.timing.dump_seconds
