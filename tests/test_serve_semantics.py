"""E2B's semantics that the in-process Sandbox and `bunshin serve` share (bunshinfork.e2b.lifecycle),
and the server's own pieces, against the e2b SDK's own pieces where it has them
(signatures, host names, lifecycle bodies), and paging over any list (Hypothesis)."""

from __future__ import annotations

import asyncio
import time

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.connection_config import ConnectionConfig
from e2b.sandbox.sandbox_api import build_lifecycle_config
from e2b.sandbox.signature import get_signature
from hypothesis import given
from hypothesis import strategies as st

from bunshinfork.e2b import lifecycle
from bunshinfork.e2b.lifecycle import ListQuery
from bunshinfork.errors import (
    InvalidArgumentException,
    NotFoundException,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from bunshinfork.serve import envd, ports


@given(n=st.integers(0, 40), limit=st.one_of(st.none(), st.integers(1, 100)), desc=st.booleans())
def test_pages_partition_the_list_in_order(n: int, limit: int | None, desc: bool) -> None:
    items = list(range(n))
    seen, token, calls = [], None, 0
    while True:
        page, token = lifecycle.page(items, limit, token, key=lambda x: x, order="desc" if desc else None)
        seen += page
        calls += 1
        if token is None:
            break
    assert seen == sorted(items, reverse=desc)
    assert calls == (1 if limit is None or n == 0 else -(-n // limit))


@pytest.mark.parametrize("token", ["x", "-1", "1.5"])
def test_bad_page_token(token: str) -> None:
    with pytest.raises(InvalidArgumentException):
        lifecycle.page([1, 2], 1, token, key=lambda x: x)


@given(path=st.text(min_size=1, max_size=30), user=st.sampled_from([None, "user", "root"]),
       op=st.sampled_from(["read", "write"]), token=st.text(min_size=1, max_size=40),
       expires=st.one_of(st.none(), st.integers(60, 3600)))
def test_signatures_are_e2bs(path: str, user: str | None, op: str, token: str, expires: int | None) -> None:
    sig = get_signature(path, op, user, token, expires)  # type: ignore[arg-type]
    assert ports.signature(path, op, user or "", token, sig["expiration"]) == sig["signature"]


def test_signature_checks() -> None:
    from bunshinfork.serve.store import Entry

    e = Entry("i1", "base", {}, 0.0, 0.0, lifecycle.Lifecycle(), "tok", None)
    good = get_signature("/a", "read", None, "tok", 60)
    q = {"path": "/a", "signature": good["signature"], "signature_expiration": str(good["expiration"])}
    assert ports.signature_ok(e, q, "GET")
    assert not ports.signature_ok(e, q, "POST")  # a read signature does not write
    assert not ports.signature_ok(e, {**q, "path": "/b"}, "GET")
    old = get_signature("/a", "read", None, "tok", 60)
    expired = {**q, "signature": old["signature"], "signature_expiration": str(int(time.time()) - 5)}
    assert not ports.signature_ok(e, expired, "GET")


@given(port=st.integers(1, 65535), sid=st.from_regex(r"[a-z0-9][a-z0-9-]{0,23}", fullmatch=True))
def test_host_names_are_e2bs(port: int, sid: str) -> None:
    host = ConnectionConfig().get_host(sid, "localhost", port)
    assert ports.parse_host(host, "localhost") == (port, sid)
    assert ports.parse_host(host + ":3000", "localhost") == (port, sid)
    assert ports.parse_host(host, "example.com") is None


@pytest.mark.parametrize(("sdk", "want"), [
    (None, lifecycle.Lifecycle("kill", False)),
    ({"on_timeout": "kill"}, lifecycle.Lifecycle("kill", False)),
    ({"on_timeout": "pause"}, lifecycle.Lifecycle("pause", False)),
    ({"on_timeout": "pause", "auto_resume": True}, lifecycle.Lifecycle("pause", True)),
])
def test_lifecycle_from_the_sdks_body(sdk: dict | None, want: lifecycle.Lifecycle) -> None:
    body = build_lifecycle_config(sdk)  # type: ignore[arg-type]
    auto_resume = body.auto_resume.to_dict() if hasattr(body.auto_resume, "to_dict") else None
    auto_pause = body.auto_pause if isinstance(body.auto_pause, bool) else None
    assert lifecycle.lifecycle_of(auto_pause, auto_resume) == want


def test_list_query() -> None:
    q = ListQuery(metadata={"a": "1"}, states=["paused"], started_after=10.0, template="base")
    assert q.matches({"a": "1", "b": "2"}, "paused", 11.0, "base")
    assert not q.matches({"a": "2"}, "paused", 11.0, "base")
    assert not q.matches({"a": "1"}, "running", 11.0, "base")
    assert q.matches({"a": "1"}, "paused", 10.0, "base")  # inclusive, as E2B's
    assert not q.matches({"a": "1"}, "paused", 9.999, "base")
    assert not q.matches({"a": "1"}, "paused", 11.0, "debian")


@pytest.mark.parametrize("bad", [-1, 24 * 3600 + 1, 1.5, "10", True])
def test_timeouts_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentException):
        lifecycle.check_timeout(bad)


@pytest.mark.parametrize("bad", [0, 21, 1000, "2", True, 1.0])
def test_fork_counts_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentException):
        lifecycle.check_fork_count(bad)


def test_extended_never_shortens() -> None:
    assert lifecycle.extended(100.0, None, now=0) == 100.0
    assert lifecycle.extended(100.0, 10, now=0) == 100.0
    assert lifecycle.extended(100.0, 500, now=0) == 500.0
    assert lifecycle.extended(float("inf"), 10) == float("inf")


@pytest.mark.parametrize(("raised", "code"), [
    (WorkspaceNotFound("gone"), Code.UNAVAILABLE), (NotFoundException("no file"), Code.NOT_FOUND),
    (InvalidArgumentException("bad"), Code.INVALID_ARGUMENT), (PermissionError("no"), Code.PERMISSION_DENIED),
    (FileExistsError("there"), Code.ALREADY_EXISTS), (WorkspaceStateError("ended"), Code.UNAVAILABLE),
    (RuntimeError("bug"), Code.INTERNAL)])
def test_rpc_errors_map_bunshins_errors_to_e2bs_codes(raised: Exception, code: Code) -> None:
    with pytest.raises(ConnectError) as got, envd.rpc_errors():
        raise raised
    assert got.value.code == code


@pytest.mark.parametrize("raised", [asyncio.CancelledError, KeyboardInterrupt, SystemExit])
def test_rpc_errors_let_a_cancel_or_an_exit_pass(raised: type[BaseException]) -> None:
    """A handler cancelled because its client went away is no error to answer."""
    with pytest.raises(raised), envd.rpc_errors():
        raise raised()
