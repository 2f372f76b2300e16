"""envd on the host: the process and filesystem Connect-RPC services (the e2b package's
generated ASGI applications, with these handlers), /files and /health, each against the
sandbox's bunshin workspace through bunshin's async API."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import errno
import logging
import posixpath
import secrets
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process import process_pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..aio import AsyncCommandHandle, AsyncSandbox
from ..aio.pool import blocking
from ..commands import CommandExitException, CommandResult, PtySize
from ..entries import EntryInfo, FileType
from ..errors import (
    CommandError,
    FileOperationError,
    InvalidArgumentException,
    NotFoundException,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from ..watch import FilesystemEvent, WatchHandle
from . import authority
from .limits import Limits

log = logging.getLogger("bunshin.serve")
INTERNAL = "internal error: the server's log has the details"
DEFAULT_USER = "user"  # envd's default user (e2b >= envd 0.4.0 sends none)
NOT_FOUND = "was not found"  # what the SDKs read as a sandbox that is gone
KEEPALIVE_HEADER = "keepalive-ping-interval"
Lookup = Callable[[str], AsyncSandbox | None]
Gone = Callable[[], Awaitable[bool]]

_EVENTS = {"create": filesystem_pb.EventType.CREATE, "write": filesystem_pb.EventType.WRITE,
           "remove": filesystem_pb.EventType.REMOVE, "rename": filesystem_pb.EventType.RENAME,
           "chmod": filesystem_pb.EventType.CHMOD}
_TYPES = {FileType.FILE: filesystem_pb.FileType.FILE, FileType.DIR: filesystem_pb.FileType.DIRECTORY,
          FileType.SYMLINK: filesystem_pb.FileType.SYMLINK}


def user_of(authorization: str | None) -> str:
    """envd's user: `Authorization: Basic base64("name:")`, else the default user."""
    if not authorization or not authorization.startswith("Basic "):
        return DEFAULT_USER
    try:
        name = base64.b64decode(authorization[6:], validate=True).decode().split(":", 1)[0]
    except ValueError:
        raise ConnectError(Code.UNAUTHENTICATED, "malformed Authorization header") from None
    return name or DEFAULT_USER


def rpc_error(e: Exception) -> ConnectError:
    """bunshin's typed errors as Connect codes the SDKs map back to theirs."""
    if isinstance(e, ConnectError):
        return e
    if isinstance(e, WorkspaceNotFound):
        return ConnectError(Code.UNAVAILABLE, f"The sandbox {NOT_FOUND}")
    if (isinstance(e, FileOperationError) and e.errno == errno.EEXIST) or isinstance(e, FileExistsError):
        return ConnectError(Code.ALREADY_EXISTS, str(e))
    if isinstance(e, (NotFoundException, FileNotFoundError)):
        return ConnectError(Code.NOT_FOUND, str(e))
    if isinstance(e, (InvalidArgumentException, ValueError, NotADirectoryError, IsADirectoryError)):
        return ConnectError(Code.INVALID_ARGUMENT, str(e))
    if isinstance(e, PermissionError):
        return ConnectError(Code.PERMISSION_DENIED, str(e))
    if isinstance(e, WorkspaceStateError):
        return ConnectError(Code.UNAVAILABLE, f"The sandbox {NOT_FOUND} (it ended): {e}")
    if isinstance(e, CommandError):
        return ConnectError(Code.INVALID_ARGUMENT, str(e))
    # The details of anything else (host paths among them) are for the server's log.
    log.error("envd: %s: %s", type(e).__name__, e)
    return ConnectError(Code.INTERNAL, INTERNAL)


@contextlib.contextmanager
def rpc_errors() -> Iterator[None]:
    """Raise what the block raises as a Connect error with E2B's code (rpc_error). Only
    Exceptions: a handler cancelled because its client went away (asyncio.CancelledError),
    KeyboardInterrupt and SystemExit pass as themselves, so that a stream cut halfway ends
    its command's stream rather than turning into an error reply."""
    try:
        yield
    except Exception as e:
        raise rpc_error(e) from None


def entry_pb(e: EntryInfo) -> filesystem_pb.EntryInfo:
    ts = e.modified_time.timestamp()
    return filesystem_pb.EntryInfo(
        name=e.name, type=_TYPES.get(e.type, filesystem_pb.FileType.UNSPECIFIED) if e.type else
        filesystem_pb.FileType.UNSPECIFIED, path=e.path, size=e.size, mode=e.mode, permissions=e.permissions,
        owner=e.owner, group=e.group, modified_time=Timestamp(seconds=int(ts), nanos=int(ts % 1 * 1e9)),
        symlink_target=e.symlink_target, metadata=dict(e.metadata or {}))


def _selected_pid(sel: process_pb.ProcessSelector | None) -> int:
    match sel.selector if sel is not None else None:
        case Oneof(field="pid", value=pid):
            return int(pid)
        case Oneof(field="tag", value=tag):
            raise ConnectError(Code.NOT_FOUND, f"no process tagged {tag!r} (tags are not kept)")
    raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid) is required")


def _input_bytes(inp: process_pb.ProcessInput | None) -> bytes:
    match inp.input if inp is not None else None:
        case Oneof(value=data):
            return bytes(data)
    return b""


class Base:
    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup

    def sandbox(self, ctx: RequestContext[Any, Any]) -> AsyncSandbox:
        """The sandbox the router authenticated this request for (never a header's)."""
        sandbox_id = authority.authorized()
        sbx = self._lookup(sandbox_id) if sandbox_id is not None else None
        if sbx is None:
            raise ConnectError(Code.UNAVAILABLE, f"The sandbox {NOT_FOUND}")
        return sbx

    @staticmethod
    def user(ctx: RequestContext[Any, Any]) -> str:
        return user_of(ctx.request_headers.get("authorization"))

    def gone(self, sbx: AsyncSandbox) -> Gone:
        """Whether `sbx` has ended (killed, paused, or dead), for a stream of it that broke. The
        server forgets a sandbox before it kills it, so a stream that broke because its files
        went is told so here, whatever the workspace's own state says by then."""
        sandbox_id = authority.authorized()

        async def check() -> bool:
            if sandbox_id is None or self._lookup(sandbox_id) is not sbx:
                return True
            try:
                return not await sbx.is_running()
            except Exception:
                return True

        return check


def _data_event(kind: str, data: bytes) -> process_pb.ProcessEvent:
    return process_pb.ProcessEvent(event=Oneof("data", process_pb.ProcessEvent.DataEvent(output=Oneof(kind, data))))


async def _result(handle: AsyncCommandHandle) -> CommandResult:
    try:
        return await handle.wait()
    except CommandExitException as e:  # a sandbox's non-zero exit: envd reports it, it is no error
        return e


# Output events held for a client at most (each at most a 1 MiB slice of a stream, commands.READ_SLICE).
OUTPUT_QUEUE = 16
# What a stream ends with when its sandbox is gone under it. E2B's proxy resets the sandbox's
# connections when it is killed (e2b-dev/infra packages/shared/pkg/proxy/pool/client.go,
# resetAllConnections), and the SDK (e2b/envd/rpc.py, is_ambiguous_unavailable) reads this
# UNAVAILABLE, which says nothing of the sandbox, as a lost connection: it probes /health, whose
# 502 "not found" makes the error "the sandbox was killed or reached its end of life".
CONNECTION_LOST = "the connection to sandbox {} ended before the stream completed"
DEADLINE_EXCEEDED = "context deadline exceeded"  # connect-go's message for the request's deadline


async def _follow(handle: AsyncCommandHandle, queue: asyncio.Queue[tuple[str, bytes]],
                  keepalive: float | None, gone: Gone,
                  deadline: float | None = None) -> AsyncIterator[process_pb.ProcessEvent]:
    """The command's events until it exits (keepalives while it is quiet). A client that goes
    away closes this generator: the command is unfollowed, and keeps running. At `deadline`
    (the loop's clock: the client's Connect-Timeout-Ms) the stream ends with DEADLINE_EXCEEDED,
    as envd's does; a sandbox gone under the stream ends it as a lost connection."""
    sandbox_id = authority.authorized() or ""
    loop = asyncio.get_running_loop()
    waiter = asyncio.ensure_future(_result(handle))

    def expired() -> bool:
        return deadline is not None and loop.time() >= deadline

    try:
        while True:
            if expired():
                raise ConnectError(Code.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)
            wait = keepalive
            if deadline is not None:
                left = max(0.0, deadline - loop.time())
                wait = left if wait is None else min(wait, left)
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, waiter}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                yield _data_event(*get.result())
                continue
            get.cancel()
            if waiter in done:
                break
            if not expired():
                yield process_pb.ProcessEvent(event=Oneof("keepalive", process_pb.ProcessEvent.KeepAlive()))
        while not queue.empty():
            yield _data_event(*queue.get_nowait())
        if expired():
            raise ConnectError(Code.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)
        error = waiter.exception()
        # The sandbox killed under the command (its files gone, or its process killed with it):
        # envd dies with the sandbox and never sends an end, the connection is lost.
        if (error is not None or waiter.result().signal is not None) and \
                (isinstance(error, (WorkspaceNotFound, WorkspaceStateError)) or await gone()):
            raise ConnectError(Code.UNAVAILABLE, CONNECTION_LOST.format(sandbox_id))
        with rpc_errors():
            r = waiter.result()
        end = process_pb.ProcessEvent.EndEvent(exit_code=r.exit_code, exited=True, status=f"exit status {r.exit_code}",
                                               error=r.error or None)
        yield process_pb.ProcessEvent(event=Oneof("end", end))
    finally:
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(Exception):
                await handle.disconnect()


def _deadline(ctx: RequestContext[Any, Any]) -> float | None:
    """When (the loop's clock) the client's Connect-Timeout-Ms ends the request; None without
    one, or with 0, which envd reads as no limit (e2b-dev/infra packages/envd/internal/services/
    process/start.go, determineTimeoutFromHeader)."""
    left = ctx.timeout_ms
    if left is None or ctx.request_headers.get("connect-timeout-ms", "").strip() == "0":
        return None
    return asyncio.get_running_loop().time() + max(0.0, left) / 1000


async def _kill_at(handle: AsyncCommandHandle, deadline: float) -> None:
    """Kill the command at `deadline` unless it exited first: envd starts a process under a
    context with the request's timeout, independent of the stream, so it dies at the client's
    timeout whether or not the client is still there (start.go, procCtx). Its pidfd says when
    it exits, so a pid reused after it is never signalled."""
    exited = handle.exit_future()
    if exited is None:
        return
    try:
        done, _ = await asyncio.wait([exited], timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        if not done:
            with contextlib.suppress(Exception):  # the sandbox ended meanwhile: nothing to kill
                await handle.kill()
    finally:
        exited.cancel()


def _keepalive(ctx: RequestContext[Any, Any]) -> float | None:
    with contextlib.suppress(ValueError, TypeError):
        return max(1.0, float(ctx.request_headers.get(KEEPALIVE_HEADER) or ""))
    return None


def _home_path(sbx: AsyncSandbox, user: str, path: str) -> str:
    """A relative or `~` path as envd resolves it, against the user's home (e2b-dev/infra
    packages/envd/internal/permissions/path.go, ExpandAndResolve)."""
    home = sbx.workspace.files.accounts.resolve(user).home
    rest = path[1:].lstrip("/") if path == "~" or path.startswith("~/") else path
    return posixpath.normpath(posixpath.join(home, rest))


class ProcessService(Base):
    def __init__(self, lookup: Lookup) -> None:
        super().__init__(lookup)
        self._killers: set[asyncio.Task[None]] = set()  # each ends when its process exits or is killed

    async def list(self, request: process_pb.ListRequest, ctx: RequestContext[Any, Any]) -> process_pb.ListResponse:
        sbx = self.sandbox(ctx)
        with rpc_errors():
            procs = await sbx.commands.list()
        return process_pb.ListResponse(processes=[
            process_pb.ProcessInfo(pid=p.pid, tag=p.tag, config=process_pb.ProcessConfig(
                cmd=p.cmd, args=list(p.args), envs=dict(p.envs), cwd=p.cwd)) for p in procs])

    async def _start(self, request: process_pb.StartRequest, ctx: RequestContext[Any, Any],
                     queue: asyncio.Queue[tuple[str, bytes]]) -> AsyncCommandHandle:
        sbx, user = self.sandbox(ctx), self.user(ctx)
        cfg = request.process or process_pb.ProcessConfig()
        if not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        cwd = cfg.cwd if cfg.has_field("cwd") and cfg.cwd else None
        envs = dict(cfg.envs)
        with rpc_errors():
            if cwd is not None and not cwd.startswith("/"):
                cwd = await asyncio.to_thread(_home_path, sbx, user, cwd)
            if request.pty is not None:
                size = request.pty.size or process_pb.PTY.Size(cols=80, rows=24)
                return await sbx.pty.create(PtySize(rows=size.rows or 24, cols=size.cols or 80),
                                            on_data=lambda b: queue.put(("pty", bytes(b))), user=user,
                                            cwd=cwd, envs=envs, timeout=0)
            # Output goes to the client only (retained nowhere here), through a bounded queue:
            # a client slower than the command holds its reads, and the rest waits in the file.
            handle = await sbx.commands.run(
                [cfg.cmd, *cfg.args], background=True, envs=envs, user=user, cwd=cwd, stdin=bool(request.stdin),
                timeout=0, on_stdout=lambda s: queue.put(("stdout", s.encode())),
                on_stderr=lambda s: queue.put(("stderr", s.encode())), retain_output=False)
        assert isinstance(handle, AsyncCommandHandle)
        return handle

    async def start(self, request: process_pb.StartRequest,
                    ctx: RequestContext[Any, Any]) -> AsyncIterator[process_pb.StartResponse]:
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(OUTPUT_QUEUE)
        deadline = _deadline(ctx)
        sbx = self.sandbox(ctx)
        handle = await self._start(request, ctx, queue)
        if deadline is not None:
            killer = asyncio.ensure_future(_kill_at(handle, deadline))
            self._killers.add(killer)
            killer.add_done_callback(self._killers.discard)
        start = process_pb.ProcessEvent.StartEvent(pid=handle.pid)
        yield process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof("start", start)))
        async for ev in _follow(handle, queue, _keepalive(ctx), self.gone(sbx), deadline):
            yield process_pb.StartResponse(event=ev)

    async def connect(self, request: process_pb.ConnectRequest,
                      ctx: RequestContext[Any, Any]) -> AsyncIterator[process_pb.ConnectResponse]:
        sbx, pid = self.sandbox(ctx), _selected_pid(request.process)
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(OUTPUT_QUEUE)
        # envd's Connect streams what the process writes from now on, a terminal's as `pty`
        # events (connect.go: a fork of the process's data channel); its timeout ends the
        # stream, never the process (only Start runs the process under the request's timeout).
        with rpc_errors():
            handle = await sbx.commands.connect(pid, timeout=0,
                                                on_stdout=lambda s: queue.put(("stdout", s.encode())),
                                                on_stderr=lambda s: queue.put(("stderr", s.encode())),
                                                on_pty=lambda b: queue.put(("pty", bytes(b))),
                                                retain_output=False, new_only=True)
        start = process_pb.ProcessEvent.StartEvent(pid=pid)
        yield process_pb.ConnectResponse(event=process_pb.ProcessEvent(event=Oneof("start", start)))
        async for ev in _follow(handle, queue, _keepalive(ctx), self.gone(sbx), _deadline(ctx)):
            yield process_pb.ConnectResponse(event=ev)

    async def update(self, request: process_pb.UpdateRequest,
                     ctx: RequestContext[Any, Any]) -> process_pb.UpdateResponse:
        sbx, pid = self.sandbox(ctx), _selected_pid(request.process)
        if request.pty is not None and request.pty.size is not None:
            with rpc_errors():
                await sbx.pty.resize(pid, PtySize(rows=request.pty.size.rows, cols=request.pty.size.cols))
        return process_pb.UpdateResponse()

    async def send_input(self, request: process_pb.SendInputRequest,
                         ctx: RequestContext[Any, Any]) -> process_pb.SendInputResponse:
        sbx, pid = self.sandbox(ctx), _selected_pid(request.process)
        with rpc_errors():
            await sbx.commands.send_stdin(pid, _input_bytes(request.input))
        return process_pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[process_pb.StreamInputRequest],
                           ctx: RequestContext[Any, Any]) -> process_pb.StreamInputResponse:
        sbx, pid = self.sandbox(ctx), None
        async for msg in request:
            match msg.event:
                case Oneof(field="start", value=start):
                    pid = _selected_pid(start.process)
                case Oneof(field="data", value=data):
                    if pid is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "a start event must come before data")
                    with rpc_errors():
                        await sbx.commands.send_stdin(pid, _input_bytes(data.input))
        return process_pb.StreamInputResponse()

    async def send_signal(self, request: process_pb.SendSignalRequest,
                          ctx: RequestContext[Any, Any]) -> process_pb.SendSignalResponse:
        sbx, pid = self.sandbox(ctx), _selected_pid(request.process)
        # SIGTERM and SIGKILL both end the command's process group (bunshin kills with SIGKILL).
        with rpc_errors():
            killed = await sbx.commands.kill(pid)
        if not killed:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
        return process_pb.SendSignalResponse()

    async def close_stdin(self, request: process_pb.CloseStdinRequest,
                          ctx: RequestContext[Any, Any]) -> process_pb.CloseStdinResponse:
        sbx, pid = self.sandbox(ctx), _selected_pid(request.process)
        with rpc_errors():
            await sbx.commands.close_stdin(pid)
        return process_pb.CloseStdinResponse()


# Each watcher is an inotify instance of the host's root, of which the host allows 128
# (fs.inotify.max_user_instances) for every root process: a server keeps most for itself.
MAX_WATCHERS_PER_SANDBOX = 16
MAX_WATCHERS = 64


class FilesystemService(Base):
    def __init__(self, lookup: Lookup) -> None:
        super().__init__(lookup)
        self._watchers: dict[str, tuple[str, WatchHandle]] = {}
        self._watching: dict[str, int] = {}  # sandbox id: its live watchers (both kinds)

    def _take_watcher(self) -> str:
        for sid in {sid for sid, _ in self._watchers.values()}:
            if self._lookup(sid) is None:  # killed or paused since: its watchers are gone
                self.forget(sid)
        sandbox_id = authority.authorized() or ""
        mine = self._watching.get(sandbox_id, 0)
        if mine >= MAX_WATCHERS_PER_SANDBOX or sum(self._watching.values()) >= MAX_WATCHERS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"too many watchers: at most {MAX_WATCHERS_PER_SANDBOX} "
                                                        f"per sandbox, {MAX_WATCHERS} per server")
        self._watching[sandbox_id] = mine + 1
        return sandbox_id

    def _give_watcher(self, sandbox_id: str) -> None:
        left = self._watching.get(sandbox_id, 0) - 1
        if left > 0:
            self._watching[sandbox_id] = left
        else:
            self._watching.pop(sandbox_id, None)

    async def _call(self, ctx: RequestContext[Any, Any], op: str, *args: Any, **kwargs: Any) -> Any:
        sbx = self.sandbox(ctx)
        with rpc_errors():
            return await getattr(sbx.files, op)(*args, user=self.user(ctx), **kwargs)

    async def stat(self, request: filesystem_pb.StatRequest, ctx: RequestContext[Any, Any]) -> Any:
        return filesystem_pb.StatResponse(entry=entry_pb(await self._call(ctx, "get_info", request.path)))

    async def make_dir(self, request: filesystem_pb.MakeDirRequest, ctx: RequestContext[Any, Any]) -> Any:
        if not await self._call(ctx, "make_dir", request.path):
            raise ConnectError(Code.ALREADY_EXISTS, f"{request.path} already exists")
        return filesystem_pb.MakeDirResponse(entry=entry_pb(await self._call(ctx, "get_info", request.path)))

    async def move(self, request: filesystem_pb.MoveRequest, ctx: RequestContext[Any, Any]) -> Any:
        entry = await self._call(ctx, "rename", request.source, request.destination)
        return filesystem_pb.MoveResponse(entry=entry_pb(entry))

    async def list_dir(self, request: filesystem_pb.ListDirRequest, ctx: RequestContext[Any, Any]) -> Any:
        entries = await self._call(ctx, "list", request.path, depth=request.depth or 1)
        return filesystem_pb.ListDirResponse(entries=[entry_pb(e) for e in entries])

    async def remove(self, request: filesystem_pb.RemoveRequest, ctx: RequestContext[Any, Any]) -> Any:
        await self._call(ctx, "remove", request.path)
        return filesystem_pb.RemoveResponse()

    async def watch_dir(self, request: filesystem_pb.WatchDirRequest,
                        ctx: RequestContext[Any, Any]) -> AsyncIterator[filesystem_pb.WatchDirResponse]:
        queue: asyncio.Queue[FilesystemEvent] = asyncio.Queue()
        held = self._take_watcher()
        try:
            handle = await self._call(ctx, "watch_dir", request.path, on_event=queue.put_nowait, timeout=0,
                                      recursive=request.recursive, include_entry=request.include_entry)
        except BaseException:
            self._give_watcher(held)
            raise
        try:
            yield filesystem_pb.WatchDirResponse(event=Oneof("start", filesystem_pb.WatchDirResponse.StartEvent()))
            keepalive = _keepalive(ctx)
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), keepalive)
                except TimeoutError:
                    yield filesystem_pb.WatchDirResponse(
                        event=Oneof("keepalive", filesystem_pb.WatchDirResponse.KeepAlive()))
                    continue
                yield filesystem_pb.WatchDirResponse(event=Oneof("filesystem", _event_pb(ev)))
        finally:
            self._give_watcher(held)
            await handle.stop()

    async def create_watcher(self, request: filesystem_pb.CreateWatcherRequest, ctx: RequestContext[Any, Any]) -> Any:
        sbx = self.sandbox(ctx)
        held = self._take_watcher()
        try:
            with rpc_errors():
                handle = await asyncio.to_thread(sbx.workspace.files.watch_dir, request.path, self.user(ctx),
                                                 recursive=request.recursive, include_entry=request.include_entry)
        except BaseException:
            self._give_watcher(held)
            raise
        watcher_id = secrets.token_hex(8)
        self._watchers[watcher_id] = (authority.authorized() or "", handle)
        return filesystem_pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _watcher(self, ctx: RequestContext[Any, Any], watcher_id: str) -> WatchHandle:
        sandbox_id, handle = self._watchers.get(watcher_id, ("", None))  # type: ignore[arg-type]
        if handle is None or sandbox_id != authority.authorized():
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id!r} not found")
        return handle

    async def get_watcher_events(self, request: filesystem_pb.GetWatcherEventsRequest,
                                 ctx: RequestContext[Any, Any]) -> Any:
        handle = self._watcher(ctx, request.watcher_id)
        with rpc_errors():
            events = await asyncio.to_thread(handle.get_new_events)
        return filesystem_pb.GetWatcherEventsResponse(events=[_event_pb(e) for e in events])

    async def remove_watcher(self, request: filesystem_pb.RemoveWatcherRequest, ctx: RequestContext[Any, Any]) -> Any:
        handle = self._watcher(ctx, request.watcher_id)
        if self._watchers.pop(request.watcher_id, None) is not None:
            self._give_watcher(authority.authorized() or "")
        await asyncio.to_thread(handle.stop)
        return filesystem_pb.RemoveWatcherResponse()

    def forget(self, sandbox_id: str) -> None:
        """Stop the watchers of a sandbox that ended."""
        for wid, (sid, handle) in list(self._watchers.items()):
            if sid == sandbox_id:
                self._watchers.pop(wid, None)
                self._give_watcher(sid)
                with contextlib.suppress(Exception):
                    handle.stop()


def _event_pb(ev: FilesystemEvent) -> filesystem_pb.FilesystemEvent:
    return filesystem_pb.FilesystemEvent(name=ev.name, type=_EVENTS.get(ev.type.value,
                                                                         filesystem_pb.EventType.UNSPECIFIED),
                                         entry=entry_pb(ev.entry) if ev.entry is not None else None)


def apps(lookup: Lookup) -> tuple[ProcessASGIApplication, FilesystemASGIApplication, FilesystemService]:
    fs = FilesystemService(lookup)
    return ProcessASGIApplication(ProcessService(lookup)), FilesystemASGIApplication(fs), fs


# ---- plain HTTP: /files and /health ----


def http_error(status: int, message: str) -> JSONResponse:
    if status >= 500:
        message = INTERNAL  # rpc_error logged what it was
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _http_status(e: Exception) -> int:
    err = rpc_error(e)
    return {Code.NOT_FOUND: 404, Code.INVALID_ARGUMENT: 400, Code.PERMISSION_DENIED: 403,
            Code.ALREADY_EXISTS: 409, Code.UNAVAILABLE: 502}.get(err.code, 500)


async def files_get(sbx: AsyncSandbox, request: Request) -> Response:
    path = request.query_params.get("path")
    if not path:
        return http_error(400, "path is required")
    user = request.query_params.get("username") or DEFAULT_USER
    try:
        stream = await sbx.files.read(path, format="stream", user=user)
    except Exception as e:
        return http_error(_http_status(e), str(e))

    async def chunks() -> AsyncIterator[bytes]:
        async with stream:
            async for chunk in stream:
                yield bytes(chunk)

    return StreamingResponse(chunks(), media_type="application/octet-stream")


# A gzip body's decompressed size: a few KiB of gzip can expand a thousandfold, so the body caps
# (counted as it arrives) say nothing of it. It is held to the server's upload cap (Limits.
# max_upload_bytes, --max-upload-bytes): past it, 413 (envd's answer to a body too big).
METADATA_HEADER = "x-metadata-"  # envd >= 0.6.2: X-Metadata-<key>: <value>, the key lowercased
# What one step of the decompression makes at most: the bytes in memory at once, and the
# longest the pool thread doing it holds the GIL between releases.
GUNZIP_SLICE = 1 << 20


class UploadTooLarge(ValueError):
    """A decompressed upload past the server's upload cap."""


def gunzipped(body: bytes, limit: int) -> Iterator[bytes]:
    """A `Content-Encoding: gzip` upload's bytes (envd decompresses them: e2b-dev/infra
    packages/envd/internal/api/upload.go, getDecompressedBody), a GUNZIP_SLICE at a time;
    UploadTooLarge once they pass `limit`, InvalidArgumentException for a corrupt or truncated
    body. Decompression is CPU work: run it on a thread, never on the event loop."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    total = 0
    pending = body
    while True:
        try:
            out = d.decompress(pending, GUNZIP_SLICE)
        except zlib.error as e:
            raise InvalidArgumentException(f"the gzip body is corrupt: {e}") from None
        pending = d.unconsumed_tail
        total += len(out)
        if total > limit:
            raise UploadTooLarge(f"the upload decompresses to more than {limit} bytes")
        if out:
            yield out
        if d.eof:
            return
        if not out and not pending:
            raise InvalidArgumentException("the gzip body is truncated")


def check_gzip(body: bytes, limit: int) -> None:
    """Decompress `body` to nothing, to refuse it (UploadTooLarge, InvalidArgumentException)
    before a byte of it is written: a file is never left half-written by a refused upload."""
    for _ in gunzipped(body, limit):
        pass


def gunzip(body: bytes, limit: int) -> bytes:
    """gunzipped(), whole."""
    return b"".join(gunzipped(body, limit))


def upload_metadata(headers: Any) -> dict[str, str] | None:
    """The file metadata an upload's X-Metadata-* headers carry (applied to every file of it)."""
    out = {k[len(METADATA_HEADER):].lower(): v for k, v in headers.items() if k.lower().startswith(METADATA_HEADER)}
    return out or None


async def files_post(sbx: AsyncSandbox, request: Request, signed: bool = False,
                     max_bytes: int = Limits.max_upload_bytes) -> Response:
    """Write the uploaded files. `signed`: the request's only credential is a URL signed for
    the query's path: one file, written there (a second part would be a file nobody signed).
    `max_bytes`: the server's upload cap, which a gzip body's decompressed bytes are held to."""
    user = request.query_params.get("username") or DEFAULT_USER
    path = request.query_params.get("path")
    ctype = request.headers.get("content-type", "")
    uploads: list[tuple[str, bytes | Iterator[bytes]]] = []
    if signed and not path:
        return http_error(400, "a signed upload URL names its path")
    try:
        if ctype.startswith("multipart/form-data"):
            async with request.form(max_files=10_000, max_fields=10_000, max_part_size=1 << 40) as form:
                files = [item for _, item in form.multi_items() if not isinstance(item, str)]
                if signed and (len(files) != 1 or form.getlist("file") != files):
                    return http_error(400, "a signed upload URL writes one file, at its path: send one 'file' part")
                for item in form.getlist("file"):
                    if isinstance(item, str):
                        continue
                    name = path if path and (signed or len(form.getlist("file")) == 1) else item.filename
                    if not name:
                        return http_error(400, "each uploaded file needs a path (its file name)")
                    uploads.append((name, await item.read()))
        else:
            if not path:
                return http_error(400, "path is required")
            encoding = request.headers.get("content-encoding", "").strip().lower()
            if encoding not in ("", "identity", "gzip"):
                return http_error(400, f"unsupported Content-Encoding {encoding!r}: gzip or none")
            body = await request.body()
            if encoding == "gzip":
                # Checked whole on a thread first (the loop keeps serving meanwhile), then
                # decompressed again a slice at a time as the write (on the pool) consumes it:
                # never more than a slice of it in memory, nothing written if it is refused.
                await blocking(check_gzip, body, max_bytes)
                uploads.append((path, gunzipped(body, max_bytes)))
            else:
                uploads.append((path, body))
        metadata = upload_metadata(request.headers)
        out = []
        for name, data in uploads:
            info = await sbx.files.write(name, data, user=user, metadata=metadata)
            item = {"name": info.name, "type": info.type.value if info.type else "file", "path": info.path}
            out.append({**item, "metadata": info.metadata} if info.metadata else item)
    except UploadTooLarge as e:
        return http_error(413, str(e))
    except Exception as e:  # not a cancel: a client gone mid-upload is no error to answer
        return http_error(_http_status(e), str(e))
    return JSONResponse(out)


def signature_refusal(query: Any) -> str:
    """Why a signed /files URL is refused, in envd's words (e2b-dev/infra
    packages/envd/internal/api/auth.go: the expiration is checked before the signature)."""
    with contextlib.suppress(TypeError, ValueError):
        if int(query.get("signature_expiration") or "") < now().timestamp():
            return "signature is already expired"
    return "invalid signature"


def health() -> Response:
    return Response(status_code=204)


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)
