"""What the template environments share."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from bunshinfork import BunshinError, Workspace

from ..calls.tools import Tool


def agent_tool(fn: Callable[..., str]) -> Callable[..., str]:
    """An agent sees a tool's failure as its observation, not as an exception of the rollout."""

    @functools.wraps(fn)  # the signature and docstring become the tool's schema
    def wrapped(ws: Workspace, **args: Any) -> str:
        try:
            return fn(ws, **args)
        except (BunshinError, ValueError, TypeError) as e:
            return f"ERROR: {e}"

    return wrapped


def tools_of(fns: Iterable[Callable[..., str]], nondeterministic: Iterable[str] = ()) -> list[Tool]:
    """Tools from `fn(ws, **args)` functions (parameters from their signatures, descriptions from
    their docstrings). nondeterministic: names whose output may differ from one run to the next
    in the same state (a screenshot catches a blinking caret), never served from a cache."""
    skip = set(nondeterministic)
    return [Tool.from_function(f, deterministic=f.__name__ not in skip) for f in fns]
