"""Tool-call signatures: what has to match before a recorded result may stand in for a fresh one.

A cached observation is only valid for the exact workspace state it was produced in. That state
is determined by the task, the initial workspace (its template digest) and every call made since,
so a signature chains all three; two calls with identical arguments at different points of a
trajectory, or in different tasks, never share a signature.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any


def canonical_json(value: Any) -> str:
    """Sorted keys, no insignificant whitespace: equal arguments always give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class ToolCall:
    """A tool invocation the policy emitted: a tool name and JSON arguments. Immutable; equality
    and hashing use the canonical form, so {"a": 1, "b": 2} equals {"b": 2, "a": 1}."""

    __slots__ = ("_args", "key", "name")

    def __init__(self, name: str, args: Mapping[str, Any] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool call needs a non-empty tool name, got {name!r}")
        # Round-trip through canonical JSON so the call cannot be changed through a caller's dict
        # and so non-JSON arguments fail here rather than at cache time.
        text = canonical_json(dict(args or {}))
        self.name = name
        self._args = text
        self.key = f"{name}{text}"

    @property
    def args(self) -> dict[str, Any]:
        """A fresh copy of the arguments (mutating it does not change the call)."""
        return json.loads(self._args)

    @property
    def canonical_args(self) -> str:
        return self._args

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "args": self.args}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ToolCall:
        return cls(d["name"], d.get("args") or {})

    @classmethod
    def from_key(cls, key: str) -> ToolCall:
        i = key.index("{")
        return cls(key[:i], json.loads(key[i:]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolCall) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"ToolCall({self.name!r}, {self._args})"


def _h(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()


def root_signature(task_id: str, template_digest: str) -> str:
    """The signature of the empty prefix: a task in its initial workspace."""
    return _h("root", task_id, template_digest)


def extend_signature(prefix: str, call: ToolCall) -> str:
    return _h("call", prefix, call.key)


def prefix_signature(task_id: str, template_digest: str, calls: Iterable[ToolCall]) -> str:
    """The signature of the state reached by `calls` from the task's initial workspace."""
    sig = root_signature(task_id, template_digest)
    for c in calls:
        sig = extend_signature(sig, c)
    return sig


def template_digest(rootfs_digest: str, setup_fingerprint: str) -> str:
    """Identity of an initialized workspace: the root file system plus what set-up did to it."""
    return _h("template", rootfs_digest, setup_fingerprint)[:32]
