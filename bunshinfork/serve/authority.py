"""What a request claims, checked once before routing: its request-target (origin-form only)
and its headers, kept as sent (a dict would fold repeated ones, and two readers of one folded
header could each see a different copy). Headers that carry authority (which sandbox, which
token, which key) may appear at most once; a request that repeats one is refused.

The sandbox a request was authenticated for is set here by the router (authorize) and read by
envd's handlers (authorized): they never read a header to find their sandbox again."""

from __future__ import annotations

import contextvars
from typing import Any

from starlette.responses import JSONResponse

# The headers that say who the caller is or which sandbox it means: each at most once.
AUTHORITY = ("host", "e2b-sandbox-id", "x-access-token", "x-api-key", "e2b-traffic-access-token",
             "authorization", "content-length", "transfer-encoding")

# The sandbox the router authenticated the current request for. A contextvar, as the Connect
# handlers see no ASGI scope: uvicorn runs each request in a task of its own, whose context
# this value lives in (and the scope carries it too: scope["state"]["sandbox_id"]).
_AUTHORIZED: contextvars.ContextVar[str | None] = contextvars.ContextVar("bunshin_serve_sandbox", default=None)


class Refused(Exception):
    """A request that is refused before any handler sees it (400 in E2B's shape)."""


class RequestHeaders:
    """The request's headers in the order sent, names lower-cased, repeats kept."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.items = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in raw]

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.items if k == name]

    def one(self, name: str) -> str | None:
        """The header's value, None when absent; Refused when it is repeated."""
        values = self.all(name)
        if len(values) > 1:
            raise Refused(f"the {name} header is repeated")
        return values[0] if values else None

    def check(self) -> None:
        for name in AUTHORITY:
            self.one(name)


# What an origin-form request-target may hold (RFC 9112 3.2.1: absolute-path ["?" query]):
# visible ASCII, no backslash (which some parsers read as "/"), no fragment.
_ALLOWED = frozenset(range(0x21, 0x7F)) - {ord("\\"), ord("#")}


def check_target(scope: dict[str, Any]) -> None:
    """Refuse a request-target that is not origin-form: absolute-form (`http://h/p`), authority-form
    (`h:p`), asterisk-form (`*`) and anything that does not start with "/" (`@h:p/`, which a
    proxy that pastes the target after an address turns into userinfo). uvicorn's h11 gives the
    target as sent (raw_path up to "?", query_string after)."""
    raw_path: bytes = scope.get("raw_path") or scope.get("path", "").encode("latin-1", "replace")
    query: bytes = scope.get("query_string", b"")
    if not raw_path.startswith(b"/") or not set(raw_path) <= _ALLOWED or not set(query) <= _ALLOWED:
        raise Refused("the request-target must be a path (origin-form: /path?query)")


def authorize(scope: dict[str, Any], sandbox_id: str) -> None:
    """Record that the request in `scope` was authenticated for `sandbox_id`."""
    scope.setdefault("state", {})["sandbox_id"] = sandbox_id
    _AUTHORIZED.set(sandbox_id)


def authorized() -> str | None:
    """The sandbox the current request was authenticated for (None outside one)."""
    return _AUTHORIZED.get()


def refusal(scope: dict[str, Any], message: str) -> JSONResponse:
    """400 in E2B's shape: Connect's for envd's RPC paths, E2B's REST one elsewhere."""
    if str(scope.get("path", "")).startswith(("/process.Process/", "/filesystem.Filesystem/")):
        return JSONResponse({"code": "invalid_argument", "message": message}, status_code=400)
    return JSONResponse({"code": 400, "message": message}, status_code=400)


__all__ = ["AUTHORITY", "Refused", "RequestHeaders", "authorize", "authorized", "check_target", "refusal"]
