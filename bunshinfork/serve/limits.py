"""What one server lets its clients use (issue 36 #9, #14): what its sandboxes get (CPU,
memory, pids, disk: resources.py; a user namespace; each other's ports), how many run, how
large a body may be, how long a client may take to send a request's headers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .resources import Resources, for_template

REST_BODY_BYTES = 1 << 20  # a control-plane body is a small JSON object
MiB = 1 << 20
# A body a little past its cap is read to its end (and dropped) before the 413, so that the
# client, still sending, reads the answer instead of a reset; a larger one is cut off.
DRAIN_BYTES = 4 * MiB


@dataclass(frozen=True)
class Limits:
    """A server's limits. The defaults are E2B's base template's (2 vCPU, 512 MiB), and
    what a client needs without letting one starve the host."""

    max_sandboxes: int = 100  # running ones, forks included; past it 429, as E2B's concurrency cap
    memory_mb: int = 512
    pids: int = 1024
    cpu_count: int = 2  # E2B's default; a quota of that many cores
    disk_mb: int = 10240
    max_upload_bytes: int = 256 * MiB  # one /files upload, or one envd RPC body
    block_private: bool = False
    header_timeout: float = 10.0
    # Templates run in a user namespace (issue 36 item 11): root inside is an unprivileged id
    # range of the host, so an escape from the other namespaces holds nothing there.
    userns: bool = True
    # (template or pattern, the resources it sets): --template-limits, first match wins.
    template_limits: tuple[tuple[str, dict[str, int]], ...] = ()

    def resources(self, template: str) -> Resources:
        default = Resources(cpu_count=self.cpu_count, memory_mb=self.memory_mb, disk_mb=self.disk_mb,
                            pids=self.pids)
        return for_template(default, self.template_limits, template)

    def spec(self, template: str = "base") -> dict[str, Any]:
        """The WorkspaceSpec fields a sandbox started from `template` gets: no sandbox reaches
        another (bridged or routed), its resources held by its cgroup and its layer's quota,
        in a user namespace unless the operator opted out."""
        return {"port_isolation": True, "block_private": self.block_private, "userns": self.userns,
                **self.resources(template).spec()}


class BodyTooLarge(Exception):
    """The request's body passed its cap (answered 413 in E2B's shape)."""


def limit_body(app: Any, cap: int, shape: Any) -> Any:
    """`app` with its request body capped at `cap` bytes, counted as they arrive (nothing is
    buffered here): a Content-Length past it is refused before a byte is read; a body that
    grows past it ends the read, and the answer becomes 413 if none had started. `shape`
    makes the answer's body from the message (E2B's REST or envd shape)."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        too_large = shape(f"the request body is larger than {cap} bytes")
        for k, v in scope.get("headers", []):
            if k == b"content-length" and (not v.isdigit() or int(v) > cap):
                if v.isdigit() and int(v) <= cap + DRAIN_BYTES:
                    await _drain(receive, DRAIN_BYTES + cap)
                await too_large(scope, receive, send)
                return
        seen = 0
        tripped = False
        started = False

        async def counted() -> Any:
            nonlocal seen, tripped
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > cap:
                    tripped = True
                    raise BodyTooLarge
            return msg

        async def guarded(msg: Any) -> None:
            nonlocal started
            if tripped:
                return  # the app's answer to the cut body (an error) gives way to the 413
            started = True
            await send(msg)

        try:
            await app(scope, counted, guarded)
        except BodyTooLarge:
            tripped = True
        if tripped and not started:
            await _drain(receive, DRAIN_BYTES)
            await too_large(scope, receive, send)

    return wrapped


async def _drain(receive: Any, limit: int) -> None:
    """Read and drop the rest of the body, up to `limit` bytes."""
    seen = 0
    while seen <= limit:
        msg = await receive()
        if msg["type"] != "http.request":
            return
        seen += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


class SandboxCap:
    """How many sandboxes run, and the creates and forks under way, against the cap: a slot is
    taken before the (slow) create starts, so concurrent requests cannot all pass."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0

    def reserve(self, running: int, n: int) -> bool:
        if running + self.pending + n > self.limit:
            return False
        self.pending += n
        return True

    def release(self, n: int) -> None:
        self.pending -= n


def header_timeout_protocol(timeout: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request head
    within `timeout` seconds of connecting, or of the first byte of a head after a response
    (uvicorn's keep-alive timer stops at the first byte, so a client sending its headers a byte
    at a time, or nothing after connecting, held a connection slot for ever: slowloris). An idle
    connection between requests is uvicorn's keep-alive timer's alone: timing it here too closed
    it at `timeout` whatever the keep-alive, at a moment a client may be reusing it."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state == h11.IDLE:
                if self._head_timer is None:
                    self._arm()
            elif self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()  # arms the keep-alive timer, runs a pipelined request
            if self.conn.their_state == h11.IDLE and self.conn.trailing_data[0]:
                self._arm()  # a pipelined head begun before the response ended: its bytes are in

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout, self._expired)

        def _expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state == h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11
