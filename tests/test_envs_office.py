"""The office family (the OSWorld stand-in, bunshinrl/envs/office.py): LibreOffice Calc on a large
generated spreadsheet, on an X11 desktop inside a workspace, forked while it runs."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import time
import zipfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import load_by_path

from bunshinfork import Workspace
from bunshinrl import ToolCall, check_family_async
from bunshinrl.calls.policy import FinalAnswer, Step
from bunshinrl.calls.task import Task
from bunshinrl.envs import _ods, _office_desktop, _office_files, office

NEEDED = ("soffice", "Xvfb", "openbox", "xdotool", "wmctrl", "xprop", "xdpyinfo")
missing = [b for b in NEEDED if shutil.which(b) is None]
desktop = pytest.mark.skipif(bool(missing), reason=f"scripts/setup.sh installs {missing}")

# Loaded by path, as tests/test_agent_rollouts.py does: benchmarks/ on sys.path would shadow the
# tests' own modules. tasks.py imports agent_policy by name, so that one is registered.
agent_policy = load_by_path("agent_policy", "benchmarks/agent_policy.py", register=True)
ROWS = 2000  # small: a test opens it in a second or less; the benchmark's task has office.ROWS


def _cells(ws: Workspace, env: Task, *refs: str) -> str:
    return env.call(ws, "read_cells", path=office.LEDGER, cells=", ".join(refs))


def _drive(env: Task, ws: Workspace, history: list[Step]) -> list[Step]:
    """The scripted agent's preferred call at every step, until it answers."""
    candidates = agent_policy.office_candidates(office.task_cells(1, ROWS))
    while True:
        action = candidates(env.id, history)[0]
        if isinstance(action, FinalAnswer):
            return history
        assert isinstance(action, ToolCall)
        history.append(Step(action, env.call(ws, action.name, **action.args)))
        if action.name == "save":
            # Saved, not yet exported: half the reward, read from the file the save wrote.
            assert env.score(ws) == (0.5, "notes saved, no PDF"), history[-1]
        assert len(history) <= 20, [h.call for h in history]


@pytest.fixture
def calc_ws() -> Iterator[tuple[Task, Workspace]]:
    """The task of seed 1 on a small ledger, and its initial workspace (nothing open yet)."""
    env = office.make_env(seed=1, rows=ROWS)
    ws = env.create()
    try:
        yield env, ws
    finally:
        ws.destroy()


@desktop
def test_the_right_trajectory_scores_1_and_a_wrong_one_0(calc_ws: tuple[Task, Workspace]) -> None:
    """Two forks of the initial state: the scripted agent's preferred calls (a cold start of
    Calc, two notes through the Name Box, save, read back, PDF) score 1.0 in 10-15 actions; a
    typo in the first note, saved and exported all the same, scores 0.0."""
    env, ws = calc_ws
    (c1, n1), (c2, n2) = office.task_cells(1, ROWS)
    right, wrong = ws.fork(2)
    assert isinstance(right, Workspace) and isinstance(wrong, Workspace), (right, wrong)
    try:
        assert env.score(right) == (0.0, "saved notes wrong: " + f"{c1}='', {c2}=''")
        history = _drive(env, right, [])
        assert 10 <= len(history) + 1 <= 15, [h.call for h in history]  # + the final answer
        assert [h.call.name for h in history][:2] == ["launch_app", "list_windows"]
        assert not [h for h in history if "ERROR" in h.observation], history
        assert history[-1].observation.startswith(f"exported {office.LEDGER_PDF} (")
        assert env.score(right) == (1.0, "notes saved and exported")
        assert _cells(right, env, c1, c2) == f"{c1} = {n1!r}\n{c2} = {n2!r}"

        for name, args in (("launch_app", {"app": "calc", "path": office.LEDGER}), ("goto_cell", {"cell": c1}),
                           ("type_text", {"text": n1[:-1]}), ("key", {"combo": "Return"}),
                           ("goto_cell", {"cell": c2}), ("type_text", {"text": n2}), ("key", {"combo": "Return"}),
                           ("save", {}), ("export_pdf", {"path": office.LEDGER})):
            out = env.call(wrong, name, **args)
            assert not out.startswith("ERROR"), (name, out)
        assert env.score(wrong) == (0.0, f"saved notes wrong: {c1}={n1[:-1]!r}")
        assert env.score(ws) == (0.0, f"saved notes wrong: {c1}='', {c2}=''")  # the source: untouched
    finally:
        right.destroy()
        wrong.destroy()


@desktop
def test_a_fork_of_calc_running_gives_clones_whose_edits_stay_their_own(calc_ws: tuple[Task, Workspace]) -> None:
    """Calc open on the ledger, forked: an edit saved in one clone is not in its sibling's file
    nor the parent's, and neither holds it in memory (each saves what it holds: its own edit or
    none). All three Calcs keep running."""
    env, ws = calc_ws
    (c1, _), (c2, _) = office.task_cells(1, ROWS)
    assert env.call(ws, "launch_app", app="calc", path=office.LEDGER).startswith("started calc")
    a, b = ws.fork(2)
    assert isinstance(a, Workspace) and isinstance(b, Workspace), (a, b)
    try:
        for clone in (a, b):
            assert "'ledger.ods - LibreOffice Calc'  [active]" in env.call(clone, "list_windows")
        for name, args in (("goto_cell", {"cell": c1}), ("type_text", {"text": "Only in A"}),
                           ("key", {"combo": "Return"})):
            env.call(a, name, **args)
        assert env.call(a, "save").startswith(f"saved {office.LEDGER}")
        assert _cells(a, env, c1) == f"{c1} = 'Only in A'"
        assert _cells(b, env, c1) == _cells(ws, env, c1) == f"{c1} is empty"
        for name, args in (("goto_cell", {"cell": c2}), ("type_text", {"text": "Only in B"}),
                           ("key", {"combo": "Return"}), ("save", {})):
            env.call(b, name, **args)
        assert env.call(ws, "save").startswith(f"saved {office.LEDGER}")
        assert _cells(b, env, c1, c2) == f"{c1} is empty\n{c2} = 'Only in B'"
        assert _cells(ws, env, c1, c2) == f"{c1} is empty\n{c2} is empty"
        assert _cells(a, env, c1, c2) == f"{c1} = 'Only in A'\n{c2} is empty"
        for w in (ws, a, b):
            assert "LibreOffice Calc" in env.call(w, "list_windows")
    finally:
        a.destroy()
        b.destroy()


# ---- OSWorld's settle pause (issue 38): each action pays it, no observation does ----

SETTLE = 0.3


class _Desktop:
    """A stand-in desktop and workspace that record when they act: a key or a typed text, a
    window that appears, a command run (stat, the PDF export)."""

    def __init__(self) -> None:
        self.acted = 0.0
        self.titles: list[str] = []
        self.version = 0
        self.files = SimpleNamespace(exists=lambda path: True, read=self._read)
        self.commands = SimpleNamespace(run=self._run)

    def _act(self) -> None:
        self.acted = time.monotonic()

    def _read(self, path: str, format: str = "text") -> bytes:
        return b"<</Type/Page/Parent 2 0 R>>" if path.endswith(".pdf") else office.ledger_ods(16)

    def _run(self, cmd: str | list[str], **_kw: Any) -> SimpleNamespace:
        if isinstance(cmd, list) and cmd[3] == "--whole":  # the saved file is whole
            return SimpleNamespace(stdout="", stderr="", exit_code=0)
        if isinstance(cmd, list) and cmd[3] == "--pages":  # the PDF's page count
            return SimpleNamespace(stdout=f"{_ods.pdf_pages(self._read(cmd[4]))}\n", stderr="", exit_code=0)
        if isinstance(cmd, list):  # the spreadsheet reader, run here on what _read returns
            ods = zipfile.ZipFile(io.BytesIO(self._read(cmd[3])))
            return SimpleNamespace(stdout=json.dumps(_ods.read_cells(ods, cmd[4:])), stderr="", exit_code=0)
        if "--convert-to pdf" in cmd:
            self._act()
        return SimpleNamespace(stdout=f"1 {self.version} 1.0\n", stderr="", exit_code=0)  # stat

    def launch(self, command: str, wait_title: str | None = None) -> None:
        self._act()
        self.titles.append("ledger.ods - LibreOffice Calc")

    def windows(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(x=0, y=0, width=10, height=10, title=t, focused=i == len(self.titles) - 1)
                for i, t in enumerate(self.titles)]

    def active_window(self) -> str:
        return self.titles[-1] if self.titles else ""

    def key(self, combo: str) -> None:
        self._act()
        if "ctrl+s" in combo:
            self.version += 1  # the file's stat changes: saved

    def type(self, text: str) -> None:
        self._act()

    def activate(self, title: str) -> SimpleNamespace:
        self._act()
        return SimpleNamespace(title=self.titles[0])


ACTION_ARGS = {"launch_app": {"app": "calc", "path": office.LEDGER}, "goto_cell": {"cell": "E12"},
               "type_text": {"text": "Paid"}, "key": {"combo": "Return"}, "save": {},
               "export_pdf": {"path": office.LEDGER}, "activate_window": {"title": "ledger"}}
OBSERVATION_ARGS = {"list_windows": {}, "read_cells": {"path": office.LEDGER, "cells": "B2, E2"}}


def test_every_action_tool_pays_the_settle_pause_and_no_observation_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """settle=0.3: each action tool returns >= 0.3 s after its last act (the pause comes after
    the action, before the observation), the observation tools at once; what each observes is
    what it observes at settle 0."""
    assert set(ACTION_ARGS) == office.ACTIONS
    assert set(OBSERVATION_ARGS) | office.ACTIONS == {t.name for t in office.TOOLS}
    settled, plain = office.make_env(rows=16, settle=SETTLE), office.make_env(rows=16)
    assert settled.fingerprint != plain.fingerprint
    outs: dict[float, dict[str, str]] = {}
    for env in (plain, settled):
        fake = _Desktop()
        for where in (office, _office_desktop):  # the tools' desktop and the observation's
            monkeypatch.setattr(where, "desktop", lambda ws, fake=fake: fake)
        seen = outs.setdefault(SETTLE if env is settled else 0.0, {})
        for name, args in (*ACTION_ARGS.items(), *OBSERVATION_ARGS.items()):
            t = time.monotonic()
            seen[name] = env.call(fake, name, **args)  # type: ignore[arg-type]
            done = time.monotonic()
            assert not seen[name].startswith("ERROR"), (name, seen[name])
            if env is settled and name in office.ACTIONS:
                assert fake.acted >= t and done - fake.acted >= SETTLE, (name, done - fake.acted)
            else:
                assert done - t < SETTLE, (name, done - t)
    assert outs[SETTLE] == outs[0.0]
    assert outs[0.0]["save"] == f"saved {office.LEDGER}\nwindows: 'ledger.ods - LibreOffice Calc' [active]"
    with pytest.raises(ValueError, match="settle"):
        office.make_env(settle=-1)


def test_the_rollout_never_reads_a_saved_document_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace can make its saved spreadsheet or its PDF any size: whether a save finished
    and how many pages the PDF has are found inside the workspace, never by reading the file into
    the rollout's process (a multi-GB file there would be the host's memory)."""
    fake = _Desktop()

    def refuse(path: str, format: str = "text") -> bytes:
        raise AssertionError(f"the rollout's process read {path} whole")

    fake.files = SimpleNamespace(exists=lambda path: True, read=refuse)
    for where in (office, _office_desktop):
        monkeypatch.setattr(where, "desktop", lambda ws: fake)
    env = office.make_env(rows=16)
    env.call(fake, "launch_app", app="calc", path=office.LEDGER)  # type: ignore[arg-type]
    assert env.call(fake, "save").startswith(f"saved {office.LEDGER}")  # type: ignore[arg-type]
    fake.files = SimpleNamespace(exists=lambda path: True, read=refuse)
    fake._read = lambda path, format="text": b"<</Type/Page/Parent 2 0 R>>"  # what the workspace's reader reads
    assert "(1 pages)" in env.call(fake, "export_pdf", path=office.LEDGER)  # type: ignore[arg-type]


# ---- check_family: two forks of one state observe the same ----

@desktop
def test_check_family_finds_no_differing_tool() -> None:
    """The benchmark's office task (tasks.build_tasks, its full-size ledger): the agent's first
    calls (a cold start of Calc or Writer, a listing) in two forks of the initial state; then
    every tool's call in two forks of a state with Calc open on a small ledger."""
    tasks_mod = load_by_path("rollouts_tasks", "benchmarks/rollouts/tasks.py")
    [task], cands = tasks_mod.build_tasks(["office"], 0, 0, settle=0.0)
    report = asyncio.run(tasks_mod.check_tools(task, cands[task.id]))
    assert report["ok"] and not report["differing"], report
    assert {"launch_app", "list_windows"} <= {c.split("{")[0] for c in report["checked"]}, report

    env = office.make_env(seed=1, rows=ROWS)
    (c1, n1), (c2, _) = office.task_cells(1, ROWS)
    calls = [ToolCall("list_windows"), ToolCall("goto_cell", {"cell": c1}), ToolCall("type_text", {"text": n1}),
             ToolCall("key", {"combo": "Return"}), ToolCall("save"), ToolCall("export_pdf", {"path": office.LEDGER}),
             ToolCall("read_cells", {"path": office.LEDGER, "cells": f"{c1}, {c2}"}),
             ToolCall("activate_window", {"title": "ledger.ods"})]
    deeper = asyncio.run(check_family_async(env, calls, prefix=[ToolCall("launch_app", {"app": "calc",
                                                                                        "path": office.LEDGER})]))
    assert deeper.ok and len(deeper.checked) == len(calls), deeper.summary()
    assert deeper.unchecked == ["launch_app"], deeper.summary()


# ---- leftovers ----

def _soffice_pids() -> set[int]:
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"soffice" in f.read():
                    out.add(int(pid))
        except OSError:
            continue  # exited while listed
    return out


@desktop
def test_nothing_is_left_behind() -> None:
    """A workspace with Calc open, forked, exported from and destroyed with its clone: no
    workspace, mount, cgroup or process of it stays (the suite's leak census), no soffice runs
    on the host that did not before, and the host's /tmp has none of LibreOffice's files."""
    from conftest import leaks
    from conftest import snapshot as host_snapshot

    before, pids, tmp = host_snapshot(), _soffice_pids(), set(os.listdir("/tmp"))
    env = office.make_env(seed=2, rows=ROWS)
    ws = env.create()
    try:
        env.call(ws, "launch_app", app="calc", path=office.LEDGER)
        [clone] = ws.fork(1)
        assert isinstance(clone, Workspace), clone
        try:
            assert env.call(clone, "export_pdf", path=office.LEDGER).startswith("exported")
            assert _soffice_pids() - pids  # it runs, in the workspaces
        finally:
            clone.destroy()
    finally:
        ws.destroy()
    assert leaks(before) == {}
    assert _soffice_pids() - pids == set()
    assert not {n for n in set(os.listdir("/tmp")) - tmp if n.startswith(("OSL_PIPE", "lu"))}


def test_the_reader_follows_repeated_rows_and_cells_and_odf_spaces(tmp_path: Any) -> None:
    """Calc writes runs of equal rows and cells once, with a repeat count, and runs of spaces as
    <text:s text:c="N"/>: the reader counts them, reads the first sheet only and stops past the
    last row asked for (a cell beyond the sheet's rows is empty)."""
    t, x = f'xmlns:table="{_ods.TABLE_NS}"', f'xmlns:text="{_ods.TEXT_NS}"'
    content = (f'<?xml version="1.0"?><office:document-content xmlns:office="o" {t} {x}><office:body>'
               "<office:spreadsheet><table:table><table:table-row table:number-rows-repeated=\"3\">"
               '<table:table-cell table:number-columns-repeated="2"><text:p>a<text:s text:c="3"/>b</text:p>'
               "</table:table-cell><table:table-cell/><table:table-cell><text:p>x</text:p><text:p>y</text:p>"
               "</table:table-cell></table:table-row><table:table-row><table:table-cell><text:p>last</text:p>"
               "</table:table-cell></table:table-row></table:table><table:table><table:table-row>"
               "<table:table-cell><text:p>other sheet</text:p></table:table-cell></table:table-row></table:table>"
               "</office:spreadsheet></office:body></office:document-content>")
    path = tmp_path / "t.ods"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("content.xml", content)
    got = _ods.read_cells(str(path), ["B3", "a1", "C2", "D1", "A4", "A5", "E3"])
    assert got == {"B3": "a   b", "A1": "a   b", "C2": "", "D1": "x\ny", "A4": "last", "A5": "", "E3": ""}
    assert _ods.main([str(path), "A4"]) == 0 and _ods.main([str(path), "A0"]) == 2
    with pytest.raises(ValueError, match="outside the sheet"):
        _ods.parse_cell("AMK1")
    generated = _ods.read_cells(zipfile.ZipFile(io.BytesIO(office.ledger_ods(16))), ["A1", "B17", "D3", "E9"])
    assert generated == {"A1": "Id", "B17": "item-00016", "D3": _office_files._price(2), "E9": ""}
