"""E2B's REST control plane (the routes e2b 2.63 calls, and the older create/connect)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import secrets
import shutil
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import Sandbox, Snapshot, Workspace
from ..aio import AsyncSandbox
from ..e2b import lifecycle
from ..e2b import network as e2b_network
from ..e2b import templates as e2b_templates
from ..e2b.lifecycle import Lifecycle, ListQuery
from ..errors import BunshinError, InvalidArgumentException, NotFoundException
from ..images import templates as store_templates
from .allow import TemplatePolicy
from .limits import Limits, SandboxCap
from .store import Entry, Store

# The envd protocol level served: commands' stdin and close, octet-stream and gzip uploads (0.5.7),
# file metadata (0.6.2), watch events with their entry (0.6.3), allow_network_mounts (0.6.4: a
# workspace has no network mount to refuse). The SDK gates each feature on this version.
ENVD_VERSION = "0.6.4"
CLIENT_ID = "bunshin"
SERVE_BASE = "debian"
log = logging.getLogger("bunshin.serve")


class ApiError(Exception):
    """An answer in E2B's error shape: {"code": status, "message": ...}."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def not_found(template: str) -> str:
    """The one answer for a template this server does not offer, whatever the reason."""
    return f"template {template!r} not found"


def status_of(e: BaseException) -> int:
    if isinstance(e, ApiError):
        return e.status
    if isinstance(e, InvalidArgumentException):
        return 400
    if isinstance(e, NotFoundException):
        return 404
    return 500


def _iso(ts: float) -> str:
    return lifecycle.utc(ts).isoformat().replace("+00:00", "Z")


async def body_of(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


class Rest:
    """The control plane's handlers over the store (see app.py for auth and routing)."""

    def __init__(self, store: Store, domain: str, reaper: Callable[[Entry], None],
                 policy: TemplatePolicy | None = None, limits: Limits | None = None) -> None:
        self.store = store
        self.policy = policy or TemplatePolicy()
        self.limits = limits or Limits()
        self.cap = SandboxCap(self.limits.max_sandboxes)
        self.domain = domain
        self.schedule = reaper  # (re)arms an entry's deadline

    # ---- shapes ----

    def sandbox_json(self, e: Entry) -> dict[str, Any]:
        out: dict[str, Any] = {"templateID": e.template, "sandboxID": e.sandbox_id, "clientID": CLIENT_ID,
                               "envdVersion": ENVD_VERSION, "envdAccessToken": e.envd_token, "domain": self.domain}
        if e.traffic_token is not None:
            out["trafficAccessToken"] = e.traffic_token
        return out

    def listed_json(self, e: Entry) -> dict[str, Any]:
        return {"templateID": e.template, "alias": e.template, "sandboxID": e.sandbox_id, "clientID": CLIENT_ID,
                "startedAt": _iso(e.started_at),
                "endAt": _iso(e.deadline if e.deadline != float("inf") else time.time() + lifecycle.MAX_TIMEOUT),
                **self.limits.resources(e.template).reported(), **e.reported(),
                "metadata": dict(e.metadata), "state": e.state, "envdVersion": ENVD_VERSION, "volumeMounts": []}

    def detail_json(self, e: Entry) -> dict[str, Any]:
        out = self.listed_json(e)
        network: dict[str, Any] = {"allowPublicTraffic": e.traffic_token is None}
        if e.sbx is not None:  # the rules in force (none kept for a paused sandbox's answer)
            egress = e.sbx.workspace.info().egress or {}
            network.update({_CAMEL[k]: list(v) for k, v in egress.items() if k in _CAMEL})
        out.update({"envdAccessToken": e.envd_token, "domain": self.domain,
                    "allowInternetAccess": e.allow_internet_access, "lifecycle": e.lifecycle.to_api(),
                    "network": network})
        return out

    # ---- lookups ----

    def entry(self, sandbox_id: str) -> Entry:
        e = self.store.entries.get(sandbox_id)
        if e is None:
            raise ApiError(404, f"sandbox {sandbox_id!r} not found")
        return e

    async def running(self, e: Entry) -> AsyncSandbox:
        if e.paused or e.sbx is None:
            raise ApiError(409, f"sandbox {e.sandbox_id!r} is paused: connect to resume it")
        return e.sbx

    # ---- templates and snapshots: the store is the host's, this server sees its own part ----

    def stored(self, template: str) -> str:
        """The store's id for what `template` names there: one of this server's snapshots, or
        a warm template (the operator's `bunshin template`). Anything else, another server's
        or a library's snapshot included, is not found, with one answer for all."""
        own = self.store.snapshots()
        hits = [d for d in store_templates.saved() if template == d.name or template in store_templates.names(d)]
        for d in hits:
            if d.name in own:
                return d.name
        for d in hits:
            if store_templates.info(d).kind == "template":
                return d.name
        raise ApiError(404, not_found(template))

    def check_snapshot_name(self, name: str) -> None:
        """A name no template has by what it is, and that names nothing in the store but this
        server's snapshots (name_it would take it from whatever held it)."""
        e2b_templates.check_snapshot_name(name)
        own = self.store.snapshots()
        if any((name == d.name or name in store_templates.names(d)) and d.name not in own
               for d in store_templates.saved()):
            raise ApiError(400, f"snapshot name {name!r} is taken")

    # ---- create, connect ----

    @contextlib.contextmanager
    def slots(self, n: int) -> Iterator[None]:
        """Room for n more running sandboxes, held while they start (429 past the cap, E2B's
        answer to a team past its concurrent sandboxes: the SDK's RateLimitException)."""
        running = sum(1 for e in self.store.entries.values() if not e.paused)
        if not self.cap.reserve(running, n):
            raise ApiError(429, f"this server runs at most {self.cap.limit} sandboxes at once "
                                f"({running} running): kill some or wait")
        try:
            yield
        finally:
            self.cap.release(n)

    async def create(self, request: Request) -> Response:
        body = await body_of(request)
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            raise ApiError(400, "templateID is required")
        timeout = lifecycle.check_timeout(body.get("timeout"), Sandbox.default_sandbox_timeout)
        life = lifecycle.lifecycle_of(body.get("autoPause", False), body.get("autoResume"),
                                      body.get("autoPauseMemory"))
        # mcp is the SDK's to start (it runs mcp-gateway in the sandbox after create): accepted.
        if body.get("mcp") is not None and not isinstance(body.get("mcp"), dict):
            raise ApiError(400, "mcp must be an object")
        for name in ("iam", "volumeMounts"):
            if body.get(name):
                raise ApiError(400, f"{name} configures an E2B cloud service this server does not have")
        metadata, envs = body.get("metadata") or {}, body.get("envVars") or {}
        if not _str_map(metadata) or not _str_map(envs):
            raise ApiError(400, "metadata and envVars must map strings to strings")
        network = body.get("network") or {}
        if not isinstance(network, dict):
            raise ApiError(400, "network must be an object")
        network = dict(network)
        # allowPublicTraffic guards the sandbox's URLs, which this server serves (its traffic token);
        # maskRequestHost is the Host its port proxy sends in (ingress, as E2B's proxy does).
        public = network.pop("allowPublicTraffic", True)
        mask = network.pop("maskRequestHost", None)
        if mask is not None:
            mask = e2b_network.check_mask_request_host(mask)
        internet = body.get("allow_internet_access", body.get("allowInternetAccess"))
        internet = True if internet is None else internet  # E2B's default: online
        if not isinstance(internet, bool) or not isinstance(public, bool):
            raise ApiError(400, "allow_internet_access and network allowPublicTraffic must be booleans")
        deadline = lifecycle.deadline_after(timeout)
        if e2b_templates.is_builtin(template):
            if not self.policy.allows(template):  # the same answer as for a name nothing has
                raise ApiError(404, not_found(template))
            # serve's `base` is a Debian rootfs with E2B's base tools (rootfs.DEBIAN_PACKAGES), which
            # a user namespace can own; the library's stays the host's /usr.
            start = SERVE_BASE if template == e2b_templates.DEFAULT else template
        else:
            start = await asyncio.to_thread(self.stored, template)
        with self.slots(1):
            sbx = await AsyncSandbox.create(start, timeout=lifecycle.workspace_lifetime(life, deadline),
                                            metadata=metadata, envs=envs, allow_internet_access=internet,
                                            network=_snake(network), spec=self.limits.spec(template))
        e = Entry(sandbox_id=sbx.sandbox_id, template=template, metadata=dict(metadata), started_at=time.time(),
                  deadline=deadline, lifecycle=life, envd_token=secrets.token_hex(16),
                  traffic_token=None if public else secrets.token_hex(16), allow_internet_access=internet,
                  workspace_id=sbx.sandbox_id, sbx=sbx, mask_request_host=mask)
        # What it got (a snapshot's clone keeps the snapshot's limits), for its info.
        e.limits_from(await asyncio.to_thread(sbx.workspace.info))
        self.store.add(e)
        self.schedule(e)
        return JSONResponse(self.sandbox_json(e), status_code=201)

    async def connect(self, request: Request) -> Response:
        body = await body_of(request)
        timeout = body.get("timeout")
        if timeout is not None:
            timeout = lifecycle.check_timeout(timeout)
        memory = body.get("memory", True)  # False: on_resume="reboot", a cold boot from the files
        if not isinstance(memory, bool):
            raise ApiError(400, "memory must be a boolean")
        e = self.entry(request.path_params["sandbox_id"])
        async with e.lock:
            resumed = e.paused
            if e.paused:
                with self.slots(1):
                    await self.resume(e, timeout, memory)
            e.deadline = lifecycle.extended(e.deadline, timeout)
            await self.apply_deadline(e)
        return JSONResponse(self.sandbox_json(e), status_code=201 if resumed else 200)

    def files_dir(self, e: Entry) -> Path:
        """Where a filesystem-only pause keeps the sandbox's files."""
        return self.store.paused_dir(e.sandbox_id) / lifecycle.FILES

    async def resume(self, e: Entry, timeout: int | None, memory: bool = True) -> None:
        assert e.workspace_id is not None
        e.deadline = lifecycle.resumed_deadline(timeout)
        files = self.files_dir(e)
        if await asyncio.to_thread(lifecycle.files_paused, files):
            # A filesystem-only pause resumes as a cold boot: a new workspace behind the same
            # sandbox id and tokens, with the files as they were and none of the processes.
            ws = await asyncio.to_thread(lifecycle.boot_files, files,
                                         lifecycle.workspace_lifetime(e.lifecycle, e.deadline))
            e.workspace_id, e.sbx, e.paused = ws.id, AsyncSandbox(ws), False
            self.store.save(e)
            await asyncio.to_thread(shutil.rmtree, files, True)
            return
        ws = await asyncio.to_thread(Workspace.connect, e.workspace_id)
        if not memory and await asyncio.to_thread(lifecycle.is_paused, ws):
            # connect {"memory": false}: E2B's reboot ignores the memory its pause saved.
            ws = await asyncio.to_thread(lifecycle.reboot_saved, ws,
                                         lifecycle.workspace_lifetime(e.lifecycle, e.deadline))
            e.workspace_id, e.sbx, e.paused = ws.id, AsyncSandbox(ws), False
            self.store.save(e)
            await asyncio.to_thread(shutil.rmtree, self.store.paused_dir(e.sandbox_id), True)
            return
        await asyncio.to_thread(lifecycle.resume, ws, e.lifecycle, e.deadline)
        e.sbx, e.paused = AsyncSandbox(ws), False
        self.store.save(e)

    async def apply_deadline(self, e: Entry) -> None:
        """The entry's deadline, to the workspace (kill lifecycle: its init enforces it) and the timer."""
        if not e.paused and e.sbx is not None and e.lifecycle.on_timeout == "kill":
            await e.sbx.set_timeout(lifecycle.workspace_lifetime(e.lifecycle, e.deadline))
        self.store.save(e)
        self.schedule(e)

    # ---- listing, info ----

    async def list_v2(self, request: Request) -> Response:
        q = request.query_params
        try:
            query = ListQuery(metadata=_metadata_filter(q.get("metadata")),
                              states=[s for s in q.get("state", "").split(",") if s] or None,
                              started_after=_ts(q.get("startedAfter")), template=q.get("template") or None)
            limit = int(q["limit"]) if "limit" in q else None
        except ValueError as err:
            raise ApiError(400, f"invalid query: {err}") from None
        if query.states and not set(query.states) <= {"running", "paused"}:
            raise ApiError(400, f"unknown state in {q.get('state')!r}: running, paused")
        entries = [e for e in self.store.entries.values()
                   if query.matches(e.metadata, e.state, e.started_at, e.template)]
        items, token = lifecycle.page(entries, limit, q.get("nextToken"), key=lambda e: e.started_at,
                                      order=q.get("order") or "desc")  # E2B's API: newest first
        headers = {"x-next-token": token} if token else {}
        return JSONResponse([self.listed_json(e) for e in items], headers=headers)

    async def list_v1(self, request: Request) -> Response:
        query = ListQuery(metadata=_metadata_filter(request.query_params.get("metadata")), states=["running"])
        return JSONResponse([self.listed_json(e) for e in self.store.entries.values()
                             if query.matches(e.metadata, e.state, e.started_at, e.template)])

    async def get(self, request: Request) -> Response:
        return JSONResponse(self.detail_json(self.entry(request.path_params["sandbox_id"])))

    async def metrics(self, request: Request) -> Response:
        e = self.entry(request.path_params["sandbox_id"])
        if e.paused or e.sbx is None:
            return JSONResponse([])
        m = await asyncio.to_thread(lifecycle.metrics, e.sbx.workspace)
        q = request.query_params
        try:
            start, end = _ts(q.get("start")), _ts(q.get("end"))
        except ValueError as err:
            raise ApiError(400, f"invalid query: {err}") from None
        # E2B samples every 5 s from the sandbox's start and answers the samples inside
        # [start, end]; no history is kept here, so the reading now stands for the latest tick.
        ts = e.started_at + 5 * int(max(0.0, m.timestamp.timestamp() - e.started_at) // 5)
        if (start is not None and ts < start) or (end is not None and ts > end):
            return JSONResponse([])
        return JSONResponse([{"timestamp": _iso(ts), "timestampUnix": int(ts),
                              "cpuCount": m.cpu_count, "cpuUsedPct": m.cpu_used_pct, "memUsed": m.mem_used,
                              "memTotal": m.mem_total, "memCache": m.mem_cache, "diskUsed": m.disk_used,
                              "diskTotal": m.disk_total}])

    # ---- kill, timeout, pause ----

    async def kill(self, request: Request) -> Response:
        e = self.entry(request.path_params["sandbox_id"])
        await self.kill_entry(e)
        return Response(status_code=204)

    async def kill_entry(self, e: Entry) -> None:
        async with e.lock:
            await self._kill_locked(e)

    async def _kill_locked(self, e: Entry) -> None:
        sbx, paused = e.sbx, e.paused
        self.store.drop(e.sandbox_id)
        if sbx is not None:
            await sbx.kill()
        elif paused and e.workspace_id:  # its record and saved state (none left after a files-only pause)
            await AsyncSandbox.kill(e.workspace_id)

    async def reap_if_dead(self, e: Entry, sbx: AsyncSandbox) -> str:
        """What became of `e`, whose workspace `sbx` was just seen not running: "paused" (a pause
        held its lock, a deadline's among them, and it is kept), "running" (frozen for a moment
        by a fork or snapshot under its lock, or resumed since), or "gone": it died by itself
        (its init ended it, or it was killed outside) and is forgotten, its remains killed.
        Decided under its lock, so that a probe never takes a pause under way for a death."""
        async with e.lock:
            if self.store.entries.get(e.sandbox_id) is not e:
                return "gone"
            if e.paused:
                return "paused"
            if e.sbx is not sbx or await sbx.is_running():
                return "running"
            try:
                await self._kill_locked(e)
            except Exception:  # forgotten already; what is left of it is gc's
                log.exception("sandbox %s: removing what its death left failed", e.sandbox_id)
            return "gone"

    async def auto_resume(self, e: Entry) -> ApiError | None:
        """E2B's auto-resume of a paused sandbox by traffic, within the server's cap (429 past it,
        as a connect). The caller has checked the request would be served once it runs (E2B's
        proxy_grpc.go ResumeSandbox checks the traffic token, or envd's token, first). A
        filesystem-only pause is not resumed by traffic: it must be resumed explicitly (E2B:
        getAutoResumeSnapshot refuses it), so the request meets a paused sandbox."""
        if not e.lifecycle.auto_resume:
            return None
        async with e.lock:
            if not e.paused or await asyncio.to_thread(lifecycle.files_paused, self.files_dir(e)):
                return None
            try:
                with self.slots(1):
                    await self.resume(e, None)
            except ApiError as err:
                return err
            await self.apply_deadline(e)
        return None

    async def set_timeout(self, request: Request) -> Response:
        body = await body_of(request)
        timeout = lifecycle.check_timeout(body.get("timeout") if "timeout" in body else -1)
        e = self.entry(request.path_params["sandbox_id"])
        async with e.lock:
            # 0 is "now" here (E2B's API: the sandbox's end is now + timeout): a lifecycle that
            # pauses pauses at once, one that kills kills.
            e.deadline = time.time() if timeout == 0 else lifecycle.deadline_after(timeout)
            await self.apply_deadline(e)
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        body = await body_of(request)
        memory = body.get("memory", True)
        if not isinstance(memory, bool):
            raise ApiError(400, "memory must be a boolean")
        e = self.entry(request.path_params["sandbox_id"])
        async with e.lock:
            if e.paused:
                raise ApiError(409, f"sandbox {e.sandbox_id!r} is paused already")
            await self.pause_entry(e, memory)
        return Response(status_code=204)

    async def pause_entry(self, e: Entry, memory: bool | None = None) -> None:
        """Save to disk and release the workspace (the caller holds e.lock): whole, or with
        `memory` False (None: as the lifecycle's autoPauseMemory says) its files alone, for a
        cold boot at resume (E2B's sandbox_pause.go: memory false is filesystem-only)."""
        assert e.sbx is not None
        keep_memory = e.lifecycle.pause_memory if memory is None else memory
        if keep_memory:
            await asyncio.to_thread(lifecycle.pause, e.sbx.workspace, self.store.paused_dir(e.sandbox_id))
        else:
            await asyncio.to_thread(lifecycle.pause_files, e.sbx.workspace, self.files_dir(e))
        e.sbx, e.paused = None, True
        self.store.save(e)
        self.schedule(e)

    # ---- fork, snapshots ----

    async def fork(self, request: Request) -> Response:
        body = await body_of(request)
        count = lifecycle.check_fork_count(body.get("count"))
        timeout = lifecycle.check_timeout(body.get("timeout"))
        src = self.entry(request.path_params["sandbox_id"])
        async with src.lock:
            sbx = await self.running(src)
            with self.slots(count):
                children = await sbx.fork(timeout, count)
        out: list[dict[str, Any]] = []
        for child in children:
            if isinstance(child, BaseException):
                out.append({"error": {"code": status_of(child), "message": str(child)}})
                continue
            e = Entry(sandbox_id=child.sandbox_id, template=src.template, metadata=dict(src.metadata),
                      started_at=time.time(), deadline=lifecycle.deadline_after(timeout), lifecycle=Lifecycle(),
                      envd_token=secrets.token_hex(16),
                      traffic_token=None if src.traffic_token is None else secrets.token_hex(16),
                      allow_internet_access=src.allow_internet_access, workspace_id=child.sandbox_id, sbx=child)
            self.store.add(e)
            self.schedule(e)
            out.append({"sandbox": self.sandbox_json(e)})
        return JSONResponse(out, status_code=201)

    async def fork_snapshot(self, request: Request) -> Response:
        """POST /snapshots/{id}/fork (e2b-dev/infra PR #3441, commit 252a382e2): `count` (body,
        1 to 100, at most the server's cap) sandboxes from one of this server's snapshots, each
        living `timeout` (default 15 s), one entry per child, each a sandbox or its error. The
        snapshot is loaded once and forked `count` times; no source needs to run."""
        body = await body_of(request)
        count = lifecycle.check_fork_count(body.get("count"), lifecycle.MAX_SNAPSHOT_FORKS)
        timeout = lifecycle.check_timeout(body.get("timeout"), SNAPSHOT_FORK_TIMEOUT)
        if count > self.cap.limit:
            raise ApiError(400, f"Count must not exceed the maximum number of concurrent sandboxes ({self.cap.limit})")
        snapshot_id = urllib.parse.unquote(request.path_params["snapshot_id"])
        name = await asyncio.to_thread(self.own_snapshot, snapshot_id)
        with self.slots(count):
            children = await asyncio.to_thread(_fork_saved, name, count, timeout)
        out: list[dict[str, Any]] = []
        for child in children:
            if isinstance(child, BaseException):
                out.append({"error": {"code": status_of(child), "message": str(child)}})
                continue
            egress = child.info().egress or {}
            e = Entry(sandbox_id=child.id, template=name, metadata={}, started_at=time.time(),
                      deadline=lifecycle.deadline_after(timeout), lifecycle=Lifecycle(),
                      envd_token=secrets.token_hex(16), traffic_token=None,
                      allow_internet_access=lifecycle_internet(egress), workspace_id=child.id,
                      sbx=AsyncSandbox(child))
            self.store.add(e)
            self.schedule(e)
            out.append({"sandbox": self.sandbox_json(e)})
        return JSONResponse(out, status_code=201)

    def own_snapshot(self, snapshot_id: str) -> str:
        """The store's id of this server's snapshot that `snapshot_id` names (an id or a name);
        a warm template, another server's snapshot or nothing: one not-found answer."""
        own = self.store.snapshots()
        for d in store_templates.saved():
            if d.name in own and (snapshot_id == d.name or snapshot_id in store_templates.names(d)):
                return d.name
        raise ApiError(404, f"Snapshot {snapshot_id!r} not found")

    async def create_snapshot(self, request: Request) -> Response:
        body = await body_of(request)
        if body.get("memory") is False:
            raise ApiError(400, "a filesystem-only snapshot is not offered: a snapshot keeps memory and processes")
        name = body.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise ApiError(400, f"invalid snapshot name {name!r}")
            await asyncio.to_thread(self.check_snapshot_name, name)
        e = self.entry(request.path_params["sandbox_id"])
        async with e.lock:
            sbx = await self.running(e)
            info = await sbx.create_snapshot(name)
            self.store.own_snapshot(info.snapshot_id)
        return JSONResponse({"snapshotID": info.snapshot_id, "names": info.names}, status_code=201)

    async def list_snapshots(self, request: Request) -> Response:
        q = request.query_params
        source = q.get("sandboxID")
        if source is not None:
            e = self.store.entries.get(source)
            source = e.workspace_id if e is not None and e.workspace_id else source
        try:
            limit = int(q["limit"]) if "limit" in q else None
        except ValueError as err:
            raise ApiError(400, f"invalid query: {err}") from None
        own = self.store.snapshots()
        infos = [i for i in Sandbox.list_snapshots(sandbox_id=source, name=q.get("name")).next_items()
                 if i.snapshot_id in own]
        items, token = lifecycle.page(infos, limit, q.get("nextToken"), key=lambda i: i.snapshot_id)
        headers = {"x-next-token": token} if token else {}
        return JSONResponse([{"snapshotID": i.snapshot_id, "names": i.names} for i in items], headers=headers)

    async def delete_template(self, request: Request) -> Response:
        template_id = urllib.parse.unquote(request.path_params["template_id"])
        if template_id not in self.store.snapshots() or not await AsyncSandbox.delete_snapshot(template_id):
            raise ApiError(404, f"template or snapshot {template_id!r} not found")
        self.store.disown_snapshot(template_id)
        return Response(status_code=204)

    async def network(self, request: Request) -> Response:
        """update_network: the body replaces the sandbox's egress rules (what it leaves out is cleared)."""
        body = await body_of(request)
        e = self.entry(request.path_params["sandbox_id"])
        async with e.lock:
            sbx = await self.running(e)
            await sbx.update_network(_snake(body))
            e.allow_internet_access = body.get("allow_internet_access", True) is not False
            self.store.save(e)
        return Response(status_code=204)

    def routes(self, wrap: Callable[[Callable[[Request], Awaitable[Response]]], Any]) -> list[Route]:
        r = [
            ("/v2/sandboxes", self.create, "POST"), ("/sandboxes", self.create, "POST"),
            ("/v2/sandboxes", self.list_v2, "GET"), ("/sandboxes", self.list_v1, "GET"),
            ("/v2/sandboxes/{sandbox_id}/connect", self.connect, "POST"),
            ("/sandboxes/{sandbox_id}/connect", self.connect, "POST"),
            ("/sandboxes/{sandbox_id}/resume", self.connect, "POST"),
            ("/sandboxes/{sandbox_id}", self.get, "GET"), ("/sandboxes/{sandbox_id}", self.kill, "DELETE"),
            ("/sandboxes/{sandbox_id}/timeout", self.set_timeout, "POST"),
            ("/sandboxes/{sandbox_id}/pause", self.pause, "POST"),
            ("/sandboxes/{sandbox_id}/fork", self.fork, "POST"),
            ("/sandboxes/{sandbox_id}/snapshots", self.create_snapshot, "POST"),
            ("/sandboxes/{sandbox_id}/metrics", self.metrics, "GET"),
            ("/sandboxes/{sandbox_id}/network", self.network, "PUT"),
            ("/snapshots", self.list_snapshots, "GET"),
            ("/snapshots/{snapshot_id:path}/fork", self.fork_snapshot, "POST"),
            ("/templates/{template_id:path}", self.delete_template, "DELETE"),
        ]
        return [Route(path, wrap(fn), methods=[method]) for path, fn, method in r]


# E2B's network fields on the wire (camelCase) and in its SDK (snake_case); allow_internet_access
# is snake_case on both.
_CAMEL = {"allow_out": "allowOut", "deny_out": "denyOut", "dns_servers": "dnsServers",
          "egress_proxy": "egressProxy", "rules": "rules", "mask_request_host": "maskRequestHost",
          "https_ports": "httpsPorts", "allow_public_traffic": "allowPublicTraffic"}
_SNAKE = {v: k for k, v in _CAMEL.items()}


def _snake(network: dict[str, Any]) -> dict[str, Any]:
    """A network object of the wire, in the SDK's names (unknown ones kept: refused downstream)."""
    return {_SNAKE.get(k, k): v for k, v in network.items()}


SNAPSHOT_FORK_TIMEOUT = 15  # E2B's SandboxTimeoutDefault, which PR #3441's fork uses


def _fork_saved(name: str, count: int, timeout: int) -> list[Workspace | Exception]:
    """`count` clones of the saved snapshot `name` (loaded once, used in place), each ended by
    its init `timeout` seconds from now (0: never)."""
    d = store_templates.find(name)
    if d is None:
        raise ApiError(404, f"Snapshot {name!r} not found")
    snap = Snapshot.load(d)
    try:
        return snap.fork(count, timeout=timeout or None)
    finally:
        snap.release()


def lifecycle_internet(egress: dict[str, Any]) -> bool:
    """Whether egress rules leave the internet on: E2B's allow_internet_access=False is deny_out 0.0.0.0/0."""
    return e2b_network.ALL_TRAFFIC not in (egress.get("deny_out") or [])


def _str_map(d: Any) -> bool:
    return isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())


def _ts(text: str | None) -> float | None:
    """A time the SDKs send: unix seconds, or ISO 8601."""
    if not text:
        return None
    with contextlib.suppress(ValueError):
        return float(text)
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _metadata_filter(text: str | None) -> dict[str, str] | None:
    """The SDKs send metadata filters URL-encoded twice (each key and value quoted, then the pairs)."""
    if not text:
        return None
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in urllib.parse.parse_qsl(text)}


__all__ = ["ApiError", "BunshinError", "Rest", "error_response", "not_found", "status_of"]
