"""AsyncWorkspace and AsyncSandbox: the same surfaces as Workspace and Sandbox, for asyncio.

Commands are asyncio-native: a foreground command streams over the init's socket on asyncio
streams, a background command's exit is awaited on its pidfd (a reader of the event loop),
stdin goes over asyncio connections to the command's shim, and directory watches are inotify
descriptors read by the loop. No thread is used for them. What has no asynchronous primitive
(CRIU, mounts and cgroups for create/snapshot/fork/destroy; file reads and writes) runs on a
thread of this module's pool (_blocking): CRIU is driven over its RPC socket and the fork
pipeline's mounts, cgroups and page-table work are synchronous system calls interleaved with
it, so an asyncio-native create or fork means rewriting that pipeline, not wrapping a call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from .commands import (
    CommandHandle,
    CommandResult,
    ProcessInfo,
    PtySize,
    Utf8Stream,
    exit_exception,
    no_limit,
    result_of,
)
from .errors import CommandError, CommandTimeout, WorkspaceStateError
from .files import EntryInfo, FileStreamReader, WriteInfo
from .process import control_aio, protocol
from .process.tree import tree
from .sandbox import (
    Sandbox,
    SandboxInfo,
    SandboxMetrics,
    SandboxPaginator,
    SandboxQuery,
    SnapshotInfo,
    SnapshotPaginator,
    instance_or_class,
)
from .spec import WorkspaceSpec
from .watch import AsyncWatchHandle, EventCallback, ExitCallback
from .workspace import MemoryStats, Snapshot, Workspace, WorkspaceInfo

T = TypeVar("T")
W = TypeVar("W", bound="AsyncWorkspace")
Callback = Callable[[Any], None] | Callable[[Any], Awaitable[None]]


async def _call(cb: Callback | None, arg: object) -> None:
    if cb is not None:
        result = cb(arg)
        if inspect.isawaitable(result):
            await result


# The loop's default executor holds min(32, cores + 4) threads, 6 on a 2-core host: a rollout
# keeps a fork, a snapshot or a destroy in flight per sample, and those calls mostly wait (on
# CRIU, on the kernel), so they would queue behind each other there.
_POOL = ThreadPoolExecutor(max_workers=96, thread_name_prefix="bunshinfork-aio")


async def _blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the pool, for the operations with no asynchronous primitive
    (context variables travel along, as with asyncio.to_thread)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_POOL, call)


def _deadline(timeout: float | None) -> float | None:
    return None if no_limit(timeout) else time.monotonic() + float(timeout)  # type: ignore[arg-type]


# ---- commands ----


class AsyncCommandHandle:
    """A background command (E2B's AsyncCommandHandle). Its output is followed from the moment
    it starts (callbacks get it as it comes); wait() returns when it exits."""

    def __init__(self, handle: CommandHandle, pids: Callable[[], list[int]], on_stdout: Callback | None = None,
                 on_stderr: Callback | None = None, on_pty: Callback | None = None) -> None:
        self._h = handle
        self._pids = pids
        self._callbacks = (on_stdout, on_stderr, on_pty)
        self._task = asyncio.ensure_future(self._follow())

    @property
    def pid(self) -> int:
        return self._h.pid

    @property
    def stdout(self) -> str | None:
        return self._h.stdout

    @property
    def stderr(self) -> str | None:
        return self._h.stderr

    @property
    def exit_code(self) -> int | None:
        return self._h.exit_code

    @property
    def error(self) -> str | None:
        return self._h.error

    def _exit_future(self) -> asyncio.Future[None] | None:
        """Resolved when the command's process exits: its pidfd, read by the event loop."""
        host_pid = next((p.host_pid for p in tree(self._pids()) if p.pid == self._h.pid), None)
        if host_pid is None:
            return None
        try:
            pidfd = os.pidfd_open(host_pid)
        except OSError:
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(pidfd, ready)
        fut.add_done_callback(lambda f: ready() if f.cancelled() else None)
        return fut

    async def _follow(self) -> CommandResult:
        h = self._h
        streaming = any(self._callbacks)
        exited = self._exit_future()
        delay = 0.005
        try:
            while True:
                events, status = h._poll_once()
                for out, err, pty in events:
                    await _call(self._callbacks[0] if out is not None else self._callbacks[1] if err is not None
                                else self._callbacks[2], out if out is not None else err if err is not None else pty)
                if status is not None:
                    return h._finish(status)
                left = None if h._deadline is None else h._deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommandTimeout(f"background command {h.cmd_id} (pid {h.pid}) still running past its timeout",
                                         h.stdout or "", h.stderr or "")
                if exited is not None and not exited.done() and not streaming:
                    # Nothing to stream: sleep on the pidfd until the process exits.
                    await asyncio.wait([exited], timeout=left)
                else:
                    # Streaming output, or exited and its shim is writing the status: pace a poll.
                    await asyncio.sleep(delay if left is None else min(delay, left))
                    delay = min(delay * 1.5, 0.1)
        finally:
            if exited is not None and not exited.done():
                exited.cancel()

    async def wait(self) -> CommandResult:
        """The command's result once it exits; CommandExitException on a non-zero exit from a sandbox."""
        result = await asyncio.shield(self._task)
        if self._h._raise and result.exit_code != 0:
            raise exit_exception(result)
        return result

    async def kill(self) -> bool:
        try:
            await control_aio.simple(self._h._init_pid(), "kill", pid=-self._h.pid, sig=9)
            return True
        except CommandError:
            return False

    async def send_stdin(self, data: str | bytes, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._h._init_pid(), self._h.pid, "I", protocol.input_data(data), request_timeout)

    async def close_stdin(self, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._h._init_pid(), self._h.pid, "C", b"", request_timeout)

    async def disconnect(self) -> None:
        """Stop following the command; it keeps running."""
        self._h.disconnect()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class AsyncCommandInputHandle:
    """An ordered input stream to one command (E2B's AsyncCommandInputHandle)."""

    def __init__(self, ws: Workspace, pid: int, timeout: float | None) -> None:
        self._ws, self._pid, self._timeout = ws, pid, timeout
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._closing = False
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        stream = await control_aio.InputStream.open(self._ws._live_init_pid(), self._pid, self._timeout)
        try:
            while (chunk := await self._queue.get()) is not None:
                await stream.send("I", chunk)
            await stream.hang_up()
        finally:
            stream.close()

    async def send(self, data: str | bytes) -> None:
        if self._closing:
            raise CommandError("cannot send input after the input handle is closed; open a new one with "
                               "commands.stream_input(pid)")
        if self._task.done() and self._task.exception():
            raise self._task.exception()  # type: ignore[misc]
        self._queue.put_nowait(data.encode() if isinstance(data, str) else bytes(data))

    async def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._queue.put_nowait(None)
        await asyncio.wait_for(asyncio.shield(self._task), None if no_limit(self._timeout) else self._timeout)

    async def __aenter__(self) -> AsyncCommandInputHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncCommands:
    def __init__(self, ws: Workspace) -> None:
        self._ws = ws
        self._sync = ws.commands

    async def run(
        self,
        cmd: str | list[str],
        background: bool | None = None,
        envs: Mapping[str, str] | None = None,
        user: str | None = None,
        cwd: str | None = None,
        on_stdout: Callback | None = None,
        on_stderr: Callback | None = None,
        stdin: bool | None = None,
        timeout: float | None = 60,
        request_timeout: float | None = None,
        *,
        retain_output: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult | AsyncCommandHandle:
        """Commands.run for asyncio; callbacks may be coroutine functions."""
        argv = self._sync._argv(cmd)
        spec, full_env, workdir = self._sync._prepare(user, envs, env, cwd)
        init_pid = self._ws._live_init_pid()
        if background:
            cmd_id = os.urandom(8).hex()
            pid = int(await control_aio.simple(init_pid, "spawn", argv=argv, env=full_env, cwd=workdir,
                                                 cmd_id=cmd_id, user=spec, stdin="pipe" if stdin else None))
            handle = self._sync._handle(cmd_id, pid, timeout=timeout, retain_output=retain_output)
            return AsyncCommandHandle(handle, self._ws._pids, on_stdout, on_stderr)
        out, err = Utf8Stream(None, retain_output), Utf8Stream(None, retain_output)
        conn = await control_aio.AsyncConnection.open(init_pid)
        status: int | None = None
        try:
            async with asyncio.timeout(None if no_limit(timeout) else timeout):
                await conn.send("run", argv=argv, env=full_env, cwd=workdir, user=spec,
                                stdin="pipe" if stdin else None)
                async for kind, data in conn.frames():
                    if kind in ("O", "E"):
                        stream, cb = (out, on_stdout) if kind == "O" else (err, on_stderr)
                        if text := stream.feed(data):
                            await _call(cb, text)
                    elif kind == "F":
                        raise CommandError(f"cannot run {argv!r}: {data.decode(errors='replace')}")
                    elif kind == "X":
                        # Read on to the init's hang-up: a snapshot must not find it connected.
                        status = int(data)
        except TimeoutError:
            raise CommandTimeout(f"command {argv!r} timed out after {timeout}s and was killed",
                                 out.text or "", err.text or "") from None
        finally:
            # Closing the connection is what kills a command that timed out.
            await conn.close()
        if status is None:
            raise WorkspaceStateError("the workspace's init closed the connection before the command ended "
                                      "(was the workspace destroyed?)")
        for stream, cb in ((out, on_stdout), (err, on_stderr)):
            if text := stream.feed(b"", final=True):
                await _call(cb, text)
        result = result_of(status, out, err)
        if self._ws.conventions.raise_on_exit and result.exit_code != 0:
            raise exit_exception(result)
        return result

    async def list(self, request_timeout: float | None = None) -> list[ProcessInfo]:
        return self._sync.list(request_timeout)  # reads /proc: no waiting involved

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        init = self._ws._live_init_pid()
        for target in (-pid, pid):
            with contextlib.suppress(CommandError):
                await control_aio.simple(init, "kill", pid=target, sig=9)
                return True
        return False

    async def send_stdin(self, pid: int, data: str | bytes, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._ws._live_init_pid(), pid, "I", protocol.input_data(data), request_timeout)

    async def close_stdin(self, pid: int, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._ws._live_init_pid(), pid, "C", b"", request_timeout)

    def stream_input(self, pid: int, *, timeout: float | None = 60.0) -> AsyncCommandInputHandle:
        """An ordered input stream to the command (call it from the event loop)."""
        return AsyncCommandInputHandle(self._ws, pid, timeout)

    async def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None,
                      on_stdout: Callback | None = None, on_stderr: Callback | None = None, *,
                      retain_output: bool = True) -> AsyncCommandHandle:
        handle = self._sync.connect(pid, timeout, request_timeout, retain_output=retain_output)
        return AsyncCommandHandle(handle, self._ws._pids, on_stdout, on_stderr)


class AsyncPty:
    def __init__(self, ws: Workspace) -> None:
        self._ws = ws

    async def create(self, size: PtySize, on_data: Callback, user: str | None = None, cwd: str | None = None,
                     envs: dict[str, str] | None = None, timeout: float | None = 60,
                     request_timeout: float | None = None) -> AsyncCommandHandle:
        handle = await _blocking(self._ws.pty.create, size, user, cwd, envs, timeout, request_timeout)
        return AsyncCommandHandle(handle, self._ws._pids, on_pty=on_data)

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        return await AsyncCommands(self._ws).kill(pid, request_timeout)

    async def send_stdin(self, pid: int, data: bytes, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._ws._live_init_pid(), pid, "I", protocol.input_data(data), request_timeout)

    def stream_input(self, pid: int, *, timeout: float | None = 60.0) -> AsyncCommandInputHandle:
        """An ordered input stream to the command (call it from the event loop)."""
        return AsyncCommandInputHandle(self._ws, pid, timeout)

    async def resize(self, pid: int, size: PtySize, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._ws._live_init_pid(), pid, "R", protocol.resize_data(size.rows, size.cols),
                                     request_timeout)

    async def connect(self, pid: int, on_data: Callback, timeout: float | None = 60,
                      request_timeout: float | None = None) -> AsyncCommandHandle:
        return AsyncCommandHandle(self._ws.pty.connect(pid, timeout, request_timeout), self._ws._pids, on_pty=on_data)


# ---- files ----


class AsyncFileStreamReader:
    """files.read(format="stream") for asyncio: `async with` and `async for` over chunks."""

    def __init__(self, reader: FileStreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        chunk = await _blocking(next, self._reader, None)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def close(self) -> None:
        self._reader.close()

    aclose = close

    async def __aenter__(self) -> AsyncFileStreamReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._reader.close()


async def _gather(data: Any) -> Any:
    """An async iterable of chunks as the list the sync writer streams from."""
    if isinstance(data, AsyncIterable):
        return [bytes(chunk) async for chunk in data]
    return data


class AsyncFiles:
    def __init__(self, ws: Workspace) -> None:
        self._ws = ws
        self._sync = ws.files

    async def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text", user: str | None = None,
                   request_timeout: float | None = None, gzip: bool = False,
                   stream_idle_timeout: float | None = None) -> str | bytearray | AsyncFileStreamReader:
        out = await _blocking(self._sync.read, path, format, user, request_timeout, gzip, stream_idle_timeout)
        return AsyncFileStreamReader(out) if isinstance(out, FileStreamReader) else out

    async def write(self, path: str, data: Any, user: str | None = None, request_timeout: float | None = None,
                    gzip: bool = False, use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None,
                    *, mode: int = 0o644) -> WriteInfo:
        return await _blocking(self._sync.write, path, await _gather(data), user, request_timeout, gzip,
                                       use_octet_stream, metadata, mode=mode)

    async def write_files(self, files: Sequence[Mapping[str, Any]], user: str | None = None,
                          request_timeout: float | None = None, gzip: bool = False,
                          use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None,
                          *, mode: int = 0o644) -> list[WriteInfo]:
        entries = [{"path": f["path"], "data": await _gather(f["data"])} for f in files]
        return await _blocking(self._sync.write_files, entries, user, request_timeout, gzip,  # type: ignore[arg-type]
                                       use_octet_stream, metadata, mode=mode)

    async def list(self, path: str, depth: int | None = 1, user: str | None = None,
                   request_timeout: float | None = None) -> list[EntryInfo]:
        return await _blocking(self._sync.list, path, depth, user, request_timeout)

    async def exists(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        return await _blocking(self._sync.exists, path, user, request_timeout)

    async def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo:
        return await _blocking(self._sync.get_info, path, user, request_timeout)

    async def remove(self, path: str, user: str | None = None, request_timeout: float | None = None) -> None:
        await _blocking(self._sync.remove, path, user, request_timeout)

    async def rename(self, old_path: str, new_path: str, user: str | None = None,
                     request_timeout: float | None = None) -> EntryInfo:
        return await _blocking(self._sync.rename, old_path, new_path, user, request_timeout)

    async def make_dir(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        return await _blocking(self._sync.make_dir, path, user, request_timeout)

    async def watch_dir(self, path: str, on_event: EventCallback, on_exit: ExitCallback | None = None,
                        user: str | None = None, request_timeout: float | None = None, timeout: float | None = 60,
                        recursive: bool = False, include_entry: bool = False,
                        allow_network_mounts: bool = False) -> AsyncWatchHandle:
        """Watch a directory: on_event gets each event from the event loop until stop() (or
        `timeout` seconds, 0 for no limit), then on_exit."""
        watch = await _blocking(self._sync._watcher, path, user, recursive, include_entry)
        return AsyncWatchHandle(watch, on_event, on_exit, None if no_limit(timeout) else timeout)


# ---- the workspace ----


class AsyncWorkspace:
    """Workspace for asyncio (same methods, awaited)."""

    _sync_class: type[Workspace] = Workspace

    def __init__(self, ws: Workspace) -> None:
        self._ws = ws
        self.commands = AsyncCommands(ws)
        self.files = AsyncFiles(ws)
        self.pty = AsyncPty(ws)

    @property
    def workspace(self) -> Workspace:
        """The synchronous object behind this one."""
        return self._ws

    @classmethod
    async def create(cls: type[W], spec: WorkspaceSpec | None = None, *, timeout: float | None = None,
                     die_with_creator: bool = False, **overrides: Any) -> W:
        ws = await _blocking(Workspace.create, spec, timeout=timeout, die_with_creator=die_with_creator,
                                     **overrides)
        return cls(ws)

    @classmethod
    async def connect(cls: type[W], ws_id: str) -> W:  # type: ignore[override]
        return cls(await _blocking(cls._sync_class.connect, ws_id))

    @staticmethod
    async def list() -> list[WorkspaceInfo]:
        return await _blocking(Workspace.list)

    @property
    def id(self) -> str:
        return self._ws.id

    @property
    def init_pid(self) -> int:
        return self._ws.init_pid

    async def is_running(self) -> bool:
        return self._ws.is_running()

    async def info(self) -> WorkspaceInfo:
        return self._ws.info()

    async def memory(self) -> MemoryStats:
        return await _blocking(self._ws.memory)

    async def pause(self) -> None:
        await _blocking(self._ws.pause)

    async def resume(self) -> None:
        await _blocking(self._ws.resume)

    async def snapshot(self, memory: str = "auto", *, incremental: bool = True) -> AsyncSnapshot:
        return AsyncSnapshot(await _blocking(self._ws.snapshot, memory, incremental=incremental))

    async def fork(self, count: int = 1, memory: str = "auto", *, timeout: float | None = None,
                   die_with_creator: bool = False) -> list[AsyncWorkspace | Exception]:
        out = await _blocking(self._ws.fork, count, memory, timeout=timeout, die_with_creator=die_with_creator)
        return [r if isinstance(r, Exception) else type(self)(r) for r in out]

    async def set_timeout(self, timeout: float) -> None:
        await _blocking(Workspace.set_timeout, self._ws, timeout)

    async def destroy(self) -> None:
        await _blocking(self._ws.destroy)

    async def __aenter__(self: W) -> W:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"


class AsyncSnapshot:
    """Snapshot for asyncio: fork and release awaited (the capture itself is `snapshot`)."""

    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap

    @property
    def snapshot(self) -> Snapshot:
        """The synchronous object behind this one."""
        return self._snap

    @property
    def id(self) -> str:
        return self._snap.id

    @property
    def memory(self) -> str:
        return self._snap.memory

    async def fork(self, count: int = 1, memory: str | None = None, *, timeout: float | None = None,
                   die_with_creator: bool = False) -> list[AsyncWorkspace | Exception]:
        out = await _blocking(self._snap.fork, count, memory, timeout=timeout, die_with_creator=die_with_creator)
        return [r if isinstance(r, Exception) else AsyncWorkspace(r) for r in out]

    async def release(self) -> None:
        await _blocking(self._snap.release)

    def __repr__(self) -> str:
        return f"<AsyncSnapshot {self.id}>"


class async_instance_or_class:
    """instance_or_class for coroutine methods: `await sbx.kill()` or `await AsyncSandbox.kill(sandbox_id)`."""

    def __init__(self, method: Callable[..., Awaitable[Any]],
                 on_class: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.method = method
        self.on_class = on_class
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Awaitable[Any]]:
        method, on_class = self.method, self.on_class

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            if obj is not None:
                return await method(obj, *args, **kwargs)
            assert objtype is not None
            if args and isinstance(args[0], objtype):
                return await method(*args, **kwargs)
            if on_class is not None:
                return await on_class(objtype, *args, **kwargs)
            sandbox_id, *rest = args
            return await method(await objtype._attach(sandbox_id), *rest, **kwargs)

        return call


async def _kill_by_id(cls: type[AsyncSandbox], sandbox_id: str, **opts: Any) -> bool:
    return await _blocking(Sandbox.kill, sandbox_id)


async def _connect_by_id(cls: type[AsyncSandbox], sandbox_id: str, timeout: int | None = None,
                         logger: logging.Logger | None = None, *,
                         on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> AsyncSandbox:
    sbx = await cls._attach(sandbox_id)
    sbx._sbx._logger = logger
    return await sbx.connect(timeout, on_resume=on_resume)


async def _fork_by_id(cls: type[AsyncSandbox], sandbox_id: str, timeout: int | None = None,
                      count: int | None = None, logger: logging.Logger | None = None,
                      **opts: Any) -> list[AsyncSandbox | Exception]:
    return await (await cls._attach(sandbox_id)).fork(timeout, count)


def _list_snapshots_all(cls: type[AsyncSandbox], sandbox_id: str | None = None, limit: int | None = None,
                        next_token: str | None = None, name: str | None = None, **opts: Any) -> AsyncSnapshotPaginator:
    return AsyncSnapshotPaginator(lambda: Sandbox.list_snapshots(sandbox_id, limit, next_token, name))


class AsyncSandboxPaginator:
    """E2B's async paginator: the listing happens in next_items(), in the default executor."""

    def __init__(self, make: Callable[[], SandboxPaginator | SnapshotPaginator]) -> None:
        self._make = make
        self._sync: SandboxPaginator | SnapshotPaginator | None = None

    @property
    def has_next(self) -> bool:
        return self._sync is None or self._sync.has_next

    @property
    def next_token(self) -> str | None:
        return None if self._sync is None else self._sync.next_token

    async def next_items(self, **opts: Any) -> list[SandboxInfo]:
        if self._sync is None:
            self._sync = await _blocking(self._make)
        return self._sync.next_items()  # type: ignore[return-value]


class AsyncSnapshotPaginator(AsyncSandboxPaginator):
    async def next_items(self, **opts: Any) -> list[SnapshotInfo]:  # type: ignore[override]
        return await super().next_items()  # type: ignore[return-value]


class AsyncSandbox(AsyncWorkspace):
    """E2B's AsyncSandbox over a bunshin workspace (see Sandbox for what differs from Workspace)."""

    _sync_class = Sandbox
    default_sandbox_timeout = Sandbox.default_sandbox_timeout
    default_template = Sandbox.default_template

    def __init__(self, ws: Workspace) -> None:
        sbx = ws if isinstance(ws, Sandbox) else Sandbox._adopt(ws)
        super().__init__(sbx)
        self._sbx = sbx

    @classmethod
    async def _attach(cls, sandbox_id: str) -> AsyncSandbox:
        return cls(await _blocking(Sandbox._attach, sandbox_id))

    @classmethod
    async def create(  # type: ignore[override]
        cls,
        template: str | None = None,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        secure: bool | None = None,
        allow_internet_access: bool | None = None,
        mcp: dict[str, Any] | None = None,
        network: dict[str, Any] | None = None,
        iam: dict[str, Any] | None = None,
        lifecycle: dict[str, Any] | None = None,
        volume_mounts: dict[str, Any] | None = None,
        logger: logging.Logger | None = None,
        idempotency_key: str | None = None,
        **opts: Any,
    ) -> AsyncSandbox:
        """Sandbox.create for asyncio."""
        sbx = await _blocking(Sandbox.create, template, timeout, metadata, envs, secure,
                                      allow_internet_access, mcp, network, iam, lifecycle, volume_mounts, logger,
                                      idempotency_key, **opts)
        return cls(sbx)

    @property
    def sandbox_id(self) -> str:
        return self._sbx.sandbox_id

    async def is_running(self, request_timeout: float | None = None) -> bool:  # type: ignore[override]
        return self._sbx.is_running(request_timeout)

    async def get_info(self, **opts: Any) -> SandboxInfo:
        return await _blocking(self._sbx.get_info)

    get_info = async_instance_or_class(get_info)  # type: ignore[assignment]

    async def get_metrics(self, start: Any = None, end: Any = None, **opts: Any) -> list[SandboxMetrics]:
        return await _blocking(self._sbx.get_metrics, start, end)

    get_metrics = async_instance_or_class(get_metrics)  # type: ignore[assignment]

    @classmethod
    def list(cls, query: SandboxQuery | None = None, limit: int | None = None,  # type: ignore[override]
             next_token: str | None = None, order: Literal["asc", "desc"] | None = None,
             **opts: Any) -> AsyncSandboxPaginator:
        """A paginator whose next_items() lists the sandboxes (as E2B's, the call itself waits for nothing)."""
        return AsyncSandboxPaginator(lambda: Sandbox.list(query, limit, next_token, order))

    async def set_timeout(self, timeout: int, **opts: Any) -> None:  # type: ignore[override]
        await _blocking(self._sbx.set_timeout, timeout)

    set_timeout = async_instance_or_class(set_timeout)  # type: ignore[assignment]

    async def connect(self, timeout: int | None = None, *,  # type: ignore[override]
                      on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> AsyncSandbox:
        await _blocking(self._sbx.connect, timeout, on_resume=on_resume)
        return self

    connect = async_instance_or_class(connect, _connect_by_id)  # type: ignore[assignment]

    async def pause(self, keep_memory: bool | None = None, *,  # type: ignore[override]
                    mode: Literal["full", "filesystem"] | None = None, strict: bool = False, **opts: Any) -> bool:
        return await _blocking(self._sbx.pause, keep_memory, mode=mode, strict=strict)

    pause = async_instance_or_class(pause)  # type: ignore[assignment]

    async def beta_pause(self, keep_memory: bool | None = None, *,
                         mode: Literal["full", "filesystem"] | None = None, **opts: Any) -> bool:
        return await self.pause(keep_memory, mode=mode)

    beta_pause = async_instance_or_class(beta_pause)  # type: ignore[assignment]

    async def kill(self, **opts: Any) -> bool:
        return await _blocking(self._sbx.kill)

    kill = async_instance_or_class(kill, _kill_by_id)  # type: ignore[assignment]

    async def __aexit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        await self.kill()

    async def fork(self, timeout: int | None = None, count: int | None = None,  # type: ignore[override]
                   **opts: Any) -> list[AsyncSandbox | Exception]:
        out = await _blocking(self._sbx.fork, timeout, count)
        return [r if isinstance(r, Exception) else type(self)(r) for r in out]

    fork = async_instance_or_class(fork, _fork_by_id)  # type: ignore[assignment]

    async def create_snapshot(self, name: str | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                              **opts: Any) -> SnapshotInfo:
        return await _blocking(self._sbx.create_snapshot, name, mode=mode)

    create_snapshot = async_instance_or_class(create_snapshot)  # type: ignore[assignment]

    def list_snapshots(self, limit: int | None = None, next_token: str | None = None, name: str | None = None,
                       **opts: Any) -> AsyncSnapshotPaginator:
        return AsyncSnapshotPaginator(lambda: self._sbx.list_snapshots(limit, next_token, name))

    list_snapshots = instance_or_class(list_snapshots, _list_snapshots_all)  # type: ignore[assignment]

    @classmethod
    async def delete_snapshot(cls, snapshot_id: str, **opts: Any) -> bool:
        return await _blocking(Sandbox.delete_snapshot, snapshot_id)

    def get_host(self, port: int) -> str:
        return self._sbx.get_host(port)

    async def destroy(self) -> None:
        await self.kill()

