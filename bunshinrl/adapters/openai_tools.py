"""OpenAI function-calling schemas for a bunshinrl tool set.

bunshinrl's Tool carries no parameter schema (the engine never needs one), but every serving
stack that parses tool calls (vLLM, SGLang, the OpenAI API, verl's tool config) does. SchemaTool
adds one without changing how the engine runs a tool; tool_schemas() renders any tool set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..tools import Tool, ToolSet

# Tools whose names start with this are the harness's own (the reward check): the engine runs
# them, but a model must never be offered them, or it could call the grader.
HIDDEN_PREFIX = "__"

# Used when a tool says nothing about its parameters: any JSON object is accepted.
OPEN_OBJECT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": True}


@dataclass(frozen=True)
class SchemaTool(Tool):
    """A Tool with a JSON-Schema for its arguments (an "object" schema)."""

    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(OPEN_OBJECT))


def string_params(*names: str, descriptions: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An object schema whose properties are all required strings (what the suite's tools take)."""
    descriptions = descriptions or {}
    props = {n: {"type": "string", **({"description": descriptions[n]} if n in descriptions else {})}
             for n in names}
    return {"type": "object", "properties": props, "required": list(names), "additionalProperties": False}


def is_hidden(name: str) -> bool:
    return name.startswith(HIDDEN_PREFIX)


def tool_schema(tool: Tool) -> dict[str, Any]:
    """One tool in the `tools` format of chat completions."""
    params = getattr(tool, "parameters", None) or OPEN_OBJECT
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or tool.name,
            "parameters": dict(params),
        },
    }


def tool_schemas(tools: ToolSet | Iterable[Tool], *, include_hidden: bool = False) -> list[dict[str, Any]]:
    """Schemas of every tool a model may call, in the tool set's order."""
    items = tools.values() if isinstance(tools, Mapping) else tools
    return [tool_schema(t) for t in items if include_hidden or not is_hidden(t.name)]


def validate_args(tool: Tool, args: Mapping[str, Any]) -> str | None:
    """Why `args` do not fit the tool's schema (required keys, unknown keys, string types), or
    None. Deliberately a small subset of JSON Schema: enough to reject a malformed model call
    before it reaches a workspace, without a jsonschema dependency."""
    params = getattr(tool, "parameters", None)
    if not params:
        return None
    props: Mapping[str, Any] = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"missing argument(s) {', '.join(missing)} for {tool.name}"
    if params.get("additionalProperties") is False:
        extra = sorted(set(args) - set(props))
        if extra:
            return f"unknown argument(s) {', '.join(extra)} for {tool.name}"
    for k, v in args.items():
        if props.get(k, {}).get("type") == "string" and not isinstance(v, str):
            return f"argument {k} of {tool.name} must be a string"
    return None
