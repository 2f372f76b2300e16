"""A trajectory as a chat, and a model's reply as an action.

Every backend (HF in process, a vLLM server, in-process vLLM) renders the same messages in the
OpenAI chat-completions format, so the model's own chat template, applied by transformers here
or by the server there, turns them into the prompt. Replies are parsed in the model family's
format: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks, or a bare JSON object
`{"name": ..., "arguments": ...}`. Anything else is the final answer. A reply that tries to call
a tool and fails (broken JSON, an unclosed tag, no name, arguments that do not fit the tool's
schema) becomes a call of the hidden INVALID_TOOL, whose observation tells the model what was
wrong ("invalid tool call: ..."), so the episode goes on instead of crashing. Parallel tool calls
are switched off: the first call of a reply is the action (what vLLM does with
parallel_tool_calls=false).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..adapters.openai_tools import is_hidden, validate_args
from ..policy import Action, FinalAnswer, Step
from ..signature import ToolCall
from ..tools import Tool, ToolSet
from .actions import FINAL, parse_action

if TYPE_CHECKING:
    from .tasks import VerifiableTask

SYSTEM_PROMPT = ("You operate a Linux workspace through tools. Call one tool at a time. When the task is "
                 "done, reply without a tool call.")
INVALID_TOOL = "__invalid__"  # hidden: the harness's answer to a call it could not parse
FINAL_TEXT = "Done."  # the reply that stands for FINAL among a task's candidate replies

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


def render_call(call: ToolCall) -> str:
    """A tool call as Hermes/Qwen2.5 chat templates write it (what a model is trained to emit)."""
    return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.args}, ensure_ascii=False) + \
        "\n</tool_call>"


def render_action(action_text: str) -> str:
    """A task's candidate action (an action text, or FINAL) as the reply a model gives for it."""
    if action_text == FINAL:
        return FINAL_TEXT
    action = parse_action(action_text)
    if not isinstance(action, ToolCall):
        raise ValueError(f"not a tool call: {action_text!r}")
    return render_call(action)


def candidate_replies(task: VerifiableTask) -> tuple[str, ...]:
    """What constrained decoding may produce for `task`: its candidate actions as replies."""
    return tuple(render_action(a) for a in task.actions)


def invalid(reason: str, text: str) -> ToolCall:
    return ToolCall(INVALID_TOOL, {"error": reason, "text": text})


def invalid_tool() -> Tool:
    """The hidden tool an unparseable reply is routed to: it touches nothing and says why."""

    def execute(_ws: Any, args: dict[str, Any]) -> str:
        return f"invalid tool call: {args.get('error', '')}"

    return Tool(INVALID_TOOL, execute, description="the harness's answer to a malformed tool call")


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
    if isinstance(args, str):  # OpenAI's wire format carries the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"arguments are not JSON: {e.msg}"
    if not isinstance(args, Mapping):
        return "\"arguments\" must be a JSON object"
    return ToolCall(name, args)


def parse_reply(text: str, tools: ToolSet | Mapping[str, Tool] | None = None) -> Action:
    """A model's reply text as an action. With `tools`, a call must name one of them (hidden
    tools are never callable) and fit its schema, else it is an invalid call."""
    s = text.strip()
    found = _TOOL_CALL.search(s)
    if found is not None:
        if not found.group(2):
            return invalid("unterminated <tool_call>", text)
        call = _call_from_json(found.group(1).strip())
    elif s.startswith("{") and s.endswith("}"):
        call = _call_from_json(s)
    else:
        return FinalAnswer(text)
    if isinstance(call, str):
        return invalid(call, text)
    if is_hidden(call.name):
        return invalid(f"no tool named {call.name!r}", text)
    if tools is not None:
        tool = tools.get(call.name)
        if tool is None:
            return invalid(f"no tool named {call.name!r}; tools: {', '.join(sorted(tools))}", text)
        problem = validate_args(tool, call.args)
        if problem is not None:
            return invalid(problem, text)
    return call


def parse_message(message: Mapping[str, Any], tools: ToolSet | Mapping[str, Tool] | None = None) -> Action:
    """A chat-completions assistant message (a server parsed its tool calls) as an action: the
    first tool call, else its text."""
    calls = message.get("tool_calls") or []
    if calls:
        fn = calls[0].get("function") or {}
        blob = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments") or "{}"})
        return parse_reply("<tool_call>" + blob + "</tool_call>", tools)
    return parse_reply(message.get("content") or "", tools)


def messages(prompt: str, history: Sequence[Step], system: str | None = SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The trajectory so far as chat-completions messages: the task, then per step the
    assistant's call (OpenAI format, arguments as a JSON string) and the tool's result. An
    invalid call is the model's own text answered by a user turn with the complaint."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": prompt})
    for i, s in enumerate(history):
        if s.call.name == INVALID_TOOL:
            msgs.append({"role": "assistant", "content": s.call.args.get("text", "")})
            msgs.append({"role": "user", "content": s.observation})
            continue
        cid = f"call_{i}"
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": s.call.name, "arguments": s.call.canonical_args}}]})
        msgs.append({"role": "tool", "tool_call_id": cid, "content": s.observation})
    return msgs


def template_messages(msgs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template wants them: tool-call arguments as objects (Qwen's, Llama's and
    Hermes' templates apply `tojson` to them), which is also what vLLM hands its templates."""
    out = []
    for m in msgs:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": _args(tc["function"]["arguments"])}}
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


def _args(a: Any) -> Any:
    return json.loads(a) if isinstance(a, str) else a


__all__ = ["FINAL_TEXT", "INVALID_TOOL", "SYSTEM_PROMPT", "candidate_replies", "invalid", "invalid_tool", "messages",
           "parse_message", "parse_reply", "render_action", "render_call", "template_messages"]
