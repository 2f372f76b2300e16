"""Tools: what a policy can call inside a workspace.

One shape everywhere: an OpenAI function schema (name, description, JSON-Schema parameters)
plus a callable `execute(ws, args) -> str`: a sync function (run on a worker thread, since it may
block on the workspace) or a coroutine function (awaited on the event loop; wrap the workspace
in bunshinfork's AsyncWorkspace to run its commands there). The engine runs the callable; every serving stack
that parses tool calls (vLLM, the OpenAI API, verl's tool config, SkyRL's prompts) reads the
schema. Names starting with `__` are the harness's own (the task's verifier, the answer to a
malformed call): the engine runs them, but they are never offered to a model.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from bunshinfork import AsyncWorkspace, Workspace

from .._async import call_sync_or_async
from .cpu_slots import running_tool

Execute = Callable[[Workspace, dict[str, Any]], "str | Awaitable[str]"]

HIDDEN_PREFIX = "__"

# Used when a tool says nothing about its parameters: any JSON object is accepted.
OPEN_OBJECT: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": True}

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def is_hidden(name: str) -> bool:
    return name.startswith(HIDDEN_PREFIX)


@dataclass(frozen=True)
class Tool:
    """A named operation on a workspace returning an observation string.

    parameters: the JSON Schema ("object") of its arguments, as OpenAI function calling writes it.
    deterministic=False declares that two executions from the same state may observe different
    things (clocks, randomness, remote services); such a tool is never served from the prefix
    cache or from speculation, because its recorded result is not what a fresh call would see.
    """

    name: str
    execute: Execute
    deterministic: bool = True
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(OPEN_OBJECT))

    @classmethod
    def from_function(cls, fn: Callable[..., str], *, name: str | None = None, deterministic: bool = True,
                      description: str | None = None) -> Tool:
        """A tool from `fn(ws, **args) -> str`: the parameters from its signature (annotated
        str/int/float/bool/list/dict; those without a default are required), the description
        from its docstring."""
        hints = typing.get_type_hints(fn)
        props: dict[str, Any] = {}
        required = []
        for p in list(inspect.signature(fn).parameters.values())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"{fn.__name__}: *args/**kwargs have no schema")
            kind = _JSON_TYPES.get(hints.get(p.name, str))
            if kind is None:
                raise TypeError(f"{fn.__name__}: parameter {p.name} is {hints[p.name]!r}, not a JSON type")
            props[p.name] = {"type": kind}
            if p.default is p.empty:
                required.append(p.name)

        def execute(ws: Workspace, args: dict[str, Any]) -> str:
            return fn(ws, **args)

        doc = description if description is not None else inspect.getdoc(fn) or ""
        return cls(name or fn.__name__, execute, deterministic, doc,
                   {"type": "object", "properties": props, "required": required, "additionalProperties": False})

    @property
    def hidden(self) -> bool:
        return is_hidden(self.name)

    def schema(self) -> dict[str, Any]:
        """The tool in the `tools` format of chat completions."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description or self.name,
                             "parameters": dict(self.parameters)}}

    def check(self, args: Mapping[str, Any]) -> str | None:
        """Why `args` do not fit the parameters (required keys, unknown keys, JSON types), or
        None. Deliberately a small subset of JSON Schema: enough to reject a malformed model call
        before it reaches a workspace, without a jsonschema dependency."""
        params = self.parameters
        props: Mapping[str, Any] = params.get("properties", {})
        missing = [k for k in params.get("required", []) if k not in args]
        if missing:
            return f"missing argument(s) {', '.join(missing)} for {self.name}"
        if params.get("additionalProperties") is False:
            extra = sorted(set(args) - set(props))
            if extra:
                return f"unknown argument(s) {', '.join(extra)} for {self.name}"
        for k, v in args.items():
            want = props.get(k, {}).get("type")
            if want is not None and not _is_json_type(v, want):
                return f"argument {k} of {self.name} must be {'an' if want[0] in 'aeiou' else 'a'} {want}"
        return None

    async def run(self, ws: Workspace, args: Mapping[str, Any]) -> str:
        with running_tool(self.name):  # CPU slots it holds are counted as its own
            out = await call_sync_or_async(self.execute, ws, dict(args))
        if not isinstance(out, str):
            raise TypeError(f"tool {self.name!r} returned {type(out).__name__}, not an observation string")
        return out


def _is_json_type(v: Any, want: str | list[str]) -> bool:
    kinds = [want] if isinstance(want, str) else list(want)
    for k in kinds:
        if k == "integer" and isinstance(v, int) and not isinstance(v, bool):
            return True
        if k == "number" and isinstance(v, int | float) and not isinstance(v, bool):
            return True
        if k in ("string", "boolean", "array", "object", "null") and isinstance(
                v, {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}[k]):
            return True
        if k not in ("integer", "number", "string", "boolean", "array", "object", "null"):
            return True  # a type this subset does not check
    return False


class ToolSet(Mapping[str, Tool]):
    """Tools by name; unknown names fail with the list of known ones."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self._tools[t.name] = t

    def __getitem__(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise KeyError(f"unknown tool {name!r}; known: {', '.join(sorted(self._tools))}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def visible(self) -> ToolSet:
        """The tools a model may be offered (the harness's hidden ones left out)."""
        return ToolSet(t for t in self._tools.values() if not t.hidden)

    def schemas(self, *, include_hidden: bool = False) -> list[dict[str, Any]]:
        """Every tool a model may call as chat-completions `tools`, in order."""
        return [t.schema() for t in self._tools.values() if include_hidden or not t.hidden]


def string_params(*names: str, descriptions: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An object schema whose properties are all required strings."""
    descriptions = descriptions or {}
    props = {n: {"type": "string", **({"description": descriptions[n]} if n in descriptions else {})}
             for n in names}
    return {"type": "object", "properties": props, "required": list(names), "additionalProperties": False}


def command_observation(stdout: str, stderr: str, exit_code: int, limit: int = 4000) -> str:
    """The text a shell tool returns: output, then the exit status when it is not 0."""
    text = stdout + (("\n[stderr]\n" + stderr) if stderr else "")
    if exit_code:
        text += f"\n[exit {exit_code}]"
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def shell_tool(name: str, command: Callable[[dict[str, Any]], str], *, timeout: float = 120,
               deterministic: bool = True, description: str = "",
               parameters: Mapping[str, Any] | None = None) -> Tool:
    """A tool that runs the shell command `command(args)` and observes its output."""

    async def execute(ws: Workspace, args: dict[str, Any]) -> str:
        # On the event loop: the command streams over the init's socket, no thread per call.
        r = await AsyncWorkspace(ws).commands.run(command(args), timeout=timeout)
        return command_observation(r.stdout, r.stderr, r.exit_code)  # type: ignore[union-attr]

    return Tool(name, execute, deterministic, description, dict(parameters or OPEN_OBJECT))
