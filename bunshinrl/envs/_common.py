"""What the template environments share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bunshinfork import BunshinError, Workspace


def agent_tool(fn: Callable[..., str]) -> Callable[..., str]:
    """An agent sees a tool's failure as its observation, not as an exception of the rollout."""

    def wrapped(ws: Workspace, **args: Any) -> str:
        try:
            return fn(ws, **args)
        except (BunshinError, ValueError, TypeError) as e:
            return f"ERROR: {e}"

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped
