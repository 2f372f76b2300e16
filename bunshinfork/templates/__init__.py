"""Ready-made workspaces for agents: a GUI desktop and a WebArena-like web shop.

Each template is one call that returns a running workspace wrapper whose processes (display
server, applications, database, browser) all live inside the workspace, so fork() clones
the whole environment.
"""

from ._common import TemplateError
from .gui import GuiConfig, GuiWorkspace, Window, gui_workspace, start_gui
from .webshop import CATALOGUE, Browser, BrowserError, WebShopWorkspace, start_webshop, webshop_workspace

__all__ = [
    "CATALOGUE", "Browser", "BrowserError", "GuiConfig", "GuiWorkspace", "TemplateError", "WebShopWorkspace", "Window",
    "gui_workspace", "start_gui", "start_webshop", "webshop_workspace",
]
