"""Saved snapshots kept loaded between starts (e2b/kept.py, what bunshin serve's creates fork
from): loaded once for many starts, each clone still restored for its own start; loaded afresh
once the directory holds another save; not found once deleted; released when forgotten,
evicted (after the forks in flight) or closed, leaving nothing (the leak census checks)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshinfork import Snapshot, Workspace, WorkspaceSpec
from bunshinfork.e2b import kept as kept_mod
from bunshinfork.errors import TemplateNotFound


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("kept")
    with Workspace.create(WorkspaceSpec()) as ws:
        ws.files.write("/root/mark.txt", "from the source")
        snap = ws.snapshot("copy")
        try:
            for name in ("a", "b", "gone"):
                snap.save(str(root / name)).result(timeout=120)  # type: ignore[union-attr]
        finally:
            snap.release()
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Snapshot]:
    """Every Snapshot.load kept.py makes, in order."""
    made: list[Snapshot] = []
    real = Snapshot.load

    def counted(path: str | os.PathLike[str], memory: str | None = None) -> Snapshot:
        s = real(path, memory)
        made.append(s)
        return s

    monkeypatch.setattr(kept_mod.Snapshot, "load", staticmethod(counted))
    return made


def _start(k: kept_mod.Kept, d: Path) -> None:
    c = k.fork_one(d, d.name, timeout=None)
    try:
        assert c.files.read("/root/mark.txt") == "from the source"
    finally:
        c.destroy()


def test_starts_share_one_load_until_closed(saved: Path, loads: list[Snapshot]) -> None:
    k = kept_mod.Kept()
    try:
        for _ in range(3):
            _start(k, saved / "a")
        assert len(loads) == 1 and len(k) == 1
    finally:
        k.close()
    assert loads[0]._released and len(k) == 0


def test_a_directory_saved_again_is_loaded_afresh(saved: Path, loads: list[Snapshot]) -> None:
    k = kept_mod.Kept()
    try:
        _start(k, saved / "a")
        meta = saved / "a" / Snapshot.layout.meta
        text = meta.read_text()
        meta.unlink()
        meta.write_text(text)  # another file where the meta was: another save
        _start(k, saved / "a")
        assert len(loads) == 2 and loads[0]._released and not loads[1]._released
    finally:
        k.close()


def test_a_deleted_snapshot_is_not_found_and_a_forgotten_one_released(saved: Path, loads: list[Snapshot]) -> None:
    k = kept_mod.Kept()
    gone = saved / "gone"
    try:
        _start(k, gone)
        k.forget(gone)
        assert loads[0]._released and len(k) == 0
        shutil.rmtree(gone)
        with pytest.raises(TemplateNotFound):
            k.fork_one(gone, "gone", timeout=None)
    finally:
        k.close()


def test_the_oldest_is_evicted_and_released_after_its_forks(saved: Path, loads: list[Snapshot],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    k = kept_mod.Kept(capacity=1)
    real_fork = Snapshot.fork
    during: list[bool] = []

    def fork_loading_another(self: Snapshot, *a: object, **kw: object) -> list:
        if self is loads[0] and not during:
            during.append(True)
            _start(k, saved / "b")  # evicts "a" while a's fork is in flight
            during.append(self._released)
        return real_fork(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Snapshot, "fork", fork_loading_another)
    try:
        _start(k, saved / "a")
        assert during == [True, False]  # not released under its own fork
        assert loads[0]._released and not loads[1]._released and len(k) == 1
    finally:
        k.close()
    assert all(s._released for s in loads)
