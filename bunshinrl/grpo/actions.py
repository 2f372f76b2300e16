"""Actions as text: the one format every policy backend emits and parses.

An action is the canonical key of a tool call, `name{"arg":"value"}` (ToolCall.key, so equal
calls are equal text), or FINAL for "I am done". A constrained decoder chooses among such texts;
an OpenAI-compatible server returns them as tool_calls; a free-form model may wrap them in
<tool_call> JSON. parse_action accepts all three.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..policy import Action, FinalAnswer
from ..signature import ToolCall

FINAL = "<final>"

_TOOL_CALL_TAG = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def action_text(action: Action) -> str:
    return FINAL if isinstance(action, FinalAnswer) else action.key


def call(name: str, **args: Any) -> str:
    """The action text of a tool call (what a task lists among its candidate actions)."""
    return ToolCall(name, args).key


def _from_json_object(obj: Mapping[str, Any]) -> ToolCall | None:
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("args", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, Mapping):
        return None
    return ToolCall(name, args)


def parse_action(text: str) -> Action:
    """The action a model's text stands for; anything that is not a tool call is its final answer."""
    s = text.strip()
    if s == FINAL:
        return FinalAnswer("")
    m = _TOOL_CALL_TAG.search(s)
    candidates = [m.group(1)] if m else []
    if s.startswith("{"):
        candidates.append(s)
    for c in candidates:
        try:
            obj = json.loads(c)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, Mapping) and (tc := _from_json_object(obj)) is not None:
            return tc
    i = s.find("{")
    if i > 0 and s[:i].replace("_", "").isalnum():
        try:
            return ToolCall.from_key(s)
        except (ValueError, json.JSONDecodeError):
            pass
    return FinalAnswer(text)
