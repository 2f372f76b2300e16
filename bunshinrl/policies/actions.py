"""Candidate actions as text: what a task lists for a constrained decoder to choose from.

An action text is the canonical key of a tool call, `name{"arg":"value"}` (ToolCall.key, so
equal calls are equal text), or FINAL for "I am done". A model never writes these: what it
writes is parsed by bunshinrl.calls.replies; these are the suite's own vocabulary (candidate replies
are rendered from them, random baselines draw them).
"""

from __future__ import annotations

from typing import Any

from ..calls.policy import Action, FinalAnswer
from ..calls.signature import ToolCall

FINAL = "<final>"


def action_text(action: ToolCall | FinalAnswer) -> str:
    return FINAL if isinstance(action, FinalAnswer) else action.key


def call(name: str, **args: Any) -> str:
    """The action text of a tool call (what a task lists among its candidate actions)."""
    return ToolCall(name, args).key


def from_text(text: str) -> Action:
    """The action an action text stands for."""
    return FinalAnswer("") if text == FINAL else ToolCall.from_key(text)
