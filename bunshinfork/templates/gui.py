"""GUI workspace template: an X desktop that runs INSIDE the workspace, with computer-use tools.

    with gui_workspace() as gui:            # Xvfb + openbox + xterm + mousepad + Chromium
        gui.click(400, 300); gui.type("hello"); gui.key("ctrl+s")
        png = gui.screenshot()
        a, b = gui.fork(2)                  # each clone: its own display, windows, cursor,
                                            # clipboard and input stream

Everything (the X server, the window manager, the applications, the optional VNC live view)
is a process of the workspace, so a fork carries the whole desktop. Tools run xdotool,
ImageMagick, xclip and wmctrl inside the workspace against its display; nothing on the host
talks X. The display's only socket is /tmp/.X11-unix/X<n> inside the workspace (-nolisten tcp).
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from ..errors import BunshinError
from ..workspace import Workspace
from ._common import TemplateError, run, start_daemon, wait_until
from ._desktop import (
    CHROMIUM,
    CHROMIUM_FLAGS,
    GSETTINGS,
    GSETTINGS_FILE,
    LIVE_VIEW_VNC_PORT,
    Desktop,
    Window,
    start_websockify,
)

CONFIG_PATH = "/opt/bunshin/gui.json"
APPS = ("terminal", "editor", "browser")
EDITOR_FILE = "/root/Desktop/notes.txt"
APP_TITLES = {"terminal": "Terminal", "editor": "Mousepad", "browser": "Chromium"}
GSETTINGS_KEYFILE = f"/root/.config/{GSETTINGS_FILE}"  # XDG_CONFIG_HOME=/root/.config
# Where windows()'s one shell call parts its listings (each marker a line of its own).
_CLASSES = "--bunshin-wmctrl-classes--"
_ACTIVE = "--bunshin-active-window--"


@dataclass(frozen=True)
class GuiConfig:
    display: str = ":1"
    width: int = 1280
    height: int = 800
    apps: tuple[str, ...] = APPS
    live_view: bool = False


def _app_command(app: str, cfg: GuiConfig) -> tuple[str, str]:
    """(command line, log file) of a named application."""
    if app == "terminal":
        # Xft with DejaVu: the core bitmap fonts xterm defaults to are not installed.
        return ("xterm -fa 'DejaVu Sans Mono' -fs 11 -geometry 90x24+40+40 -title Terminal", "/tmp/xterm.log")
    if app == "editor":
        return (f"mousepad {shlex.quote(EDITOR_FILE)}", "/tmp/mousepad.log")
    if app == "browser":
        w, h = cfg.width * 3 // 4, cfg.height * 3 // 4
        flags = " ".join(CHROMIUM_FLAGS)
        return (f"{CHROMIUM} {flags} --user-data-dir=/root/.config/chromium-gui --window-size={w},{h} "
                "--window-position=200,60 about:blank", "/tmp/chromium.log")
    raise TemplateError(f"unknown app {app!r}; use one of {', '.join(APPS)} or launch(command=...)")


class GuiWorkspace(Desktop):
    """A Workspace with a running X desktop and computer-use tools.

    Wraps a plain Workspace: `GuiWorkspace.attach(ws)` works on any workspace the template
    created, including fork clones returned as plain Workspaces.
    """

    editor_file: ClassVar[str] = EDITOR_FILE  # the file the editor app opens
    config_path: ClassVar[str] = CONFIG_PATH

    def __init__(self, ws: Workspace, config: GuiConfig | None = None) -> None:
        super().__init__(ws, config or GuiConfig())
        self.config: GuiConfig

    @classmethod
    def attach(cls, ws: Workspace) -> GuiWorkspace:
        raw = json.loads(str(ws.files.read(CONFIG_PATH)))
        raw["apps"] = tuple(raw.get("apps", ()))
        return cls(ws, GuiConfig(**raw))

    @property
    def env(self) -> dict[str, str]:
        # GSETTINGS_BACKEND=keyfile: settings come from GSETTINGS_KEYFILE below instead of dconf,
        # which wants a session bus that is not there.
        # NO_AT_BRIDGE: GTK would otherwise wait for an accessibility bus on every start.
        return {"DISPLAY": self.config.display, "GSETTINGS_BACKEND": "keyfile", "NO_AT_BRIDGE": "1",
                "XDG_RUNTIME_DIR": "/tmp/runtime-root", "XDG_CONFIG_HOME": "/root/.config"}

    def _x(self, cmd: str | list[str], timeout: float = 30, check: bool = True) -> str:
        return run(self.ws, cmd, env=self.env, timeout=timeout, check=check).stdout

    # ---- bring-up ----

    def start(self) -> None:
        """Bring it up inside its workspace, once (the module's start function calls it)."""
        cfg = self.config
        n = cfg.display.lstrip(":")
        self.ws.files.write(CONFIG_PATH, json.dumps(asdict(cfg)))
        run(self.ws, "mkdir -p /tmp/.X11-unix /tmp/runtime-root /root/Desktop /root/.config && "
                     "chmod 1777 /tmp/.X11-unix && chmod 700 /tmp/runtime-root")
        # -noreset: by default the server resets when its last client disconnects, so the
        # readiness probe's disconnect would make the window manager's connect fail.
        start_daemon(self.ws, f"Xvfb {cfg.display} -screen 0 {cfg.width}x{cfg.height}x24 -nolisten tcp "
                              "-ac -noreset +extension RANDR", "/tmp/xvfb.log")
        wait_until(lambda: self.ws.files.exists(f"/tmp/.X11-unix/X{n}") and
                   run(self.ws, "xdpyinfo >/dev/null 2>&1", env=self.env, check=False).ok,
                   f"Xvfb on {cfg.display} in {self.ws.id}", timeout=60)
        start_daemon(self.ws, "openbox", "/tmp/openbox.log", env=self.env)
        # The supporting-WM hint (wmctrl -m) appears early in openbox's start-up; a window
        # mapped before openbox adopts existing windows stays unmanaged forever. The client
        # list is set at the very end of start-up, so wait for that.
        wait_until(lambda: "WINDOW" in run(self.ws, "xprop -root _NET_CLIENT_LIST", env=self.env,
                                           check=False).stdout,
                   "openbox to manage the display", timeout=60)
        self.ws.files.write(GSETTINGS_KEYFILE, GSETTINGS)
        if "editor" in cfg.apps and not self.ws.files.exists(EDITOR_FILE):
            self.ws.files.write(EDITOR_FILE, "")
        for app in cfg.apps:
            self.launch(app)
        if cfg.live_view:
            self.start_live_view()

    def launch(self, app: str | None = None, command: str | None = None, wait_title: str | None = None,
               timeout: float = 30) -> Window | None:
        """Start a named app (terminal, editor, browser) or any command on the display; wait for
        its window (by title, default: the app's) and return it."""
        if command is None:
            if app is None:
                raise TemplateError("launch needs an app name or a command")
            command, log = _app_command(app, self.config)
            wait_title = wait_title or APP_TITLES[app]
        else:
            log = "/tmp/launch.log"
        start_daemon(self.ws, command, log, env=self.env)
        if wait_title is None:
            return None
        title = wait_title
        try:
            return wait_until(lambda: self.find_window(title), f"a window titled *{title}*", timeout)
        except TemplateError as e:
            tail = run(self.ws, f"tail -c 2000 {shlex.quote(log)}", check=False).stdout
            raise TemplateError(f"{e}; {command!r} logged:\n{tail}") from None

    # ---- observation ----

    def screenshot(self) -> bytes:
        """The whole screen as PNG bytes."""
        path = "/tmp/.bunshin-screenshot.png"
        self._x(["import", "-window", "root", f"png:{path}"])
        data = self.ws.files.read(path, format="bytes")
        assert isinstance(data, bytearray)
        return bytes(data)

    def windows(self) -> list[Window]:
        """Managed top-level windows, as the window manager lists them."""
        # Markers, not blank lines, part the three listings: while the first window maps, -lpG
        # can list nothing when -lx already lists it, and a blank-line split then read the
        # class listing as geometry.
        r = run(self.ws, f"wmctrl -lpG; echo {_CLASSES}; wmctrl -lx; echo {_ACTIVE}; xprop -root _NET_ACTIVE_WINDOW",
                env=self.env, check=False)
        # Before the first window maps, the WM has not set _NET_CLIENT_LIST and wmctrl fails.
        if not r.ok and "client list" not in r.stderr:
            raise TemplateError(f"wmctrl -lpG failed in {self.ws.id}: {r.stderr.strip()}")
        return _parse_windows(r.stdout)

    def find_window(self, title: str) -> Window | None:
        return next((w for w in self.windows() if title.lower() in w.title.lower()), None)

    def active_window(self) -> str:
        return self._x("xdotool getactivewindow getwindowname 2>/dev/null || true").strip()

    def cursor(self) -> tuple[int, int]:
        vals = dict(line.split("=", 1) for line in self._x(["xdotool", "getmouselocation", "--shell"]).split()
                    if "=" in line)
        return int(vals["X"]), int(vals["Y"])

    # ---- input ----

    def activate(self, title: str) -> Window:
        w = self.find_window(title)
        if w is None:
            raise TemplateError(f"no window titled *{title}*; windows: {[x.title for x in self.windows()]}")
        self._x(["wmctrl", "-i", "-a", w.id])
        wait_until(lambda: title.lower() in self.active_window().lower(), f"{title} to get the focus", 10)
        return w

    def move(self, x: int, y: int) -> None:
        self._x(["xdotool", "mousemove", "--sync", str(int(x)), str(int(y))])

    def click(self, x: int, y: int, button: int = 1, count: int = 1) -> None:
        self._x(["xdotool", "mousemove", "--sync", str(int(x)), str(int(y)),
                 "click", "--repeat", str(int(count)), "--delay", "80", str(int(button))])

    def double_click(self, x: int, y: int) -> None:
        self.click(x, y, count=2)

    def drag(self, x1: int, y1: int, x2: int, y2: int, button: int = 1) -> None:
        self._x(["xdotool", "mousemove", "--sync", str(x1), str(y1), "mousedown", str(button),
                 "mousemove", "--sync", str(x2), str(y2), "mouseup", str(button)])

    def type(self, text: str, delay_ms: int = 8) -> None:
        """Type text into the focused window as key presses (newlines press Return)."""
        for i, line in enumerate(text.split("\n")):
            if i:
                self.key("Return")
            if line:
                self._x(["xdotool", "type", "--delay", str(delay_ms), "--", line],
                        timeout=60 + len(line) * delay_ms / 1000)

    def key(self, combo: str) -> None:
        """Press key combinations, xdotool style: "ctrl+s", "Return", "ctrl+a BackSpace"."""
        self._x(["xdotool", "key", "--clearmodifiers", "--delay", "30", *combo.split()])

    def scroll(self, x: int, y: int, dy: int = 0, dx: int = 0) -> None:
        """Scroll at (x, y): positive dy scrolls down, positive dx right, in wheel clicks."""
        self.move(x, y)
        for amount, neg, pos in ((dy, "4", "5"), (dx, "6", "7")):
            if amount:
                self._x(["xdotool", "click", "--repeat", str(abs(amount)), "--delay", "30",
                         pos if amount > 0 else neg])

    # ---- clipboard ----

    def clipboard_set(self, text: str) -> None:
        path = "/tmp/.bunshin-clipboard"
        self.ws.files.write(path, text)
        # xclip stays behind to own the selection; its own session keeps it alive after this
        # command returns, and a fork carries it with the rest of the desktop.
        self._x(f"setsid -f xclip -selection clipboard -i {path} >/dev/null 2>&1 </dev/null")
        wait_until(lambda: self.clipboard_get() == text, "the clipboard to hold the new text", 10)

    def clipboard_get(self) -> str:
        return self._x("xclip -selection clipboard -o 2>/dev/null || true")

    # ---- live view ----

    def start_live_view(self) -> str:
        """x11vnc and noVNC's websockify, both on the workspace's own 127.0.0.1; returns the URL
        as seen inside the workspace. forward_live_view() makes it reachable from the host."""
        vnc = (f"x11vnc -display {self.config.display} -localhost -rfbport {LIVE_VIEW_VNC_PORT} "
               "-forever -shared -nopw -noxdamage -quiet")
        start_daemon(self.ws, vnc, "/tmp/x11vnc.log", env=self.env)
        return start_websockify(self.ws)

    def __repr__(self) -> str:
        return f"<GuiWorkspace {self.ws.id} {self.config.display} {self.config.width}x{self.config.height}>"


def start_gui(ws: Workspace, apps: Iterable[str] = APPS, width: int = 1280, height: int = 800,
              live_view: bool = False, display: str = ":1") -> GuiWorkspace:
    """Bring the desktop up inside an existing workspace (for set-up hooks that are handed one)."""
    apps = tuple(apps)
    for a in apps:
        _app_command(a, GuiConfig())  # reject unknown names before starting anything
    gui = GuiWorkspace(ws, GuiConfig(display=display, width=width, height=height, apps=apps, live_view=live_view))
    gui.start()
    return gui


def gui_workspace(apps: Iterable[str] = APPS, width: int = 1280, height: int = 800, live_view: bool = False,
                  display: str = ":1", **spec: Any) -> GuiWorkspace:
    """Create a workspace (WorkspaceSpec fields in `spec`) with a running desktop: Xvfb, openbox
    and the named apps, each window up before this returns."""
    apps = tuple(apps)
    for a in apps:
        _app_command(a, GuiConfig())
    ws = Workspace.create(**spec)
    try:
        return start_gui(ws, apps, width, height, live_view, display)
    except BaseException:
        with contextlib.suppress(BunshinError):
            ws.destroy()
        raise


def _parse_windows(stdout: str) -> list[Window]:
    """Window entries from windows()' three listings, as its one shell call prints them."""
    lines = stdout.splitlines()
    # A marker counts only as a whole line: wmctrl's own lines start with a window id, so a
    # title (a web page's, say) holding a marker cannot end a listing early.
    cut_classes = lines.index(_CLASSES) if _CLASSES in lines else len(lines)
    cut_active = lines.index(_ACTIVE) if _ACTIVE in lines else len(lines)
    geometry = "\n".join(lines[:cut_classes])
    classes = "\n".join(lines[cut_classes + 1:cut_active])
    active_line = " ".join(lines[cut_active + 1:])
    active = active_line.rsplit(None, 1)[-1] if "0x" in active_line else ""
    classes_by_id = {f[0]: f[2] for f in (line.split(None, 2) for line in classes.splitlines()) if len(f) == 3}
    out = []
    for line in geometry.splitlines():
        # id, desktop, pid, x, y, width, height, client host, title (may hold spaces). The
        # WM_CLASS column is read apart (_instance): an instance may hold spaces, and a split
        # of wmctrl -x's line put Chromium's client host (the workspace's hostname, which
        # differed in every fork before clones kept their source's) into its title, so a
        # replayed listing never matched.
        parts = line.split(None, 8)
        if len(parts) < 8:
            continue
        title = parts[8] if len(parts) > 8 else ""
        out.append(Window(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), int(parts[4]),
                          int(parts[5]), int(parts[6]), title,
                          app_id=_instance(classes_by_id.get(parts[0], ""), parts[7], title),
                          focused=bool(active) and int(parts[0], 16) == int(active.rstrip(","), 16)))
    return out


def _instance(body: str, host: str, title: str) -> str:
    """The WM_CLASS instance from the rest of a `wmctrl -lx` line ("instance.class host title"),
    given that window's host and title from `wmctrl -lpG`: an instance may hold spaces
    ("chromium-browser (/root/.config/chromium-gui)"), so it is what is left once the known end
    is taken off; "" if the window changed between the two listings."""
    end = f"{host} {title}".rstrip()
    body = body.rstrip()
    if not body.endswith(end):
        return ""
    return body[: len(body) - len(end)].rstrip().rsplit(".", 1)[0]
