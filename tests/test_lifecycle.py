"""A workspace record's status is a Status with allowed transitions (runc's containerState):
an illegal move raises a typed error, records saved as plain strings still load, and
WorkspaceInfo.state derives from it. Paused to disk is a status of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bunshinfork import state
from bunshinfork.errors import IllegalTransition, WorkspaceStateError
from bunshinfork.spec import WorkspaceSpec
from bunshinfork.state import TRANSITIONS, Record, Status
from bunshinfork.workspace import info_state


def _record(status: Status | str = Status.CREATING) -> Record:
    return Record(id="ws-000000000000", status=status, creator_pid=0, created_at=0.0, hostname="x",
                  spec=WorkspaceSpec())


def test_every_status_has_its_row() -> None:
    assert set(TRANSITIONS) == set(Status)
    assert all(to in Status for row in TRANSITIONS.values() for to in row)


@pytest.mark.parametrize("start", list(Status))
@pytest.mark.parametrize("to", list(Status))
def test_moves_follow_the_table(start: Status, to: Status) -> None:
    rec = _record()
    # Reach `start` along allowed moves only.
    path = {Status.CREATING: [], Status.RUNNING: [Status.RUNNING], Status.PAUSED: [Status.RUNNING, Status.PAUSED],
            Status.DESTROYED: [Status.DESTROYED]}[start]
    for step in path:
        rec.transition(step)
    assert rec.status is start
    if to in TRANSITIONS[start]:
        rec.transition(to)
        assert rec.status is to
    else:
        with pytest.raises(IllegalTransition, match=f"from {start} to {to}"):
            rec.transition(to)
        assert rec.status is start  # nothing moved


def test_assignment_is_a_checked_transition() -> None:
    rec = _record(Status.RUNNING)
    rec.status = "destroyed"  # a plain string, as older callers write it
    assert rec.status is Status.DESTROYED
    with pytest.raises(IllegalTransition) as e:
        rec.status = Status.RUNNING
    assert isinstance(e.value, WorkspaceStateError)  # callers that catch state errors catch it
    with pytest.raises(ValueError):
        rec.status = "exploded"


def test_a_record_saved_as_strings_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "RUN_ROOT", tmp_path)
    rec = _record(Status.RUNNING)
    rec.dir.mkdir()
    rec.save()
    on_disk = json.loads((rec.dir / "state.json").read_text())
    assert on_disk["status"] == "running"  # the same JSON as before the enum
    loaded = Record.load(rec.id)
    assert loaded.status is Status.RUNNING and loaded == rec
    assert loaded.status == "running"  # still compares with its name

    on_disk["status"] = "exploded"
    (rec.dir / "state.json").write_text(json.dumps(on_disk))
    with pytest.raises(ValueError):
        Record.load(rec.id)


def test_info_state_derives_from_the_status() -> None:
    def frozen() -> bool:
        return True

    def thawed() -> bool:
        return False

    assert info_state(Status.RUNNING, True, thawed) == "running"
    assert info_state(Status.RUNNING, True, frozen) == "paused"
    assert info_state(Status.RUNNING, False, thawed) == "dead"
    for other in (Status.CREATING, Status.DESTROYED):
        assert info_state(other, True, thawed) == "dead"
    assert info_state(Status.PAUSED, False, thawed) == "paused-to-disk"  # saved on disk, no init


def test_pause_to_disk_moves() -> None:
    """Paused to disk is reached from running only; a resume is a restore (creating), and one
    that fails goes back to paused; a paused workspace may be destroyed."""
    rec = _record()
    with pytest.raises(IllegalTransition):
        _record(Status.DESTROYED).transition(Status.PAUSED)
    for step in (Status.RUNNING, Status.PAUSED, Status.CREATING, Status.PAUSED, Status.CREATING, Status.RUNNING,
                 Status.PAUSED, Status.DESTROYED):
        rec.transition(step)


def test_a_failed_resume_stays_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume that fails releases what it restored and leaves the workspace paused, its saved
    state kept: the next resume brings it back."""
    from bunshinfork import pipeline
    from bunshinfork.errors import ForkError
    from bunshinfork.workspace import Workspace

    def refuse(b: object) -> None:
        raise ForkError("refused by the test")

    ws = Workspace.create()
    try:
        ws.files.write("/root/f", "kept")
        ws.pause_to_disk()
        saved = Path(str(ws.record.saved))
        with monkeypatch.context() as m:
            m.setattr(pipeline.part("network"), "restore", refuse)
            with pytest.raises(ForkError, match="refused by the test"):
                ws.resume_from_disk()
        rec = Record.load(ws.id)
        assert rec.status is Status.PAUSED and rec.fs is None and rec.cgroups is None and saved.is_dir()
        ws.resume_from_disk()
        assert ws.is_running() and ws.files.read("/root/f") == "kept" and not saved.exists()
        # Paused and resumed again: it now stacks the layer its first resume imported.
        ws.pause_to_disk()
        ws.resume_from_disk()
        assert ws.files.read("/root/f") == "kept"
    finally:
        ws.destroy()
