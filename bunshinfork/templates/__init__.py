"""Ready-made workspaces for agents: an X11 desktop, a Wayland desktop and a WebArena-like web shop.

Each template is one call that returns a running workspace wrapper whose processes (display
server or compositor, applications, database, browser) all live inside the workspace, so
fork() clones the whole environment.
"""

from ..workspace import Workspace
from ._common import TemplateError, wait_until
from ._desktop import Window
from .gui import GuiConfig, GuiWorkspace, gui_workspace, start_gui
from .wayland import WaylandConfig, WaylandWorkspace, start_wayland, wayland_workspace
from .webshop import (
    CATALOGUE,
    Browser,
    BrowserError,
    WebShopWorkspace,
    start_shop,
    start_webshop,
    webshop_workspace,
)


def attach_desktop(ws: Workspace) -> GuiWorkspace | WaylandWorkspace:
    """The desktop (X11 or Wayland) that one of the desktop templates brought up in `ws`."""
    if ws.files.exists(WaylandWorkspace.config_path):
        return WaylandWorkspace.attach(ws)
    if ws.files.exists(GuiWorkspace.config_path):
        return GuiWorkspace.attach(ws)
    raise TemplateError(f"{ws.id} runs no desktop template")


__all__ = [
    "CATALOGUE", "Browser", "BrowserError", "GuiConfig", "GuiWorkspace", "TemplateError", "WaylandConfig",
    "WaylandWorkspace", "WebShopWorkspace", "Window", "attach_desktop", "gui_workspace", "start_gui", "start_shop",
    "start_wayland", "start_webshop", "wait_until", "wayland_workspace", "webshop_workspace",
]
