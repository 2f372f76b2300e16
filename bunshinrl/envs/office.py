"""Office task (the OSWorld stand-in): edit a large spreadsheet in LibreOffice Calc on an X11
desktop, save it and export it to PDF; the reward reads the saved file.

    env = make_env(seed=0)
    ws = env.create()                       # Xvfb + openbox, LibreOffice's profile, ledger.ods
    env.call(ws, "launch_app", app="calc", path=LEDGER)   # a real cold start of soffice
    env.call(ws, "goto_cell", cell="E1235"); env.call(ws, "type_text", text="Paid in full")
    env.call(ws, "key", combo="Return"); env.call(ws, "save"); env.call(ws, "export_pdf", path=LEDGER)
    env.reward(ws)                          # 1.0: the saved .ods holds the notes, the PDF is there

Everything runs inside the workspace: the X server, the window manager, soffice (Calc and
Writer, the `gen` X11 plugin: no GTK, no session bus, no accessibility bus) and the headless
converter the PDF export runs. A fork carries the open spreadsheet, its window and its unsaved
edits.

OSWorld's protocol (issue 38's settle note): each action tool (ACTIONS) acts, waits `settle`
seconds for the GUI to settle (DesktopEnv.step(action, pause=2)), then observes: the windows and
which one has the focus. The pause is inside the tool, so every execution pays it (the real call,
a cache replay, a speculative run, an audit re-execution); the observations list_windows and
read_cells do not pause. Observations hold nothing that differs between two forks of one state
(no window ids, pids, clocks or timings), which check_family checks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bunshinfork import BunshinError, Workspace
from bunshinfork.templates import GuiWorkspace, TemplateError, start_gui

from ..calls.cpu_slots import cpu_slot
from ..calls.task import Task
from ..calls.tools import Tool
from . import _ods
from ._common import agent_tool, tools_of
from ._ods import parse_cell
from ._office_desktop import GUI_ENV, OfficeError, desktop, env_prefix, file_stat, observe, wait_for
from ._office_files import (  # noqa: F401 (re-exported: the task's files are the office env's)
    HEADERS,
    NOTE_COLUMN,
    PRISTINE_REGISTRY,
    REGISTRY,
    ROWS,
    ledger_ods,
    registry_xcu,
)

DOCS = "/root/Documents"
LEDGER = f"{DOCS}/ledger.ods"
LEDGER_PDF = f"{DOCS}/ledger.pdf"
# The GUI instance's user profile, and the converter's own: a converter on the GUI's profile would
# hand its job to the running instance (LibreOffice's single-instance pipe) instead of doing it.
PROFILE = "/root/.lo-profile"
EXPORT_PROFILE = "/root/.lo-export"
APPS = {"calc": ("--calc", "LibreOffice Calc"), "writer": ("--writer", "LibreOffice Writer")}
# What the task asks to write (seed modulo their number): the first note on one item's row, the
# second on another's. Capitalised, plain words: Calc's autocorrect leaves them as typed.
NOTES = (("Paid in full", "Audited"), ("Refund issued", "Checked"), ("Sent to legal", "Reviewed"))
LAUNCH_TIMEOUT_S = 120.0
SAVE_TIMEOUT_S = 60.0
EXPORT_TIMEOUT_S = 240.0
READ_TIMEOUT_S = 120.0
# The spreadsheet reader (bunshinrl/envs/_ods.py), copied into the workspace at set-up.
ODS_READER = "/opt/bunshin/ods_cells.py"



# ---- the desktop ----
def _doc_path(path: str) -> str:
    """A document path the agent gave, refused unless it is a file under DOCS."""
    path = str(path)
    if not path.startswith(DOCS + "/") or ".." in path.split("/"):
        raise ValueError(f"documents live under {DOCS}/: {path!r}")
    return path


# ---- the tools ----
# Action tools are plain functions here; _acting (below) turns each into the agent's tool: it runs
# the action, pays the settle pause, then appends the observation.

def launch_app(ws: Workspace, app: str, path: str = "") -> str:
    """Start LibreOffice: app "calc" or "writer", opening the document at `path` (under
    /root/Documents) or a new one; returns once its window is up (seconds: a real start)."""
    if app not in APPS:
        raise ValueError(f"unknown app {app!r}; use one of {', '.join(APPS)}")
    flag, name = APPS[app]
    g = desktop(ws)
    before = {w.title for w in g.windows()}
    doc = ""
    if path:
        path = _doc_path(path)
        if not ws.files.exists(path):
            raise ValueError(f"no such document: {path}")
        # The title Calc or Writer gives the document's window (a spreadsheet opens in Calc
        # whatever the flag says).
        doc = f"{path.rsplit('/', 1)[-1]} - LibreOffice"
        shown = next((t for t in before if t.startswith(doc)), None)
        if shown is not None:
            # LibreOffice would only raise the window it has: say so rather than wait for a new one.
            g.activate(shown)
            return f"{path} is already open"
    # --norestore: no recovery of a "crashed" session; --nologo: no splash window; --nodefault
    # (with a document only: without one it would open nothing): no Start Center once the
    # document is closed. A second launch joins the running instance through its
    # single-instance pipe, which opens a window of its own.
    cmd = (f"{env_prefix(GUI_ENV)} soffice -env:UserInstallation=file://{PROFILE} --norestore --nologo "
           + (f"--nodefault {flag} {shlex.quote(path)}" if path else flag))

    def window() -> bool:
        titles = {w.title for w in g.windows()} - before
        return any(t.startswith(doc) if path else t.endswith(f" - {name}") for t in titles)

    g.launch(command=cmd, wait_title=None)
    try:
        wait_for(window, f"a new {name} window", LAUNCH_TIMEOUT_S)
    except OfficeError as e:
        log = ws.commands.run("tail -c 1500 /tmp/launch.log", timeout=30).stdout  # type: ignore[union-attr]
        raise OfficeError(f"{e}; soffice logged:\n{log}") from None
    return f"started {app}" + (f" with {path}" if path else "")


def goto_cell(ws: Workspace, cell: str) -> str:
    """In Calc, move the cell cursor to `cell` (like E12) through the Name Box (ctrl+shift+F5,
    the reference, Return)."""
    parse_cell(cell)  # checked only: the Name Box would answer a typo with a dialog
    g = desktop(ws)
    # The Name Box takes the focus with its text unselected (the gen plugin): typed text would
    # go before the old reference ("E12A1", refused with a dialog), so select it first.
    g.key("ctrl+shift+F5 ctrl+a")
    g.type(str(cell).strip().upper())
    g.key("Return")
    return f"went to {str(cell).strip().upper()}"


def type_text(ws: Workspace, text: str) -> str:
    """Type text into the focused window (newlines press Return)."""
    desktop(ws).type(str(text))
    return f"typed {len(text)} characters"


_SAVE = re.compile(r"(?:^|\s)ctrl\+s(?:\s|$)", re.I)


def key(ws: Workspace, combo: str) -> str:
    """Press keys, xdotool names: "Return", "ctrl+z", "Down Down", "ctrl+s" (saves, like save)."""
    if _SAVE.search(str(combo)):
        return _save(ws, str(combo))
    desktop(ws).key(str(combo))
    return f"pressed {combo}"


def save(ws: Workspace) -> str:
    """Save the focused document (ctrl+s) and wait until it is written."""
    return _save(ws, "ctrl+s")


def _focused_document(g: GuiWorkspace) -> str | None:
    """The file under DOCS the focused LibreOffice window shows, if it has one."""
    title = g.active_window()
    for _flag, name in APPS.values():
        if title.endswith(f" - {name}"):
            return f"{DOCS}/{title[: -len(name) - 3]}"
    return None


def _written(ws: Workspace, path: str, before: str) -> bool:
    """The file changed since `before` (its stat) and is whole: LibreOffice writes the new zip in
    place, and a reader between its first and last block would find no central directory."""
    if file_stat(ws, path) == before:
        return False
    r = ws.commands.run(["python3", "-I", ODS_READER, "--whole", path], timeout=30)
    return r.exit_code == 0  # type: ignore[union-attr]


def _save(ws: Workspace, combo: str) -> str:
    g = desktop(ws)
    doc = _focused_document(g)
    if doc is None or not ws.files.exists(doc):
        # A new document: ctrl+s opens the Save As dialog, which the observation shows.
        g.key(combo)
        return f"pressed {combo}"
    before = file_stat(ws, doc)
    g.key(combo)
    wait_for(lambda: _written(ws, doc, before), f"LibreOffice to save {doc}", SAVE_TIMEOUT_S)
    return f"saved {doc}"


def export_pdf(ws: Workspace, path: str) -> str:
    """Export the saved document at `path` to PDF beside it (same name, .pdf): a headless
    LibreOffice converts the file as it is on disk (seconds)."""
    path = _doc_path(path)
    if not ws.files.exists(path):
        raise ValueError(f"no such document: {path}")
    folder, name = path.rsplit("/", 1)
    pdf = f"{folder}/{name.rsplit('.', 1)[0]}.pdf"
    r = ws.commands.run(f"rm -f {shlex.quote(pdf)} && {env_prefix()} soffice -env:UserInstallation=file://"
                        f"{EXPORT_PROFILE} --headless --norestore --convert-to pdf --outdir {shlex.quote(folder)} "
                        f"{shlex.quote(path)}", timeout=EXPORT_TIMEOUT_S, cwd="/root")
    if r.exit_code or not ws.files.exists(pdf):  # type: ignore[union-attr]
        raise OfficeError(f"the PDF export of {path} failed: {(r.stderr or r.stdout)[-500:]}")  # type: ignore[union-attr]
    # The page count, not the size: the PDF holds its creation time. Counted in the workspace.
    pages = ws.commands.run(["python3", "-I", ODS_READER, "--pages", pdf],
                            timeout=READ_TIMEOUT_S).stdout.strip()  # type: ignore[union-attr]
    return f"exported {pdf} ({pages} pages)"


def activate_window(ws: Workspace, title: str) -> str:
    """Raise and focus the first window whose title contains `title`."""
    w = desktop(ws).activate(str(title))
    return f"activated {w.title!r}"


@agent_tool
def list_windows(ws: Workspace) -> str:
    """Top-level windows: position, size, title; one a line, in the desktop's order."""
    # No X window id and no pid: another workspace's replay of the listing would number them
    # otherwise; the agent addresses windows by title.
    return "\n".join(f"window {i} at ({w.x}, {w.y}) size {w.width}x{w.height} {w.title!r}"
                     + ("  [active]" if w.focused else "") for i, w in enumerate(desktop(ws).windows(), 1)) \
        or "no windows"


@agent_tool
def read_cells(ws: Workspace, path: str, cells: str) -> str:
    """The saved contents of cells (comma-separated, like "E12, E40") of the spreadsheet at
    `path`, as the file on disk holds them: unsaved edits do not show."""
    path = _doc_path(path)
    refs = [c.strip() for c in str(cells).split(",") if c.strip()]
    if not refs or len(refs) > 50:
        raise ValueError("name 1 to 50 cells, comma-separated")
    for ref in refs:
        parse_cell(ref)  # a ValueError the agent sees, before anything runs
    found = read_saved_cells(ws, path, refs)
    return "\n".join(f"{ref} = {text!r}" if text else f"{ref} is empty" for ref, text in found.items())


def read_saved_cells(ws: Workspace, path: str, refs: Sequence[str]) -> dict[str, str]:
    """The saved text of cells of the spreadsheet at `path`, read inside the workspace (_ods, at
    ODS_READER): a saved ledger's XML is tens of MB, too much for the rollout's own process.
    ValueError (a message for the agent) when the file is missing or no spreadsheet."""
    r = ws.commands.run(["python3", "-I", ODS_READER, path, *refs], timeout=READ_TIMEOUT_S)
    if r.exit_code:  # type: ignore[union-attr]
        raise ValueError(f"{path}: {r.stderr.strip()[-300:]}")  # type: ignore[union-attr]
    found = json.loads(r.stdout)  # type: ignore[union-attr]
    assert isinstance(found, dict)
    return {str(k): str(v) for k, v in found.items()}


_ACTION_FNS: tuple[Callable[..., str], ...] = (launch_app, goto_cell, type_text, key, save, export_pdf,
                                               activate_window)
# The tools that change the desktop or the documents (OSWorld's actions); the rest only observe.
ACTIONS = frozenset(f.__name__ for f in _ACTION_FNS)
# The actions whose work is an office program's CPU time (a cold start, a save of the large
# ledger, a PDF export): they hold a CPU slot while they act (bunshinrl.calls.cpu_slots), not
# while the GUI settles.
CPU_HEAVY = frozenset({"launch_app", "save", "export_pdf"})
_OBSERVATIONS: tuple[Callable[..., str], ...] = (list_windows, read_cells)


def _acting(fn: Callable[..., str], settle: float) -> Callable[..., str]:
    """The agent's tool for action `fn`: the action, then `settle` seconds for the GUI to settle
    (OSWorld's DesktopEnv.step pause: the protocol, not a stand-in for work), then the windows
    as they are now. An action that fails observes its ERROR and pays the pause too, as OSWorld
    sleeps after any action."""

    @functools.wraps(fn)  # the same schema and docstring: the model sees the same tool
    def tool(ws: Workspace, **args: Any) -> str:
        try:
            with cpu_slot() if fn.__name__ in CPU_HEAVY else contextlib.nullcontext():
                out = fn(ws, **args)
        except (BunshinError, ValueError, TypeError) as e:
            out = f"ERROR: {e}"
        if settle:
            time.sleep(settle)  # OSWorld's settle pause after an action (DesktopEnv.step's pause)
        return f"{out}\n{observe(ws)}"

    return tool


def tools_with_settle(settle: float) -> list[Tool]:
    """The family's tools, each action pausing `settle` seconds before it observes."""
    if not settle >= 0:  # NaN too
        raise ValueError(f"settle is a pause in seconds, not {settle}")
    return tools_of((*(_acting(f, settle) for f in _ACTION_FNS), *_OBSERVATIONS))


TOOLS: list[Tool] = tools_with_settle(0.0)


# ---- the task ----

def task_cells(seed: int, rows: int = ROWS) -> tuple[tuple[str, str], tuple[str, str]]:
    """((cell, note), (cell, note)): the two Note cells the task of `seed` asks to fill, on two
    items far apart (the agent cannot scroll there: the Name Box takes it)."""
    first, second = NOTES[seed % len(NOTES)]
    r1 = rows // 2 + (seed * 7907) % (rows // 4)
    r2 = rows - 1 - (seed * 4001) % (rows // 8)
    return (f"{NOTE_COLUMN}{r1 + 1}", first), (f"{NOTE_COLUMN}{r2 + 1}", second)


def verifier(cells: tuple[tuple[str, str], ...], path: str = LEDGER,
             pdf: str = LEDGER_PDF) -> Callable[[Workspace], tuple[float, str]]:
    """1.0: the saved spreadsheet holds exactly the notes and a PDF was exported from it (the PDF
    no older than the save); 0.5: the notes are saved but no PDF of them; 0.0 otherwise."""

    def verify(ws: Workspace) -> tuple[float, str]:
        try:
            found = read_saved_cells(ws, path, [c for c, _ in cells])
        except (BunshinError, ValueError) as e:
            return 0.0, f"no readable spreadsheet: {e}"
        wrong = [f"{c}={found[c]!r}" for c, note in cells if found[c] != note]
        if wrong:
            return 0.0, "saved notes wrong: " + ", ".join(wrong)
        # mtimes in ns from the workspace's own clock: a PDF exported before the last save shows
        # an older spreadsheet.
        r = ws.commands.run(f"stat -c %.9Y {shlex.quote(path)} {shlex.quote(pdf)} 2>/dev/null", timeout=30)
        times = r.stdout.split()  # type: ignore[union-attr]
        if len(times) < 2:
            return 0.5, "notes saved, no PDF"
        if float(times[1]) < float(times[0]):
            return 0.5, "notes saved, the PDF is older than the save"
        return 1.0, "notes saved and exported"

    return verify


def make_env(seed: int = 0, rows: int = ROWS, width: int = 1280, height: int = 800, settle: float = 0.0,
             **spec: Any) -> Task:
    """The office task of `seed`: write two notes into a `rows`-item ledger in Calc, save it and
    export it to PDF. Nothing is open at the start (the agent launches Calc: a real cold start
    and a large file's load). spec: WorkspaceSpec fields. settle: OSWorld's pause after each
    action (DesktopEnv.step's, 2 s by OSWorld's default; 0 here, so tests run fast); part of the
    fingerprint, so a cache recorded at one settle is never served at another."""
    settle = float(settle)
    tools = tools_with_settle(settle)  # checks settle >= 0
    if rows < 16:
        raise ValueError(f"rows must be at least 16, not {rows}")
    ods = ledger_ods(rows)
    cells = task_cells(seed, rows)
    xcu = registry_xcu()
    reader = Path(_ods.__file__).read_text()

    def setup(ws: Workspace) -> None:
        ws.files.write(LEDGER, ods)
        ws.files.write(ODS_READER, reader)
        ws.files.write(f"{PROFILE}/user/registrymodifications.xcu", xcu)
        ws.files.write(f"{EXPORT_PROFILE}/user/registrymodifications.xcu", xcu)
        # Both profiles made once here, before any fork: every clone's first start and first
        # export then find a profile as a used desktop has one (and do not each write one).
        init = " && ".join(f"{env_prefix()} soffice -env:UserInstallation=file://{p} --headless "
                           "--terminate_after_init" for p in (PROFILE, EXPORT_PROFILE))
        r = ws.commands.run(f"mkdir -p /etc/libreoffice && ln -sfn {PRISTINE_REGISTRY} /etc/libreoffice/registry "
                            f"&& {init}", timeout=LAUNCH_TIMEOUT_S, cwd="/root")
        if r.exit_code:  # type: ignore[union-attr]
            raise TemplateError(f"LibreOffice's profiles: {r.stderr[-1000:]}")  # type: ignore[union-attr]
        start_gui(ws, apps=(), width=width, height=height)

    (c1, n1), (c2, n2) = cells
    prompt = (f"A desktop is open ({width}x{height}) with LibreOffice Calc and Writer installed; nothing runs yet. "
              f"The spreadsheet {LEDGER} lists {rows} items, one a row after the header row (columns: "
              f"{', '.join(f'{chr(65 + i)} {h}' for i, h in enumerate(HEADERS))}; item-NNNNN is on row NNNNN+1). "
              f"Write {n1!r} in cell {c1} and {n2!r} in cell {c2} (their Note), save the spreadsheet in its own "
              f"format, then export it to PDF as {LEDGER_PDF}. Tools: launch_app, goto_cell, type_text, key, save, "
              "export_pdf, activate_window, list_windows, read_cells.")
    key_ = ("office-v1", seed, rows, width, height, cells, hashlib.sha256(ods).hexdigest(), xcu,
            hashlib.sha256(reader.encode()).hexdigest()) \
        + ((("settle", settle),) if settle else ())
    fp = hashlib.sha256(repr(key_).encode()).hexdigest()[:16]
    return Task(f"office-ledger-{seed}", prompt, tools, setup, verifier(cells), spec=dict(spec), fingerprint=fp,
                family="office")
