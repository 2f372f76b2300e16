"""Desktop task on the Wayland desktop: gui.py's task and tools, with sway, foot and mousepad.

    env = make_env(target="Meeting moved to Friday 10:00")
    ws = env.create()                       # sway (headless) + foot + mousepad on notes.txt
    for clone in ws.fork(8): ...            # each clone: its own compositor and clients
    env.reward(clone)                       # 1.0 when notes.txt holds exactly the target
"""

from __future__ import annotations

from typing import Any

from ..calls.task import Task
from .gui import DEFAULT_TARGET, INITIAL_TEXT, NOTES_ON, TOOLS, reward_for
from .gui import make_env as _make_env

NOTES = NOTES_ON["wayland"]

__all__ = ["DEFAULT_TARGET", "NOTES", "TOOLS", "make_env", "reward"]


def make_env(target: str = DEFAULT_TARGET, initial_text: str = INITIAL_TEXT, width: int = 1280, height: int = 800,
             apps: tuple[str, ...] = ("terminal", "editor"), settle: float = 0.0, **spec: Any) -> Task:
    """The desktop editing task on the Wayland desktop. `spec` holds WorkspaceSpec fields;
    settle: OSWorld's settle pause after each action, in seconds (gui.make_env)."""
    return _make_env(target, initial_text, width, height, apps, desktop="wayland", settle=settle, **spec)


reward = reward_for(DEFAULT_TARGET, "wayland")
