"""A trajectory as a chat, in the OpenAI chat-completions format.

Every backend (HF in process, a vLLM server, in-process vLLM) renders the same messages, so the
model's own chat template, applied by transformers here or by the server there, turns them into
the prompt. Replies are parsed by bunshinrl.calls.replies (Hermes/Qwen `<tool_call>` blocks or bare
JSON; a malformed call becomes the hidden INVALID_TOOL, whose observation tells the model what
was wrong). The calls of one decision (parallel tool calls) are one assistant message with
several tool_calls, followed by one tool message each.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..calls.policy import Step
from ..calls.replies import render_call
from ..calls.signature import ToolCall
from ..calls.task import INVALID_TOOL, Task
from .actions import FINAL, from_text

SYSTEM_PROMPT = ("You operate a Linux workspace through tools. Call one tool at a time. When the task is "
                 "done, reply without a tool call.")
FINAL_TEXT = "Done."  # the reply that stands for FINAL among a task's candidate replies


def render_action(action_text: str) -> str:
    """A task's candidate action (an action text, or FINAL) as the reply a model gives for it."""
    if action_text == FINAL:
        return FINAL_TEXT
    action = from_text(action_text)
    if not isinstance(action, ToolCall):
        raise ValueError(f"not a tool call: {action_text!r}")
    return render_call(action)


def candidate_replies(task: Task) -> tuple[str, ...]:
    """What constrained decoding may produce for `task`: its candidate actions as replies."""
    return tuple(render_action(a) for a in task.actions)


def messages(prompt: str, history: Sequence[Step], system: str | None = SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The trajectory so far as chat-completions messages: the task, then per decision the
    assistant's call(s) (OpenAI format, arguments as a JSON string) and each tool's result. An
    invalid call is the model's own text answered by a user turn with the complaint."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": prompt})
    for _, group in itertools.groupby(enumerate(history), key=lambda e: e[1].decision if e[1].decision >= 0 else e[0]):
        indexed = list(group)
        steps = [s for _, s in indexed]
        if steps[0].call.name == INVALID_TOOL:
            msgs.append({"role": "assistant", "content": steps[0].call.args.get("text", "")})
            msgs.append({"role": "user", "content": steps[0].observation})
            continue
        ids = [f"call_{i}" for i, _ in indexed]
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": s.call.name, "arguments": s.call.canonical_args}}
            for cid, s in zip(ids, steps, strict=True)]})
        msgs.extend({"role": "tool", "tool_call_id": cid, "content": s.observation}
                    for cid, s in zip(ids, steps, strict=True))
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


__all__ = ["FINAL_TEXT", "SYSTEM_PROMPT", "candidate_replies", "messages", "render_action", "template_messages"]
