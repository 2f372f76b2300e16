"""The ASGI application: auth, and routing of each request to the control plane, to a
sandbox's envd (requests with E2b-Sandbox-Id, or Host `49983-<id>.<domain>`) or to a
sandbox's port (Host `<port>-<id>.<domain>`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import Workspace
from ..aio import AsyncSandbox
from ..e2b import lifecycle
from ..e2b import templates as e2b_templates
from ..errors import BunshinError
from . import authority, envd, ports
from .allow import TemplatePolicy
from .limits import REST_BODY_BYTES, Limits, limit_body
from .rest import ApiError, Rest, error_response, status_of
from .store import Entry, Store

log = logging.getLogger("bunshin.serve")
INTERNAL = envd.INTERNAL
Scope = dict[str, Any]
ASGI = Callable[[Scope, Any, Any], Awaitable[None]]


class Server:
    """One server: its store, control plane, envd services and deadlines."""

    def __init__(self, api_key: str, root: Path, domain: str = "localhost",
                 on_ready: Callable[[], None] | None = None, public_domain: str | None = None,
                 policy: TemplatePolicy | None = None, limits: Limits | None = None) -> None:
        self.api_key = api_key
        self.limits = limits or Limits()
        self.on_ready = on_ready
        self.domain = domain  # what Host headers are matched against
        self.store = Store(root)
        # The domain sandboxes are announced with, which the SDKs put in every envd and get_host
        # URL: `domain:PORT` when TLS is served on a port other than 443.
        self.rest = Rest(self.store, public_domain or domain, self.schedule, policy, self.limits)
        self.process_app, self.fs_app, self.fs_service = envd.apps(self.lookup)
        self.rest_app = Starlette(routes=self.rest.routes(self._guard), lifespan=self._lifespan)
        # Bodies counted as they arrive, each route with its cap: a control-plane body is a small
        # JSON object; an upload or an envd call, what the operator allows.
        self.rest_limited = limit_body(self.rest_app, REST_BODY_BYTES, lambda m: error_response(413, m))
        upload = self.limits.max_upload_bytes
        self.process_limited = limit_body(self.process_app, upload, _rpc_too_large)
        self.fs_limited = limit_body(self.fs_app, upload, _rpc_too_large)
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- lifetime of the server ----

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Each snapshot a sandbox starts from stays loaded while the server runs (e2b/kept.py).
        e2b_templates.keep_loaded()
        await self.recover()
        if self.on_ready is not None:
            self.on_ready()
        try:
            yield
        finally:
            await self.shutdown()

    async def recover(self) -> None:
        """What a previous server left: paused sandboxes stay (with their deadlines), running
        ones are reaped, as their workspaces cannot be handed over."""
        for e in self.store.recorded():
            if e.paused and e.workspace_id and (await asyncio.to_thread(_paused_to_disk, e.workspace_id) or
                                                await asyncio.to_thread(lifecycle.files_paused,
                                                                        self.rest.files_dir(e))):
                self.store.entries[e.sandbox_id] = e
                self.schedule(e)
                continue
            if e.workspace_id:
                with contextlib.suppress(BunshinError, FileNotFoundError):
                    await AsyncSandbox.kill(e.workspace_id)
            self.store.drop(e.sandbox_id)

    async def shutdown(self) -> None:
        """Running sandboxes end with the server (paused ones stay on disk for the next)."""
        for e in list(self.store.entries.values()):
            if e.timer is not None:
                e.timer.cancel()
            if not e.paused:
                with contextlib.suppress(BaseException):
                    await self.rest.kill_entry(e)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.to_thread(e2b_templates.release_loaded)

    # ---- deadlines ----

    def schedule(self, e: Entry) -> None:
        """(Re)arm the entry's deadline: kill or pause, as its lifecycle says."""
        if e.timer is not None:
            e.timer.cancel()
            e.timer = None
        if e.deadline == float("inf") or (e.paused and e.lifecycle.on_timeout == "pause"):
            return
        loop = asyncio.get_running_loop()
        e.timer = loop.call_later(max(0.0, e.deadline - time.time()), self._expire, e.sandbox_id)

    def _expire(self, sandbox_id: str) -> None:
        task = asyncio.ensure_future(self._on_deadline(sandbox_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_deadline(self, sandbox_id: str) -> None:
        e = self.store.entries.get(sandbox_id)
        if e is None or e.deadline > time.time():
            return
        try:
            if e.lifecycle.on_timeout == "pause" and not e.paused:
                async with e.lock:
                    if not e.paused and e.deadline <= time.time():
                        await self.rest.pause_entry(e)
                return
            self.fs_service.forget(sandbox_id)
            await self.rest.kill_entry(e)
        except Exception:
            log.exception("sandbox %s: its deadline's action failed", sandbox_id)

    # ---- routing ----

    def lookup(self, sandbox_id: str) -> AsyncSandbox | None:
        e = self.store.entries.get(sandbox_id)
        return None if e is None or e.paused else e.sbx

    def _guard(self, fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """E2B's auth and error shape around a control-plane handler."""

        async def handler(request: Request) -> Response:
            if not _same(request.headers.get("x-api-key"), self.api_key):
                return error_response(401, "Invalid API key")
            try:
                return await fn(request)
            except Exception as e:
                status = status_of(e) if isinstance(e, (ApiError, BunshinError)) else 500
                if status < 500:
                    return error_response(status, str(e))
                # The details (host paths among them) are for the server's log, not its clients.
                log.exception("%s %s", request.method, request.url.path)
                return error_response(500, INTERNAL)

        return handler

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.rest_app(scope, receive, send)
            return
        if scope["type"] not in ("http", "websocket"):
            return
        headers = authority.RequestHeaders(scope.get("headers", []))
        try:
            sandbox_id, target = self._route(scope, headers)
        except authority.Refused as err:
            await self._refuse(scope, receive, send, authority.refusal(scope, str(err)))
            return
        if target is not None and target[0] != ports.ENVD_PORT:
            await ports.serve(self.store, target, scope, receive, send, headers, self.rest.auto_resume)
            return
        if sandbox_id is None and scope.get("path") == "/files" and scope["type"] == "http":
            # download_url/upload_url: a plain client sends no header; the signature names the sandbox.
            query = Request(scope).query_params
            signed = ports.signed_entry(self.store, query, scope.get("method", "GET"))
            if signed is None and "signature" in query:
                await envd.http_error(401, envd.signature_refusal(query))(scope, receive, send)
                return
            sandbox_id = signed.sandbox_id if signed is not None else None
        if sandbox_id is None:
            if scope["type"] == "http":
                await self.rest_limited(scope, receive, send)
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        await self._envd(sandbox_id, scope, receive, send, headers)

    def _route(self, scope: Scope, headers: authority.RequestHeaders) -> tuple[str | None, tuple[int, str] | None]:
        """(the sandbox whose envd the request is for, the `<port>-<id>` its Host names), both
        None for the control plane. Refused: a target that is not origin-form, a repeated
        authority header, a Host and an E2b-Sandbox-Id that name two sandboxes, a /files query
        that repeats what a signature covers."""
        authority.check_target(scope)
        headers.check()
        target = ports.parse_host(headers.one("host") or "", self.domain)
        sandbox_id = headers.one("e2b-sandbox-id")
        if target is not None and sandbox_id is not None and sandbox_id != target[1]:
            raise authority.Refused("E2b-Sandbox-Id names another sandbox than the Host")
        if target is not None and target[0] == ports.ENVD_PORT:
            # E2B_DOMAIN clients reach envd at `49983-<id>.<domain>`: the name gives the sandbox.
            sandbox_id = target[1]
        if scope.get("path") == "/files":
            query = Request(scope).query_params
            if any(len(query.getlist(k)) > 1 for k in ports.SIGNED_QUERY):
                raise authority.Refused(f"/files takes each of {', '.join(ports.SIGNED_QUERY)} once")
        return sandbox_id, target

    @staticmethod
    async def _refuse(scope: Scope, receive: Any, send: Any, response: Response) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: uvicorn answers 403
            return
        await response(scope, receive, send)

    async def _envd(self, sandbox_id: str, scope: Scope, receive: Any, send: Any,
                    headers: authority.RequestHeaders) -> None:
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1008})  # envd has no WebSocket
            return
        path: str = scope.get("path", "")
        e = self.store.entries.get(sandbox_id)
        # E2B's auto-resume (traffic to a paused sandbox resumes it), for a request it would then
        # take: one with its envd token or a signature (E2B's ResumeSandbox checks envd's token).
        if e is not None and e.paused and credential(e, scope, headers) is not None:
            err = await self.rest.auto_resume(e)
            if err is not None:
                await JSONResponse({"code": err.status, "message": err.message, "sandboxId": sandbox_id},
                                   status_code=err.status)(scope, receive, send)
                return
        rpc = path.startswith(("/process.Process/", "/filesystem.Filesystem/"))
        if e is None or e.paused or e.sbx is None:
            state = "paused" if e is not None and e.paused else "not found"
            msg = f"The sandbox {sandbox_id} {envd.NOT_FOUND}" if state == "not found" else \
                f"The sandbox {sandbox_id} is paused: connect to resume it (it {envd.NOT_FOUND} running)"
            body = {"code": "unavailable", "message": msg} if rpc else {"code": 502, "message": msg,
                                                                        "sandboxId": sandbox_id}
            await JSONResponse(body, status_code=502)(scope, receive, send)
            return
        via = credential(e, scope, headers)
        if via is None:
            body = {"code": "unauthenticated" if rpc else 401, "message": "Invalid access token"}
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        # From here on the request acts on this sandbox, and on no other: handlers read it from here.
        authority.authorize(scope, sandbox_id)
        if path.startswith("/process.Process/"):
            await self.process_limited(scope, receive, send)
        elif path.startswith("/filesystem.Filesystem/"):
            await self.fs_limited(scope, receive, send)
        elif path == "/health":
            now = "running" if await e.sbx.is_running() else await self.rest.reap_if_dead(e, e.sbx)
            if now != "running":
                # Dead before its deadline's timer (its init ended it, or it was killed outside),
                # or paused meanwhile (a deadline's pause held its lock: kept, never killed here):
                # answer as E2B's proxy does for a sandbox that is not running.
                msg = f"The sandbox {sandbox_id} {envd.NOT_FOUND}"
                await JSONResponse({"code": 502, "message": msg, "sandboxId": sandbox_id},
                                   status_code=502)(scope, receive, send)
                return
            await envd.health()(scope, receive, send)
        elif path == "/files":
            files = functools.partial(self._files, e.sbx, via, self.limits.max_upload_bytes)
            await limit_body(files, self.limits.max_upload_bytes, _files_too_large)(scope, receive, send)
        else:
            await envd.http_error(404, f"no envd route {path}")(scope, receive, send)


    @staticmethod
    async def _files(sbx: AsyncSandbox, via: str, max_bytes: int, scope: Scope, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        if request.method == "GET":
            response = await envd.files_get(sbx, request)
        elif request.method == "POST":
            # A URL signed for one path writes that path, and nothing else.
            response = await envd.files_post(sbx, request, signed=via == "signature", max_bytes=max_bytes)
        else:
            response = envd.http_error(405, "GET or POST")
        await response(scope, receive, send)


def _files_too_large(message: str) -> Response:
    return envd.http_error(413, message)


def _rpc_too_large(message: str) -> Response:
    """Connect's error for a body past its cap."""
    return JSONResponse({"code": "resource_exhausted", "message": message}, status_code=413)


def _paused_to_disk(workspace_id: str) -> bool:
    try:
        return Workspace.connect(workspace_id).info().state == lifecycle.PAUSED_TO_DISK
    except BunshinError:
        return False


def credential(e: Entry, scope: Scope, headers: authority.RequestHeaders) -> str | None:
    """What the request is authenticated by: "token" (envd's access token), "signature" (for
    /files, a URL download_url/upload_url signed for one path and operation), else None."""
    if _same(headers.one("x-access-token"), e.envd_token):
        return "token"
    if scope.get("path") == "/files" and ports.signature_ok(e, Request(scope).query_params, scope.get("method", "GET")):
        return "signature"
    return None


def _same(given: str | None, want: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), want.encode())


def make_app(api_key: str, root: Path, domain: str = "localhost",
             on_ready: Callable[[], None] | None = None, public_domain: str | None = None,
             policy: TemplatePolicy | None = None, limits: Limits | None = None) -> Server:
    """The application; on_ready runs once it has taken over what a previous server left.
    public_domain (default: domain) is the one sandboxes are announced with; policy, the
    templates offered beyond base, debian, snapshots and warm templates (default: none)."""
    return Server(api_key, root, domain, on_ready, public_domain, policy, limits)


__all__ = ["JSONResponse", "Server", "make_app"]
