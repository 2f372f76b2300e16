"""Wayland desktop template: sway (headless, pixman) and its clients INSIDE the workspace.

    with wayland_workspace() as desk:       # sway + foot + mousepad + Chromium (Ozone/Wayland)
        desk.click(900, 300); desk.type("hello"); desk.key("ctrl+s")
        png = desk.screenshot()
        a, b = desk.fork(2)                 # each clone: its own compositor, windows, focus,
                                            # cursor, clipboard and input stream

The compositor runs wlroots' headless backend with the pixman renderer: no GPU, no DRM or
input device, no host display. Its clients draw into wl_shm buffers (memfd) and talk to it
over the Wayland socket in the workspace's runtime directory, so a fork carries the
compositor and every client, buffers and sockets included. The tools are Wayland clients of
that compositor, run inside the workspace: grim (screencopy), wtype (virtual keyboard),
swaymsg (sway IPC: pointer, windows, focus), wl-copy/wl-paste (data control). Nothing on the
host talks to the compositor.

sway refuses to run as root, so the desktop runs as a workspace user of its own (DESKTOP_USER).
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
from . import _wtype
from ._common import TemplateError, add_user, run, start_daemon, wait_until
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

CONFIG_PATH = "/opt/bunshin/wayland.json"
APPS = ("terminal", "editor", "browser")
DESKTOP_USER, DESKTOP_UID = "desktop", 1000
HOME = f"/home/{DESKTOP_USER}"
EDITOR_FILE = f"{HOME}/Desktop/notes.txt"
RUNTIME_DIR = "/tmp/runtime-desktop"
SWAYSOCK = f"{RUNTIME_DIR}/sway-ipc.sock"
SWAY_CONFIG = f"{HOME}/.config/sway/config"
POINTER_FILE = "/tmp/.bunshin-pointer"
APP_IDS = {"terminal": "foot", "editor": "mousepad", "browser": "chromium-browser"}
AS_USER = f"setpriv --reuid={DESKTOP_UID} --regid={DESKTOP_UID} --clear-groups"
# GDK on Wayland reads cursor-blink from GSettings: a blinking caret would make two screenshots
# of an untouched desktop differ.
STEADY_CARET = """[org/gnome/desktop/interface]
cursor-blink=false
"""
BUTTONS = {1: "button1", 2: "button2", 3: "button3"}


@dataclass(frozen=True)
class WaylandConfig:
    width: int = 1280
    height: int = 800
    apps: tuple[str, ...] = APPS
    live_view: bool = False
    # Filled in once the compositor is up: its socket and Xwayland's display.
    wayland_display: str = ""
    x_display: str = ""


def _sway_config(cfg: WaylandConfig) -> str:
    # focus_follows_mouse no: moving the pointer must not move the keyboard focus (a tool's
    # move() would otherwise retarget the next type()); a click focuses, as on the X desktop.
    # xwayland enable: Xwayland starts with the first X client.
    return f"""output HEADLESS-1 resolution {cfg.width}x{cfg.height} position 0 0 bg #3a6ea5 solid_color
font pango:DejaVu Sans 10
default_border normal 2
focus_follows_mouse no
focus_on_window_activation focus
xwayland enable
seat seat0 xcursor_theme default 24
"""


def _app_command(app: str, cfg: WaylandConfig) -> str:
    if app == "terminal":
        return "foot --title Terminal --app-id foot"
    if app == "editor":
        return f"mousepad {shlex.quote(EDITOR_FILE)}"
    if app == "browser":
        flags = " ".join(CHROMIUM_FLAGS)
        return (f"{CHROMIUM} --ozone-platform=wayland {flags} --user-data-dir={HOME}/.config/chromium-wayland "
                "about:blank")
    raise TemplateError(f"unknown app {app!r}; use one of {', '.join(APPS)} or launch(command=...)")


class WaylandWorkspace(Desktop):
    """A Workspace with a running Wayland desktop and computer-use tools (GuiWorkspace's).

    `WaylandWorkspace.attach(ws)` works on any workspace the template created, including
    fork clones returned as plain Workspaces.
    """

    editor_file: ClassVar[str] = EDITOR_FILE  # the file the editor app opens
    config_path: ClassVar[str] = CONFIG_PATH

    def __init__(self, ws: Workspace, config: WaylandConfig | None = None) -> None:
        super().__init__(ws, config or WaylandConfig())
        self.config: WaylandConfig

    @classmethod
    def attach(cls, ws: Workspace) -> WaylandWorkspace:
        raw = json.loads(str(ws.files.read(CONFIG_PATH)))
        raw["apps"] = tuple(raw.get("apps", ()))
        return cls(ws, WaylandConfig(**raw))

    @property
    def env(self) -> dict[str, str]:
        # GDK_BACKEND=wayland: GTK would pick X11 through Xwayland's DISPLAY otherwise.
        # GSETTINGS_BACKEND, NO_AT_BRIDGE: as on the X desktop (no dconf, no session bus).
        env = {"HOME": HOME, "USER": DESKTOP_USER, "LOGNAME": DESKTOP_USER, "XDG_RUNTIME_DIR": RUNTIME_DIR,
               "XDG_CONFIG_HOME": f"{HOME}/.config", "SWAYSOCK": SWAYSOCK, "GDK_BACKEND": "wayland",
               "GSETTINGS_BACKEND": "keyfile", "NO_AT_BRIDGE": "1", "XDG_SESSION_TYPE": "wayland",
               # headless backend, pixman renderer: no DRM node, no GPU, no libinput devices
               "WLR_BACKENDS": "headless", "WLR_RENDERER": "pixman", "WLR_LIBINPUT_NO_DEVICES": "1"}
        if self.config.wayland_display:
            env["WAYLAND_DISPLAY"] = self.config.wayland_display
        if self.config.x_display:
            env["DISPLAY"] = self.config.x_display
        return env

    def _run(self, cmd: str, timeout: float = 30, check: bool = True) -> str:
        """`cmd` (shell) as the desktop user, with the desktop's environment."""
        return run(self.ws, f"{AS_USER} sh -c {shlex.quote(cmd)}", env=self.env, timeout=timeout,
                   check=check, cwd=HOME).stdout

    def _argv(self, argv: list[str], timeout: float = 30, check: bool = True) -> str:
        return self._run(shlex.join(argv), timeout=timeout, check=check)

    def _daemon(self, cmd: str, log: str) -> None:
        start_daemon(self.ws, f"{AS_USER} {cmd}", log, env=self.env, cwd=HOME)

    def swaymsg(self, *args: str, timeout: float = 30) -> Any:
        """One sway IPC request (swaymsg's arguments); the parsed JSON reply. A command that
        sway refuses raises TemplateError with sway's message."""
        out = self._argv(["swaymsg", "-r", *args], timeout=timeout, check=False)
        try:
            reply = json.loads(out)
        except json.JSONDecodeError:
            raise TemplateError(f"swaymsg {' '.join(args)} in {self.ws.id}: {out.strip()[:500]!r}") from None
        if isinstance(reply, list) and any(isinstance(r, dict) and r.get("success") is False for r in reply):
            errors = [r.get("error") for r in reply if isinstance(r, dict) and not r.get("success", True)]
            raise TemplateError(f"sway refused {' '.join(args)!r} in {self.ws.id}: {errors}")
        return reply

    def _pointer(self, *commands: str, at: tuple[int, int]) -> None:
        """sway IPC's seat commands, in one request; `at`: where they leave the pointer."""
        request = ", ".join(f"seat seat0 cursor {c}" for c in commands)
        self.swaymsg(request)
        self._run(f"echo {int(at[0])} {int(at[1])} > {POINTER_FILE}")

    # ---- bring-up ----

    def start(self) -> None:
        """Bring it up inside its workspace, once (the module's start function calls it)."""
        cfg = self.config
        add_user(self.ws, DESKTOP_USER, DESKTOP_UID, HOME, "/bin/bash")
        run(self.ws, f"mkdir -p {RUNTIME_DIR} {HOME}/Desktop {HOME}/.config/sway /tmp/.X11-unix /opt/bunshin && "
                     f"chmod 1777 /tmp/.X11-unix && chmod 700 {RUNTIME_DIR} && "
                     f"chown -R {DESKTOP_UID}:{DESKTOP_UID} {RUNTIME_DIR} {HOME}")
        self.ws.files.write(SWAY_CONFIG, _sway_config(cfg))
        self.ws.files.write(f"{HOME}/.config/{GSETTINGS_FILE}", GSETTINGS + STEADY_CARET)
        if "editor" in cfg.apps and not self.ws.files.exists(EDITOR_FILE):
            self.ws.files.write(EDITOR_FILE, "")
        run(self.ws, f"chown -R {DESKTOP_UID}:{DESKTOP_UID} {HOME}")
        self._daemon(f"sway -c {SWAY_CONFIG}", "/tmp/sway.log")

        def up() -> str:
            if not self.ws.files.exists(SWAYSOCK):
                return ""
            names = run(self.ws, f"ls {RUNTIME_DIR}", check=False).stdout.split()
            return next((n for n in names if n.startswith("wayland-") and not n.endswith(".lock")), "")

        try:
            display = wait_until(up, f"sway in {self.ws.id}", timeout=60)
        except TemplateError as e:
            tail = run(self.ws, "tail -c 2000 /tmp/sway.log", check=False).stdout
            raise TemplateError(f"{e}; sway logged:\n{tail}") from None
        # Xwayland (lazy) listens as soon as sway is up: its display is the X socket there.
        x_sockets = wait_until(lambda: self.ws.files.list("/tmp/.X11-unix"), "Xwayland's X socket", 30)
        x_display = ":" + sorted(e.name for e in x_sockets)[0].lstrip("X")
        self.config = cfg = WaylandConfig(**{**asdict(cfg), "wayland_display": display, "x_display": x_display})
        self.ws.files.write(CONFIG_PATH, json.dumps(asdict(cfg)))
        # wayvnc: the live view's VNC server, and the seat's standing pointer and keyboard. A
        # headless seat has no input device; without a pointer sway gives the seat no pointer
        # capability, clients bind no wl_pointer, and sway IPC's clicks reach nobody. wayvnc
        # creates a virtual pointer and keyboard at start-up and keeps them while it runs.
        self._daemon(f"wayvnc --max-fps=10 127.0.0.1 {LIVE_VIEW_VNC_PORT}", "/tmp/wayvnc.log")
        wait_until(lambda: len(self.swaymsg("-t", "get_inputs")) >= 2, "wayvnc's virtual pointer and keyboard", 30)
        for app in cfg.apps:
            self.launch(app)
        if cfg.live_view:
            self.start_live_view()

    def launch(self, app: str | None = None, command: str | None = None, wait_title: str | None = None,
               wait_app_id: str | None = None, timeout: float = 30) -> Window | None:
        """Start a named app (terminal, editor, browser) or any command as the desktop user;
        wait for its window (by app id, default: the app's; or by title) and return it."""
        if command is None:
            if app is None:
                raise TemplateError("launch needs an app name or a command")
            command = _app_command(app, self.config)
            log = f"/tmp/{app}.log"
            if wait_title is None:
                wait_app_id = wait_app_id or APP_IDS[app]
        else:
            log = "/tmp/launch.log"
        before = {w.id for w in self.windows()}
        self._daemon(command, log)
        if wait_title is None and wait_app_id is None:
            return None

        def appeared() -> Window | None:
            return next((w for w in self.windows() if w.id not in before and
                         (wait_app_id is None or w.app_id == wait_app_id) and
                         (wait_title is None or wait_title.lower() in w.title.lower())), None)

        try:
            window = wait_until(appeared, f"a window of {command!r}", timeout)
        except TemplateError as e:
            tail = run(self.ws, f"tail -c 2000 {shlex.quote(log)}", check=False).stdout
            raise TemplateError(f"{e}; {command!r} logged:\n{tail}") from None

        # A new window is listed before sway's layout transaction has placed it (an X client
        # first shows at its own size): return it once two reads agree.
        def settled() -> bool:
            nonlocal window
            now = next((w for w in self.windows() if w.id == window.id), window)
            same, window = now == window, now
            return same

        wait_until(settled, f"{window.title!r} to settle", 10)
        return window

    # ---- observation ----

    def screenshot(self) -> bytes:
        """The whole output as PNG bytes, read back through wlr-screencopy (grim). The pointer
        is in it: a headless output has no cursor plane, so sway draws the cursor into the frame."""
        path = "/tmp/.bunshin-screenshot.png"
        self._argv(["grim", "-t", "png", "-l", "1", path])
        return bytes(self.ws.files.read(path, format="bytes"))  # E2B's bytes format is a bytearray

    def windows(self) -> list[Window]:
        """Top-level windows (Wayland and Xwayland), as sway's tree lists them."""
        tree = self.swaymsg("-t", "get_tree")
        out: list[Window] = []

        def walk(node: dict, desktop: int) -> None:
            if node.get("type") == "workspace":
                name = str(node.get("name", ""))
                desktop = int(name) if name.isdigit() else -1
            if node.get("type") in ("con", "floating_con") and node.get("pid"):
                r, wr = node["rect"], node.get("window_rect") or {"x": 0, "y": 0, **node["rect"]}
                app_id = node.get("app_id") or (node.get("window_properties") or {}).get("instance") or ""
                out.append(Window(str(node["id"]), desktop, int(node["pid"]), r["x"] + wr["x"], r["y"] + wr["y"],
                                  wr["width"], wr["height"], node.get("name") or "", app_id,
                                  bool(node.get("focused"))))
            for child in node.get("nodes", []) + node.get("floating_nodes", []):
                walk(child, desktop)

        walk(tree, -1)
        return out

    def find_window(self, title: str) -> Window | None:
        """The first window whose title or app id contains `title` (case-insensitive)."""
        t = title.lower()
        return next((w for w in self.windows() if t in w.title.lower() or t == w.app_id.lower()), None)

    def active_window(self) -> str:
        """The focused window's title ('' when none has the focus)."""
        return next((w.title for w in self.windows() if w.focused), "")

    def cursor(self) -> tuple[int, int]:
        """Where the tools last put the pointer. sway's IPC moves the pointer but has no request
        that reads it back; the compositor's own drawing of it is in screenshot()."""
        raw = self._run(f"cat {POINTER_FILE} 2>/dev/null || true").split()
        return (int(raw[0]), int(raw[1])) if len(raw) == 2 else (0, 0)

    # ---- input ----

    def activate(self, title: str) -> Window:
        w = self.find_window(title)
        if w is None:
            raise TemplateError(f"no window titled *{title}*; windows: {[x.title for x in self.windows()]}")
        self.swaymsg(f"[con_id={w.id}] focus")
        wait_until(lambda: any(x.focused and x.id == w.id for x in self.windows()), f"{title} to get the focus", 10)
        return w

    def move(self, x: int, y: int) -> None:
        self._pointer(f"set {int(x)} {int(y)}", at=(x, y))

    def click(self, x: int, y: int, button: int = 1, count: int = 1) -> None:
        name = BUTTONS.get(int(button), f"button{int(button)}")
        self._pointer(f"set {int(x)} {int(y)}", *[f"{a} {name}" for _ in range(int(count))
                                                 for a in ("press", "release")], at=(x, y))

    def double_click(self, x: int, y: int) -> None:
        self.click(x, y, count=2)

    def drag(self, x1: int, y1: int, x2: int, y2: int, button: int = 1) -> None:
        name = BUTTONS.get(int(button), f"button{int(button)}")
        self._pointer(f"set {x1} {y1}", f"press {name}", f"set {(x1 + x2) // 2} {(y1 + y2) // 2}",
                      f"set {x2} {y2}", f"release {name}", at=(x2, y2))

    def type(self, text: str, delay_ms: int = 8) -> None:
        """Type text into the focused window through a virtual keyboard (newlines press Return)."""
        self._wtype(_wtype.text_steps(text), delay_ms)

    def key(self, combo: str) -> None:
        """Press key combinations, xdotool style: "ctrl+s", "Return", "ctrl+a BackSpace"."""
        self._wtype(_wtype.combo_steps(combo), 30)

    def _wtype(self, steps: list[tuple[str, str]], delay_ms: int) -> None:
        for argv in _wtype.argv(steps, delay_ms):
            self._argv(argv, timeout=60 + len(argv) * (delay_ms + 5) / 1000)

    def scroll(self, x: int, y: int, dy: int = 0, dx: int = 0) -> None:
        """Scroll at (x, y): positive dy scrolls down, positive dx right, in wheel clicks."""
        steps = [f"set {int(x)} {int(y)}"]
        for amount, neg, pos in ((dy, "button4", "button5"), (dx, "button6", "button7")):
            steps += [f"press {pos if amount > 0 else neg}"] * abs(int(amount))
        self._pointer(*steps, at=(x, y))

    # ---- clipboard ----

    def clipboard_set(self, text: str) -> None:
        path = "/tmp/.bunshin-clipboard"
        self.ws.files.write(path, text)
        run(self.ws, f"chown {DESKTOP_UID} {path}")
        # wl-copy stays behind to serve the selection (through wlr-data-control, so it needs
        # no focused surface); its own session keeps it alive after this command returns, and
        # a fork carries it with the rest of the desktop.
        self._run(f"setsid -f wl-copy < {path} >/dev/null 2>&1")
        wait_until(lambda: self.clipboard_get() == text, "the clipboard to hold the new text", 10)

    def clipboard_get(self) -> str:
        return self._run("wl-paste --no-newline 2>/dev/null || true")

    # ---- live view ----

    def start_live_view(self) -> str:
        """noVNC's websockify in front of the workspace's wayvnc, on the workspace's own
        127.0.0.1; returns the URL as seen inside it. forward_live_view() reaches it from the host."""
        return start_websockify(self.ws)

    def __repr__(self) -> str:
        return f"<WaylandWorkspace {self.ws.id} {self.config.width}x{self.config.height}>"


def start_wayland(ws: Workspace, apps: Iterable[str] = APPS, width: int = 1280, height: int = 800,
                  live_view: bool = False) -> WaylandWorkspace:
    """Bring the Wayland desktop up inside an existing workspace (for set-up hooks)."""
    apps = tuple(apps)
    for a in apps:
        _app_command(a, WaylandConfig())  # reject unknown names before starting anything
    desk = WaylandWorkspace(ws, WaylandConfig(width=width, height=height, apps=apps, live_view=live_view))
    desk.start()
    return desk


def wayland_workspace(apps: Iterable[str] = APPS, width: int = 1280, height: int = 800, live_view: bool = False,
                      **spec: Any) -> WaylandWorkspace:
    """Create a workspace (WorkspaceSpec fields in `spec`) with a running Wayland desktop: sway,
    wayvnc and the named apps, each window up before this returns."""
    apps = tuple(apps)
    for a in apps:
        _app_command(a, WaylandConfig())
    ws = Workspace.create(**spec)
    try:
        return start_wayland(ws, apps, width, height, live_view)
    except BaseException:
        with contextlib.suppress(BunshinError):
            ws.destroy()
        raise
