"""Signature semantics: a hit needs the task, the initial workspace and the whole call prefix."""

from __future__ import annotations

import pytest

from bunshinrl import ToolCall, prefix_signature, template_digest
from bunshinrl.calls.signature import canonical_json, extend_signature, root_signature


def test_canonical_arguments_ignore_key_order_and_whitespace() -> None:
    a = ToolCall("grep", {"pattern": "x", "opts": {"b": 1, "a": [1, 2]}})
    b = ToolCall("grep", {"opts": {"a": [1, 2], "b": 1}, "pattern": "x"})
    assert a == b and hash(a) == hash(b)
    assert a.canonical_args == '{"opts":{"a":[1,2],"b":1},"pattern":"x"}'
    assert canonical_json({"b": 1, "a": "é"}) == '{"a":"é","b":1}'


def test_different_name_or_value_or_type_is_a_different_call() -> None:
    base = ToolCall("run", {"n": 1})
    assert base != ToolCall("run2", {"n": 1})
    assert base != ToolCall("run", {"n": 2})
    assert base != ToolCall("run", {"n": "1"})
    assert base != ToolCall("run", {"n": 1.0})


def test_calls_are_immutable_copies() -> None:
    args = {"path": "a"}
    c = ToolCall("cat", args)
    args["path"] = "b"
    c.args["path"] = "c"
    assert c.args == {"path": "a"}
    assert ToolCall.from_key(c.key) == c
    assert ToolCall.from_dict(c.to_dict()) == c


def test_non_json_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        ToolCall("x", {"f": object()})
    with pytest.raises(ValueError):
        ToolCall("x", {"f": float("nan")})
    with pytest.raises(ValueError):
        ToolCall("", {})


def test_prefix_signature_depends_on_task_template_and_every_earlier_call() -> None:
    ls, cat, build = ToolCall("ls", {}), ToolCall("cat", {"path": "a"}), ToolCall("build", {})
    sig = prefix_signature("t1", "tmpl", [ls, cat, build])
    assert sig == prefix_signature("t1", "tmpl", [ls, cat, build])
    # Identical last call, different history: not the same state, not a hit.
    assert sig != prefix_signature("t1", "tmpl", [cat, ls, build])
    assert sig != prefix_signature("t1", "tmpl", [cat, build])
    assert sig != prefix_signature("t2", "tmpl", [ls, cat, build])
    assert sig != prefix_signature("t1", "other", [ls, cat, build])
    # The chain is incremental.
    assert sig == extend_signature(extend_signature(extend_signature(root_signature("t1", "tmpl"), ls), cat), build)


def test_template_digest_covers_rootfs_and_setup() -> None:
    d = template_digest("rootfs-a", "setup-1")
    assert d == template_digest("rootfs-a", "setup-1")
    assert d != template_digest("rootfs-b", "setup-1")
    assert d != template_digest("rootfs-a", "setup-2")
