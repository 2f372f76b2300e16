"""ws.commands and ws.pty for asyncio (E2B's AsyncCommands, AsyncPty, AsyncCommandHandle).

A foreground command streams over the init's socket on asyncio streams, a background
command's exit is awaited on its pidfd (a reader of the event loop), and stdin goes over
asyncio connections to the command's shim: no thread is used for any of them. A background
command's output files are read a bounded slice at a time, from where the last read ended, so
that a flood of output holds the event loop no more than one slice's read per poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..commands import (
    CommandHandle,
    CommandResult,
    ProcessInfo,
    PtySize,
    Utf8Stream,
    exit_exception,
    no_limit,
    result_of,
)
from ..errors import CommandError, CommandTimeout
from ..process import control_aio, protocol
from ..process.tree import tree
from ..workspace import Workspace
from .pool import blocking

Callback = Callable[[Any], None] | Callable[[Any], Awaitable[None]]
InitPid = Callable[[], int]


async def call(cb: Callback | None, arg: object) -> None:
    """Hand `arg` to a callback that may be a coroutine function."""
    if cb is not None:
        result = cb(arg)
        if inspect.isawaitable(result):
            await result


class AsyncCommandHandle:
    """A background command (E2B's AsyncCommandHandle). Its output is followed from the moment
    it starts (callbacks get it as it comes); wait() returns when it exits."""

    def __init__(self, handle: CommandHandle, init_pid: InitPid, pids: Callable[[], list[int]],
                 on_stdout: Callback | None = None, on_stderr: Callback | None = None,
                 on_pty: Callback | None = None) -> None:
        self._h = handle
        self._init_pid = init_pid
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

        closed = False

        def ready() -> None:
            nonlocal closed
            # Once only: a cancel in the iteration where the pidfd turned readable runs this from
            # both the reader and the done callback, and a second close closed whatever then
            # held the number (another request's control socket, a proxied connection).
            if closed:
                return
            closed = True
            loop.remove_reader(pidfd)
            os.close(pidfd)
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(pidfd, ready)
        fut.add_done_callback(lambda f: ready() if f.cancelled() else None)
        return fut

    async def _follow(self) -> CommandResult:
        h = self._h
        on_stdout, on_stderr, on_pty = self._callbacks
        streaming = any(self._callbacks)
        exited = self._exit_future()
        delay = 0.005
        try:
            while True:
                # On the loop, as no thread is used: a poll reads at most READ_SLICE of each
                # output file from where the last ended (about a millisecond from tmpfs).
                events, result = h.poll()
                for out, err, pty in events:
                    if out is not None:
                        await call(on_stdout, out)
                    elif err is not None:
                        await call(on_stderr, err)
                    else:
                        await call(on_pty, pty)
                if result is not None:
                    return result
                left = None if h.deadline is None else h.deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommandTimeout(f"background command {h.cmd_id} (pid {h.pid}) still running past its timeout",
                                         h.stdout or "", h.stderr or "")
                if exited is not None and not exited.done() and not streaming:
                    # Nothing to stream: sleep on the pidfd until the process exits.
                    await asyncio.wait([exited], timeout=left)
                else:
                    # Streaming output, or exited and its shim is writing the status: pace a poll.
                    await asyncio.sleep(delay if left is None else min(delay, left))
                    delay = 0.005 if events else min(delay * 1.5, 0.1)  # output flowing: read again soon
        finally:
            if exited is not None and not exited.done():
                exited.cancel()

    async def wait(self) -> CommandResult:
        """The command's result once it exits; CommandExitException on a non-zero exit from a sandbox."""
        result = await asyncio.shield(self._task)
        if self._h.raises_on_exit and result.exit_code != 0:
            raise exit_exception(result)
        return result

    def exit_future(self) -> asyncio.Future[None] | None:
        """A future resolved when the command's process exits (its pidfd, read by the event
        loop; cancel it to close the pidfd), or None if it has exited already."""
        return self._exit_future()

    async def kill(self) -> bool:
        try:
            await control_aio.simple(self._init_pid(), "kill", pid=-self._h.pid, sig=9)
            return True
        except CommandError:
            return False

    async def send_stdin(self, data: str | bytes, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._init_pid(), self._h.pid, "I", protocol.input_data(data), request_timeout)

    async def close_stdin(self, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._init_pid(), self._h.pid, "C", b"", request_timeout)

    async def disconnect(self) -> None:
        """Stop following the command; it keeps running."""
        self._h.disconnect()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def follow(ws: Workspace, handle: CommandHandle, on_stdout: Callback | None = None,
           on_stderr: Callback | None = None, on_pty: Callback | None = None) -> AsyncCommandHandle:
    """Follow a background command of `ws` from the event loop."""
    return AsyncCommandHandle(handle, ws.live_init_pid, ws.host_pids, on_stdout, on_stderr, on_pty)


class AsyncCommandInputHandle:
    """An ordered input stream to one command (E2B's AsyncCommandInputHandle)."""

    def __init__(self, init_pid: InitPid, pid: int, timeout: float | None) -> None:
        self._init_pid, self._pid, self._timeout = init_pid, pid, timeout
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._closing = False
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        stream = await control_aio.InputStream.open(self._init_pid(), self._pid, self._timeout)
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
        if self._task.done() and (error := self._task.exception()) is not None:
            raise error
        self._queue.put_nowait(protocol.input_data(data))

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
    """ws.commands for asyncio (E2B's AsyncCommands)."""

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
        launch = self._sync.prepare(cmd, user, envs, env, cwd)
        init_pid = self._ws.live_init_pid()
        if background:
            cmd_id = os.urandom(8).hex()
            pid = int(await control_aio.simple(init_pid, "spawn", argv=launch.argv, env=launch.env, cwd=launch.cwd,
                                               cmd_id=cmd_id, user=launch.user, stdin="pipe" if stdin else None))
            handle = self._sync.follow(cmd_id, pid, timeout=timeout, retain_output=retain_output)
            return follow(self._ws, handle, on_stdout, on_stderr)
        out, err = Utf8Stream(None, retain_output), Utf8Stream(None, retain_output)
        conn = await control_aio.AsyncConnection.open(init_pid)
        reply = protocol.RunReply(launch.argv)
        try:
            async with asyncio.timeout(None if no_limit(timeout) else timeout):
                await conn.send("run", argv=launch.argv, env=launch.env, cwd=launch.cwd, user=launch.user,
                                stdin="pipe" if stdin else None)
                async for kind, data in conn.frames():
                    if reply.feed(kind, data):
                        stream, cb = (out, on_stdout) if kind == "O" else (err, on_stderr)
                        if text := stream.feed(data):
                            await call(cb, text)
        except TimeoutError:
            raise CommandTimeout(f"command {launch.argv!r} timed out after {timeout}s and was killed",
                                 out.text or "", err.text or "") from None
        finally:
            # Closing the connection is what kills a command that timed out.
            await conn.close()
        status = reply.status()
        for stream, cb in ((out, on_stdout), (err, on_stderr)):
            if text := stream.feed(b"", final=True):
                await call(cb, text)
        result = result_of(status, out, err)
        if self._ws.conventions.raise_on_exit and result.exit_code != 0:
            raise exit_exception(result)
        return result

    async def list(self, request_timeout: float | None = None) -> list[ProcessInfo]:
        return self._sync.list(request_timeout)  # reads /proc: no waiting involved

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        init = self._ws.live_init_pid()
        for target in (-pid, pid):
            with contextlib.suppress(CommandError):
                await control_aio.simple(init, "kill", pid=target, sig=9)
                return True
        return False

    async def send_stdin(self, pid: int, data: str | bytes, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._ws.live_init_pid(), pid, "I", protocol.input_data(data), request_timeout)

    async def close_stdin(self, pid: int, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._ws.live_init_pid(), pid, "C", b"", request_timeout)

    def stream_input(self, pid: int, *, timeout: float | None = 60.0) -> AsyncCommandInputHandle:
        """An ordered input stream to the command (call it from the event loop)."""
        return AsyncCommandInputHandle(self._ws.live_init_pid, pid, timeout)

    async def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None,
                      on_stdout: Callback | None = None, on_stderr: Callback | None = None, *,
                      retain_output: bool = True, on_pty: Callback | None = None,
                      new_only: bool = False) -> AsyncCommandHandle:
        """Follow a running command again (Commands.connect). A terminal's output goes to
        `on_pty` (bunshin's extra: envd's Process/Connect streams either kind of process)."""
        handle = await blocking(self._sync.connect, pid, timeout, request_timeout, retain_output=retain_output,
                                new_only=new_only)
        return follow(self._ws, handle, on_stdout, on_stderr, on_pty)


class AsyncPty:
    """ws.pty for asyncio (E2B's AsyncPty)."""

    def __init__(self, ws: Workspace, commands: AsyncCommands) -> None:
        self._ws = ws
        self._commands = commands

    async def create(self, size: PtySize, on_data: Callback, user: str | None = None, cwd: str | None = None,
                     envs: dict[str, str] | None = None, timeout: float | None = 60,
                     request_timeout: float | None = None) -> AsyncCommandHandle:
        handle = await blocking(self._ws.pty.create, size, user, cwd, envs, timeout, request_timeout)
        return follow(self._ws, handle, on_pty=on_data)

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        return await self._commands.kill(pid, request_timeout)

    async def send_stdin(self, pid: int, data: bytes, request_timeout: float | None = None) -> None:
        await self._commands.send_stdin(pid, data, request_timeout)

    def stream_input(self, pid: int, *, timeout: float | None = 60.0) -> AsyncCommandInputHandle:
        """An ordered input stream to the command (call it from the event loop)."""
        return self._commands.stream_input(pid, timeout=timeout)

    async def resize(self, pid: int, size: PtySize, request_timeout: float | None = None) -> None:
        await control_aio.send_input(self._ws.live_init_pid(), pid, "R", protocol.resize_data(size.rows, size.cols),
                                     request_timeout)

    async def connect(self, pid: int, on_data: Callback, timeout: float | None = 60,
                      request_timeout: float | None = None) -> AsyncCommandHandle:
        return follow(self._ws, self._ws.pty.connect(pid, timeout, request_timeout), on_pty=on_data)
