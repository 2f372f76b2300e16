"""LibreOffice on a workspace's X11 desktop, for the office task: the environment soffice runs
with, waits with deadlines, and the observation each action makes (the windows by title)."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any

from bunshinfork import BunshinError, Workspace
from bunshinfork.templates import GuiWorkspace, wait_until

# LibreOffice in a workspace: HOME fixed (the workspace's commands get none) and a UTF-8 C
# locale, the same in every workspace. The GUI adds the X11 `gen` plugin (the GTK one would look
# for a session bus and the accessibility bus) and no Skia (it would probe Vulkan; the raster
# path draws the same on Xvfb); the headless converter must not have the plugin set, or it
# opens the display it does not have.
ENV = {"HOME": "/root", "LANG": "C.UTF-8"}
GUI_ENV = {**ENV, "SAL_USE_VCLPLUGIN": "gen", "SAL_DISABLESKIA": "1"}


class OfficeError(BunshinError):
    """A LibreOffice step did not finish within its deadline (no window, no save, no PDF)."""


def desktop(ws: Workspace) -> GuiWorkspace:
    return GuiWorkspace.attach(ws)


def env_prefix(env: dict[str, str] = ENV) -> str:
    return "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


def file_stat(ws: Workspace, path: str) -> str:
    """Inode, size and modification time of a file ('' when it is not there)."""
    r = ws.commands.run(f"stat -c '%i %s %.9Y' {shlex.quote(path)} 2>/dev/null || true", timeout=30)
    return r.stdout.strip()  # type: ignore[union-attr]


def wait_for(probe: Callable[[], Any], what: str, timeout: float) -> Any:
    """Poll `probe` until it returns something true (the templates' wait_until); OfficeError once
    `timeout` has passed."""
    return wait_until(probe, what, timeout, error=OfficeError)


def windows_line(g: GuiWorkspace) -> str:
    """The windows by title, the focused one marked: what each action observes after it acts."""
    wins = g.windows()
    if not wins:
        return "windows: none"
    return "windows: " + "; ".join(f"{w.title!r}" + (" [active]" if w.focused else "") for w in wins)


def observe(ws: Workspace) -> str:
    try:
        return windows_line(desktop(ws))
    except BunshinError as e:
        return f"windows: ERROR: {e}"
