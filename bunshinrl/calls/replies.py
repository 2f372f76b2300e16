"""A model's reply as an action: the one parser every policy backend and framework adapter uses.

Replies are read in the format chat templates teach models (Hermes/Qwen and Llama-style):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, or a bare JSON object
`{"name": ..., "arguments": ...}` (arguments may be an object or, as OpenAI's wire format
carries them, a JSON string). Several blocks in one reply are parallel tool calls: they run in
order. Anything else is the final answer. A reply that tries to call a tool and fails (broken
JSON, an unclosed tag, no name, a tool that does not exist or is hidden, arguments that do not
fit its schema) becomes a call of the hidden INVALID_TOOL, whose observation says what was
wrong, so the episode goes on instead of crashing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .policy import Action, FinalAnswer
from .signature import ToolCall
from .task import INVALID_TOOL, invalid_call
from .tools import Tool, is_hidden

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


def render_call(call: ToolCall) -> str:
    """A tool call as Hermes/Qwen2.5 chat templates write it (what a model is trained to emit)."""
    return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.args}, ensure_ascii=False) + \
        "\n</tool_call>"


def _call_from_json(blob: str) -> ToolCall | str:
    """The call a JSON object stands for, or why it is not one."""
    try:
        obj = json.loads(blob)
    except json.JSONDecodeError as e:
        return f"{e.msg} at character {e.pos}"
    if not isinstance(obj, Mapping):
        return "a tool call must be a JSON object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a \"name\""
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"arguments are not JSON: {e.msg}"
    if not isinstance(args, Mapping):
        return "\"arguments\" must be a JSON object"
    return ToolCall(name, args)


def _checked(call: ToolCall | str, text: str, tools: Mapping[str, Tool] | None) -> ToolCall:
    if isinstance(call, str):
        return invalid_call(call, text)
    if is_hidden(call.name):
        return invalid_call(f"no tool named {call.name!r}", text)
    if tools is not None:
        tool = tools.get(call.name)
        if tool is None:
            return invalid_call(f"no tool named {call.name!r}; tools: {', '.join(sorted(tools))}", text)
        problem = tool.check(call.args)
        if problem is not None:
            return invalid_call(problem, text)
    return call


def parse_reply(text: str, tools: Mapping[str, Tool] | None = None, *, parallel: bool = True) -> Action:
    """A model's reply text as an action. With `tools`, a call must name one of them and fit
    its schema, else it is an invalid call. parallel=False keeps only the first call (what a
    server does with parallel_tool_calls=false)."""
    s = text.strip()
    blocks = list(_TOOL_CALL.finditer(s))
    if blocks:
        calls = []
        for b in blocks:
            if not b.group(2):
                calls.append(invalid_call("unterminated <tool_call>", text))
                break
            calls.append(_checked(_call_from_json(b.group(1).strip()), text, tools))
    elif s.startswith("{") and s.endswith("}"):
        calls = [_checked(_call_from_json(s), text, tools)]
    else:
        return FinalAnswer(text)
    if not parallel or len(calls) == 1:
        return calls[0]
    # One bad call voids the reply: the model sees its own text and the first complaint, rather
    # than half of its calls run.
    return next((c for c in calls if c.name == INVALID_TOOL), None) or tuple(calls)


def parse_message(message: Mapping[str, Any], tools: Mapping[str, Tool] | None = None, *,
                  parallel: bool = True) -> Action:
    """A chat-completions assistant message (the server parsed its tool calls) as an action:
    its tool calls, else its text."""
    calls = message.get("tool_calls") or []
    if not calls:
        return parse_reply(message.get("content") or "", tools)
    text = "".join("<tool_call>" + json.dumps({"name": (c.get("function") or {}).get("name"),
                                                "arguments": (c.get("function") or {}).get("arguments") or "{}"})
                   + "</tool_call>" for c in calls)
    return parse_reply(text, tools, parallel=parallel)


__all__ = ["parse_message", "parse_reply", "render_call"]
