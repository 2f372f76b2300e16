"""A saved snapshot loaded on the host where its original still lives must never release the
original: the loaded copy carries the original's id, and its release, keyed by that id, marked
the original's state directory released; the next release beside it (a clone of the original
destroyed) then removed the original's frozen layer, and the original's forks failed with
'mount /run/bunshin/ws-.../rootfs: No such file or directory'. tests/test_fork.py's
test_a_loaded_copy_never_releases_its_original covers Snapshot.load in both orders; here the
mechanism on its own (no workspace), and the other entrances that load: AsyncSnapshot.load and
`bunshin fork --snapshot`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from bunshinfork import AsyncSnapshot, Snapshot, Workspace, state
from bunshinfork.cli import main
from bunshinfork.contract import Captured
from bunshinfork.errors import BunshinError
from bunshinfork.fs import FsPart, frozen, layers
from bunshinfork.spec import WorkspaceSpec
from bunshinfork.state import FsState, Layer, Rootfs, SnapshotMeta


def _layer(path: Path) -> Layer:
    (path / "upper").mkdir(parents=True)
    (path / "work").mkdir()
    return Layer("dir", str(path))


def test_a_loaded_copys_release_leaves_the_original_unmarked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fs part alone, on a state root and storage of the test's own: the original's state
    directory gets no RELEASED marker from its loaded copy's release, so a clone of the original
    released afterwards leaves the original's frozen layer in place."""
    monkeypatch.setattr(state, "RUN_ROOT", tmp_path / "run")
    snaps = tmp_path / "storage" / layers.SNAPSHOTS
    snap_id = state.new_snapshot_id()
    rootfs = Rootfs("host", ("/",), "d", "host")
    original_layer = _layer(snaps / snap_id)
    meta = SnapshotMeta(id=snap_id, source="ws-000000000000", created_at=time.time(), owner_pid=0,
                        hostname="h", spec=WorkspaceSpec(), memory="copy", fs=FsState(rootfs, original_layer))
    original_dir = state.RUN_ROOT / state.SNAPSHOTS / snap_id
    original_dir.mkdir(parents=True)
    meta.save(original_dir)

    imported = _layer(snaps / f"{frozen.LOADED}0-000000000000")
    loaded = SimpleNamespace(id=snap_id, fs=FsState(rootfs, imported))  # load() keeps the id
    FsPart().release(Captured(cast(Any, loaded), tmp_path / "saved", owned=False))
    assert not Path(imported.path).exists(), "the loaded copy's own layer goes with it"
    assert not (original_dir / state.RELEASED).exists(), "the loaded copy marked its original released"

    # A clone of the original, released now, must not take the original's layer with it.
    frozen.drop_unused([original_layer], exclude="ws-000000000001")
    assert Path(original_layer.path).is_dir()


def _survives(original: Snapshot, live: Workspace, load_and_release: Any) -> None:
    """A copy of `original` loaded and released (by `load_and_release`) while `live` (a clone of
    the original) runs; then `live` destroyed: the original still forks, its files whole."""
    load_and_release()
    live.destroy()
    [again] = original.fork(1)
    try:
        assert isinstance(again, Workspace), again
        assert again.files.read("/root/mark") == "kept"
    finally:
        if isinstance(again, Workspace):
            again.destroy()


def test_async_and_cli_loads_never_release_the_original(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Workspace.create() as ws:
        ws.files.write("/root/mark", "kept")
        with ws.snapshot() as original:
            saved = original.save(tmp_path / "saved").result(timeout=120)

            async def async_load() -> None:
                loaded = await AsyncSnapshot.load(saved)
                [clone] = await loaded.fork(1)
                try:
                    assert not isinstance(clone, Exception), clone
                    assert await clone.files.read("/root/mark") == "kept"
                finally:
                    if not isinstance(clone, Exception):
                        await clone.destroy()
                    await loaded.release()

            [live] = original.fork(1)
            assert isinstance(live, Workspace), live
            _survives(original, live, lambda: asyncio.run(async_load()))

            def cli_fork() -> None:
                rc = main(["fork", "--snapshot", saved, "--memory", "copy", "--json"])
                out, err = capsys.readouterr()
                clones = json.loads(out)["clones"] if out.strip() else []
                try:
                    assert rc == 0 and len(clones) == 1, err
                finally:
                    for c in clones:
                        with contextlib.suppress(BunshinError):
                            Workspace.connect(c).destroy()

            [live] = original.fork(1)
            assert isinstance(live, Workspace), live
            _survives(original, live, cli_fork)
