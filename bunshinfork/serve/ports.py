"""A sandbox's ports from outside: requests whose Host is `<port>-<id>.<domain>` (what E2B's
get_host gives) go to that port in the sandbox, with the sandbox's traffic token when it was
created with allow_public_traffic=False; and the signatures of download_url/upload_url.
Port ENVD_PORT is envd's: the SDKs with only E2B_DOMAIN set send envd's calls there."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..e2b.network import masked_host
from ..errors import BunshinError
from .authority import RequestHeaders
from .store import Entry, Store

TRAFFIC_HEADER = "e2b-traffic-access-token"
# envd's port: e2b's ConnectionConfig.envd_port, the `49983-<id>.<domain>` of E2B_DOMAIN clients.
ENVD_PORT = 49983
# What a file URL's signature covers: a signed URL names each once.
SIGNED_QUERY = ("path", "username", "signature", "signature_expiration")
PROXY_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
log = logging.getLogger("bunshin.serve")
# E2B's own headers (and the `e2b-` prefix), which stop at the proxy.
_E2B = {TRAFFIC_HEADER, "e2b-sandbox-id", "x-access-token", "x-api-key"}
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "host", "content-length", "proxy-connection"}
# The client's own X-Forwarded-* stop here too (Go's ReverseProxy with Rewrite, E2B's proxy, drops them).
_FORWARDED = {"x-forwarded-for", "x-forwarded-host", "x-forwarded-proto"}
# Auto-resume of a paused sandbox (Rest.auto_resume): an error to answer, or None.
Resumer = Callable[[Entry], Awaitable[Any]]


def parse_host(host: str, domain: str) -> tuple[int, str] | None:
    """(port, sandbox id) of a Host header `<port>-<id>.<domain>[:N]`, else None."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    m = re.fullmatch(r"(\d{1,5})-([a-z0-9][a-z0-9-]*)\." + re.escape(domain), name.lower())
    if m is None or not 0 < int(m.group(1)) < 65536:
        return None
    return int(m.group(1)), m.group(2)


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's v1 file-URL signature (e2b.sandbox.signature), checked here."""
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode("ascii")


def signature_ok(e: Entry, query: Mapping[str, str], method: str = "GET") -> bool:
    given = query.get("signature")
    if not given:
        return False
    exp_text = query.get("signature_expiration")
    try:
        expiration = int(exp_text) if exp_text else None
    except ValueError:
        return False
    if expiration is not None and expiration < time.time():
        return False
    op = "read" if method == "GET" else "write"
    want = signature(query.get("path", ""), op, query.get("username", ""), e.envd_token, expiration)
    return hmac.compare_digest(given.encode(), want.encode())


def signed_entry(store: Store, query: Mapping[str, str], method: str) -> Entry | None:
    """The sandbox a signed file URL names (its signature names it: the token is the sandbox's)."""
    for e in store.entries.values():
        if not e.paused and signature_ok(e, query, method):
            return e
    return None


class PeerRefused(Exception):
    """The address a port resolved to is not the sandbox's own."""


class TooManyPorts(Exception):
    """The sandbox has its share of forwarded ports (a fork's, a loopback-only one's)."""


# A fork shares its source's address, so each of its ports asked for is a forwarder (a thread
# and a listening socket of this server), made by whoever sends a request to that port's URL.
MAX_FORWARDED_PORTS = 32


def peer(e: Entry, port: int) -> tuple[str, int]:
    """(address, port) at which the host reaches the sandbox's `port`, checked to be the
    sandbox's: its own address on the bridge at `port`, or a forwarder this server runs into its
    network namespace for `port`. An address literal, never a name (nothing to resolve)."""
    assert e.sbx is not None
    ws = e.sbx.workspace
    net = ws.info().network
    if not (net.get("ip") and net.get("zone") is None):
        forwarded_now = ws.ports.list()
        if port not in forwarded_now and len(forwarded_now) >= MAX_FORWARDED_PORTS:
            raise TooManyPorts(f"at most {MAX_FORWARDED_PORTS} ports of a sandbox are forwarded")
    host, _, text = e.sbx.get_host(port).rpartition(":")
    try:
        ip, at = ipaddress.ip_address(host.strip("[]")), int(text)
    except ValueError:
        raise PeerRefused(f"port {port}: not an address") from None
    own = str(net.get("ip") or "").split("/")[0]
    if ip.is_unspecified or not ((str(ip) == own and at == port) or ws.ports.list().get(port) == (str(ip), at)):
        raise PeerRefused(f"port {port}: {ip} is not the sandbox's")
    return str(ip), at


def forwarded(headers: RequestHeaders) -> list[tuple[str, str]]:
    """The request's headers as the sandbox gets them: without hop-by-hop ones (and those
    Connection names), and without E2B's own (tokens, the API key, the sandbox id), which are
    the server's business and credentials code in the sandbox must not see."""
    named = {t.strip().lower() for v in headers.all("connection") for t in v.split(",")}
    return [(k, v) for k, v in headers.items
            if k not in _HOP and k not in named and k not in _E2B and not k.startswith("e2b-") and k not in _FORWARDED]


def host_headers(e: Entry, port: int, headers: RequestHeaders) -> list[tuple[str, str]]:
    """The Host the sandbox's port gets, as E2B's proxy sends it (e2b-dev/infra
    packages/shared/pkg/proxy/pool/client.go, Rewrite): the client's own Host, or where the
    sandbox was created with network.maskRequestHost, that host (${PORT}: the port) with the
    client's Host in X-Forwarded-Host."""
    given = headers.one("host") or ""
    if e.mask_request_host is None:
        return [("host", given)] if given else []
    return [("host", masked_host(e.mask_request_host, port))] + ([("x-forwarded-host", given)] if given else [])


def _canonical(name: str) -> str:
    """textproto.CanonicalMIMEHeaderKey: x-forwarded-host -> X-Forwarded-Host."""
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def _upstream_target(scope: dict[str, Any]) -> bytes:
    """The origin-form target as sent (the router refused any other form)."""
    raw: bytes = scope.get("raw_path") or b"/"
    query: bytes = scope.get("query_string") or b""
    return raw + (b"?" + query if query else b"")


async def serve(store: Store, target: tuple[int, str], scope: dict[str, Any], receive: Any, send: Any,
                headers: RequestHeaders, resume: Resumer | None = None) -> None:
    port, sandbox_id = target
    e = store.entries.get(sandbox_id)
    # E2B's auto-resume by traffic, only for a request the sandbox would take once running: one
    # with its traffic token where it has one (e2b-dev/infra packages/api/internal/handlers/
    # proxy_grpc.go, ResumeSandbox: PermissionDenied, nothing resumed, otherwise). A sandbox
    # created with public traffic allowed is resumed by any request to its port, as E2B's is.
    if e is not None and e.paused and resume is not None and _token_ok(e, headers):
        err = await resume(e)
        if err is not None:
            if scope["type"] == "websocket":
                await receive()
                await send({"type": "websocket.close", "code": 1013})
            else:
                await JSONResponse({"code": err.status, "message": err.message, "sandboxId": sandbox_id},
                                   status_code=err.status)(scope, receive, send)
            return
    if scope["type"] == "websocket":
        await _websocket(e, port, scope, receive, send, headers)
        return
    if scope["type"] != "http":
        return
    refused = JSONResponse({"code": 403, "message": "a traffic access token is required"}, status_code=403)
    if e is not None and e.paused and e.lifecycle.auto_resume and not _token_ok(e, headers):
        await refused(scope, receive, send)  # E2B: resume permission denied (nothing resumed)
        return
    if e is None or e.paused or e.sbx is None:
        await JSONResponse({"code": 502, "message": f"The sandbox {sandbox_id} was not found",
                            "sandboxId": sandbox_id}, status_code=502)(scope, receive, send)
        return
    if not _token_ok(e, headers):
        await refused(scope, receive, send)
        return
    closed = JSONResponse({"code": 502, "message": f"port {port} is not open", "sandboxId": sandbox_id,
                           "port": port}, status_code=502)
    try:
        ip, at = peer(e, port)
    except TooManyPorts as err:
        await JSONResponse({"code": 429, "message": str(err), "sandboxId": sandbox_id, "port": port},
                           status_code=429)(scope, receive, send)
        return
    except (BunshinError, PeerRefused) as err:
        log.warning("sandbox %s port %d: %s", sandbox_id, port, err)
        await closed(scope, receive, send)
        return
    request = Request(scope, receive)
    client = httpx.AsyncClient(timeout=PROXY_TIMEOUT)
    # The URL from its parts: the target is a path, so nothing in it can become an authority.
    url = httpx.URL(scheme="http", host=ip, port=at, raw_path=_upstream_target(scope))
    # The body flows through as it arrives (never held here whole: a client's 300 MiB body
    # was 1 GiB of the server's memory), with its length when the client gave one.
    length = next(iter(headers.all("content-length")), None)  # h11 checked it (repeats agree)
    has_body = length not in (None, "0") or bool(headers.all("transfer-encoding"))
    # Names as Go's net/http writes them (E2B's proxy is Go): "Host", "X-Forwarded-Host", ...
    sent = [(_canonical(k), v) for k, v in forwarded(headers) + host_headers(e, port, headers)] \
        + ([("Content-Length", length)] if length is not None and has_body else [])
    try:
        upstream = await client.send(client.build_request(
            request.method, url, headers=sent, content=request.stream() if has_body else None), stream=True)
    except httpx.HTTPError as err:
        await client.aclose()
        log.info("sandbox %s port %d: %s", sandbox_id, port, err)
        await closed(scope, receive, send)
        return

    async def body() -> Any:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await client.aclose()

    resp = StreamingResponse(body(), status_code=upstream.status_code,
                             headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
    await resp(scope, receive, send)


def _token_ok(e: Entry, headers: RequestHeaders) -> bool:
    return e.traffic_token is None or hmac.compare_digest(
        (headers.one(TRAFFIC_HEADER) or "").encode(), e.traffic_token.encode())


async def _websocket(e: Entry | None, port: int, scope: dict[str, Any], receive: Any, send: Any,
                     headers: RequestHeaders) -> None:
    """Relay a WebSocket to the sandbox's port, message by message, until either side closes."""
    import websockets

    await receive()  # websocket.connect
    token_ok = e is not None and _token_ok(e, headers)
    addr: tuple[str, int] | None = None
    if token_ok and e is not None and e.sbx is not None and not e.paused:
        try:
            addr = peer(e, port)
        except (BunshinError, PeerRefused, TooManyPorts) as err:
            log.warning("sandbox %s port %d: %s", e.sandbox_id, port, err)
    if addr is None:
        await send({"type": "websocket.close", "code": 1008 if e is not None and not token_ok else 1011})
        return
    ip, at = addr
    # From parts: an address literal, its port, and the origin-form target the router checked.
    uri = f"ws://{ip if ':' not in ip else f'[{ip}]'}:{at}{_upstream_target(scope).decode('ascii')}"
    try:
        upstream = await asyncio.wait_for(websockets.connect(uri, open_timeout=5,
                                                             subprotocols=scope.get("subprotocols") or None), 10)
    except (OSError, TimeoutError, websockets.WebSocketException):
        await send({"type": "websocket.close", "code": 1011})
        return
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

    async def to_upstream() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "websocket.disconnect":
                return
            await upstream.send(msg["bytes"] if msg.get("bytes") is not None else msg.get("text") or "")

    async def to_client() -> None:
        async for data in upstream:
            await send({"type": "websocket.send", **({"bytes": data} if isinstance(data, bytes) else {"text": data})})

    tasks = [asyncio.ensure_future(to_upstream()), asyncio.ensure_future(to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await upstream.close()
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": 1000})
