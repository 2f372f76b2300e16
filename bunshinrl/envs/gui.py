"""Desktop task: edit a text file in the GUI editor and save it; the reward reads the file.

    env = make_env(target="Meeting moved to Friday 10:00")
    ws = env.create()                       # Xvfb + openbox + xterm + mousepad on notes.txt
    for clone in ws.fork(8): ...            # one rollout per clone, tools act on the clone
    env.call(clone, "click", x=900, y=500); env.call(clone, "type_text", text="...")
    env.reward(clone)                       # 1.0 when notes.txt holds exactly the target

make_env(desktop="wayland") (or bunshinrl.envs.wayland.make_env) is the same task with the
same tools on the Wayland desktop (sway + foot + mousepad), so an evaluation runs on either.

make_env(settle=2.0) is OSWorld's protocol: its DesktopEnv.step(action, pause=2) runs the action,
waits `pause` seconds (2 by default) for the GUI to settle, then observes. Each action tool
(ACTIONS) waits `settle` seconds after it acts, inside the tool, so every execution of it pays
the pause: the real call, a cache replay behind a hit, a speculative run, an audit re-execution.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from bunshinfork import BunshinError, Workspace
from bunshinfork.templates import GuiWorkspace, WaylandWorkspace, attach_desktop, start_gui, start_wayland

from ..calls.task import Task
from ..calls.tools import Tool
from ._common import agent_tool, tools_of

NOTES = GuiWorkspace.editor_file
NOTES_ON = {"x11": NOTES, "wayland": WaylandWorkspace.editor_file}  # by desktop
DESKTOPS = tuple(NOTES_ON)
INITIAL_TEXT = "TODO: replace this line\n"
DEFAULT_TARGET = "Meeting moved to Friday 10:00"


def _gui(ws: Workspace) -> GuiWorkspace | WaylandWorkspace:
    return attach_desktop(ws)


@agent_tool
def screenshot(ws: Workspace) -> str:
    """The screen as a PNG data URL."""
    return "data:image/png;base64," + base64.b64encode(_gui(ws).screenshot()).decode()


@agent_tool
def click(ws: Workspace, x: int, y: int, button: int = 1, count: int = 1) -> str:
    """Click at (x, y): button 1 left, 2 middle, 3 right; count 2 for a double click."""
    _gui(ws).click(int(x), int(y), int(button), int(count))
    return f"clicked button {button} x{count} at ({x}, {y})"


@agent_tool
def move(ws: Workspace, x: int, y: int) -> str:
    """Move the pointer to (x, y)."""
    _gui(ws).move(int(x), int(y))
    return f"pointer at ({x}, {y})"


@agent_tool
def drag(ws: Workspace, x1: int, y1: int, x2: int, y2: int) -> str:
    """Press the left button at (x1, y1), move to (x2, y2), release."""
    _gui(ws).drag(int(x1), int(y1), int(x2), int(y2))
    return f"dragged ({x1}, {y1}) -> ({x2}, {y2})"


@agent_tool
def type_text(ws: Workspace, text: str) -> str:
    """Type text into the focused window (newlines press Return)."""
    g = _gui(ws)
    g.type(str(text))
    if text:
        _settle_editor_title(g, saved=False)
    return f"typed {len(text)} characters"


@agent_tool
def key(ws: Workspace, combo: str) -> str:
    """Press keys, xdotool names: "ctrl+s", "Return", "ctrl+a BackSpace"."""
    g = _gui(ws)
    g.key(str(combo))
    if _SAVE.search(str(combo)):
        _settle_editor_title(g, saved=True)
    return f"pressed {combo}"


# The editor marks an unsaved buffer with a leading '*' in its title, and sets or clears the
# mark a moment after the key that changed the buffer: a listing read at once showed either
# title, so the audit's back-to-back re-execution saw '*notes.txt' where the recording, read
# after the policy's pause, saw 'notes.txt' (the fault-injection run's one GUI mismatch). The
# tools that change the mark return once the editor shows it, so what follows them reads a
# settled title.
_SAVE = re.compile(r"(?:^|\s)ctrl\+s(?:\s|$)", re.I)
_EDITOR = "Mousepad"
_SETTLE_S = 5.0


def _settle_editor_title(g: GuiWorkspace | WaylandWorkspace, saved: bool) -> None:
    """Wait (at most _SETTLE_S) until the focused editor's title shows the buffer saved or
    modified; a window that is not the editor (a terminal, a dialog) returns at once."""
    deadline = time.monotonic() + _SETTLE_S
    while True:
        title = g.active_window()
        if _EDITOR not in title or title.startswith("*") != saved or time.monotonic() > deadline:
            return
        time.sleep(0.02)  # polling the editor's title until it reflects the key


@agent_tool
def scroll(ws: Workspace, x: int, y: int, dy: int = 0, dx: int = 0) -> str:
    """Scroll at (x, y) by wheel clicks: dy > 0 down, dx > 0 right."""
    _gui(ws).scroll(int(x), int(y), int(dy), int(dx))
    return f"scrolled dy={dy} dx={dx} at ({x}, {y})"


@agent_tool
def clipboard_get(ws: Workspace) -> str:
    """The clipboard's text."""
    return _gui(ws).clipboard_get()


@agent_tool
def clipboard_set(ws: Workspace, text: str) -> str:
    """Put text on the clipboard."""
    _gui(ws).clipboard_set(str(text))
    return f"clipboard holds {len(text)} characters"


@agent_tool
def list_windows(ws: Workspace) -> str:
    """Top-level windows: position, size, title; one a line, in the desktop's order."""
    g = _gui(ws)
    # No X window id: the server hands ids out in the order clients ask, so a replay of this
    # listing in another workspace named other ids for the same windows (the fault-injection
    # run's only audit mismatches); the agent addresses windows by title anyway.
    return "\n".join(f"window {i} at ({w.x}, {w.y}) size {w.width}x{w.height} {w.title!r}"
                     + ("  [active]" if w.focused else "") for i, w in enumerate(g.windows(), 1))


@agent_tool
def activate_window(ws: Workspace, title: str) -> str:
    """Raise and focus the first window whose title contains `title`."""
    w = _gui(ws).activate(str(title))
    return f"activated {w.title!r}"


@agent_tool
def launch_app(ws: Workspace, app: str) -> str:
    """Start an application (terminal, editor or browser) and wait until its window is up."""
    # Not the window's title: for some apps the listing puts the workspace's name in it.
    _gui(ws).launch(str(app))
    return f"started {app}"


_TITLE = re.compile(r"<title>(.*?)</title>", re.S | re.I)


@agent_tool
def open_page(ws: Workspace, path: str) -> str:
    """Open a page (an HTML file in the workspace) in Chromium, starting it if needed, and wait
    until the page has loaded (its title shows in the window's)."""
    g = _gui(ws)
    html = str(ws.files.read(str(path)))
    m = _TITLE.search(html)
    title = m.group(1).strip() if m else str(path).rsplit("/", 1)[-1]
    if g.find_window("Chromium") is None:
        g.launch("browser")
    g.activate("Chromium")
    g.key("ctrl+l")
    g.type(f"file://{path}")
    g.key("Return")
    deadline = time.monotonic() + 60
    while g.find_window(title) is None:
        if time.monotonic() > deadline:
            raise BunshinError(f"the page {path} did not load within 60 s")
        time.sleep(0.1)  # polling the window list while Chromium loads the page
    text = re.sub(r"<[^>]+>", " ", _TITLE.sub("", html))
    # The page's own title, not the window's: that one names the workspace, which differs per fork.
    return f"loaded {title!r}:\n" + " ".join(text.split())[:2000]


_FUNCTIONS = (screenshot, click, move, drag, type_text, key, scroll, clipboard_get, clipboard_set, list_windows,
              activate_window, launch_app, open_page)
# The tools that change the desktop (OSWorld's actions); the rest only observe it.
ACTIONS = frozenset({"click", "move", "drag", "type_text", "key", "scroll", "clipboard_set", "activate_window",
                     "launch_app", "open_page"})
_NONDETERMINISTIC = ("screenshot",)
TOOLS: list[Tool] = tools_of(_FUNCTIONS, nondeterministic=_NONDETERMINISTIC)  # settle 0


def settling(fn: Callable[..., str], settle: float) -> Callable[..., str]:
    """`fn`, then a pause of `settle` seconds before it returns: OSWorld's protocol
    (DesktopEnv.step(action, pause=2): the action, `pause` seconds for the GUI to settle, then
    the observation), not a stand-in for work. The observation is fn's, unchanged; the pause is
    paid whatever the action observed (an ERROR too, as OSWorld sleeps after any action)."""
    if settle < 0:
        raise ValueError(f"settle is a pause in seconds, not {settle}")
    if not settle:
        return fn

    @functools.wraps(fn)  # the same schema and docstring: the model sees the same tool
    def settled(ws: Workspace, **args: Any) -> str:
        out = fn(ws, **args)
        time.sleep(settle)  # OSWorld's settle pause after an action (DesktopEnv.step's pause)
        return out

    return settled


def tools_with_settle(settle: float) -> list[Tool]:
    """The family's tools with OSWorld's settle pause (`settle` seconds) after each action."""
    if not settle:
        return TOOLS
    return tools_of((settling(f, settle) if f.__name__ in ACTIONS else f for f in _FUNCTIONS),
                    nondeterministic=_NONDETERMINISTIC)


def reward_for(target: str, desktop: str = "x11") -> Callable[[Workspace], float]:
    """1.0: notes.txt holds exactly the target (one trailing newline allowed); 0.5: the target is
    one of its lines but something else is left; 0.0 otherwise (never saved, wrong text)."""
    notes = NOTES_ON[desktop]

    def reward(ws: Workspace) -> float:
        try:
            text = str(ws.files.read(notes))
        except BunshinError:
            return 0.0
        if text.rstrip("\n") == target:
            return 1.0
        if target in (line.strip() for line in text.splitlines()):
            return 0.5
        return 0.0

    return reward


def reward(ws: Workspace) -> float:
    """The reward of the default task (make_env() with no arguments)."""
    return reward_for(DEFAULT_TARGET)(ws)


def make_env(target: str = DEFAULT_TARGET, initial_text: str = INITIAL_TEXT, width: int = 1280, height: int = 800,
             apps: tuple[str, ...] = ("terminal", "editor"), desktop: str = "x11",
             files: Mapping[str, str] | None = None, settle: float = 0.0, **spec: Any) -> Task:
    """The desktop editing task on the X11 (default) or the Wayland desktop. `spec` holds
    WorkspaceSpec fields for the workspace; files: more files written before the desktop starts
    (a help page for open_page, say). apps=() leaves starting the editor to the agent
    (launch_app). settle: OSWorld's protocol, the seconds each action tool waits after acting
    for the GUI to settle (DesktopEnv.step's pause, 2 s by OSWorld's default; 0 here, so tests
    run fast); part of the fingerprint, so a cache recorded at one settle is never served at
    another."""
    files = dict(files or {})
    settle = float(settle)
    tools = tools_with_settle(settle)  # checks settle >= 0
    if "\n" in target:
        raise ValueError("target must be a single line")
    if desktop not in NOTES_ON:
        raise ValueError(f"unknown desktop {desktop!r}; use one of {', '.join(DESKTOPS)}")
    notes = NOTES_ON[desktop]
    start = start_gui if desktop == "x11" else start_wayland

    def setup(ws: Workspace) -> None:
        # Written before the editor starts, so the editor opens it with this content.
        ws.files.write(notes, initial_text)
        for path, text in files.items():
            ws.files.write(path, text)
        start(ws, apps=apps, width=width, height=height)

    prompt = (f"A desktop is open ({width}x{height}). The text editor (Mousepad) shows {notes}. "
              f"Replace the whole content of that file with exactly this line:\n{target}\n"
              "and save it (Ctrl+S). Use the tools to look at the screen and to click and type.")
    # The X11 task keeps its name and fingerprint from before the Wayland desktop existed, and at
    # settle 0 from before the settle pause did (issue 38); another settle is another protocol,
    # so another fingerprint: the cache never serves a prefix recorded at another pause.
    key = ("gui-v1", target, initial_text, width, height, apps) + (() if desktop == "x11" else (desktop,)) \
        + ((tuple(sorted(files.items())),) if files else ()) + ((("settle", settle),) if settle else ())
    fp = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    return Task("gui-edit-notes" if desktop == "x11" else f"{desktop}-edit-notes", prompt, tools, setup,
                reward_for(target, desktop), spec=dict(spec), fingerprint=fp, family="gui")
