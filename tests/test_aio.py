"""AsyncWorkspace and AsyncSandbox: the same surface, asyncio-native.

Commands must not take a thread per call: while they run, the default executor and
asyncio.to_thread are made to fail, so a command that used one would fail here."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from bunshinfork import (
    AsyncSandbox,
    AsyncSnapshot,
    AsyncWorkspace,
    CommandExitException,
    CommandResult,
    FilesystemEventType,
    PtySize,
    Snapshot,
)
from bunshinfork.aio import AsyncCommandHandle
from bunshinfork.errors import CommandTimeout

T = TypeVar("T")


def run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(coro_fn())  # type: ignore[arg-type]


@contextlib.contextmanager
def no_threads() -> Iterator[None]:
    """Fail any use of an executor thread in the block (asyncio.to_thread goes through it)."""
    loop = asyncio.get_running_loop()
    original = loop.run_in_executor

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an executor thread was used where an asyncio primitive serves")

    loop.run_in_executor = refuse  # type: ignore[method-assign]
    # Threads started in the block, by identity: a thread an earlier test left behind may end
    # meanwhile (a count then falls, and says nothing of this block).
    before = {t.ident for t in threading.enumerate()}
    try:
        yield
    finally:
        loop.run_in_executor = original  # type: ignore[method-assign]
    started = [t.name for t in threading.enumerate() if t.ident not in before]
    assert started == [], f"threads started where asyncio primitives serve: {started}"


@contextlib.asynccontextmanager
async def workspace() -> AsyncIterator[AsyncWorkspace]:
    ws = await AsyncWorkspace.create()
    try:
        yield ws
    finally:
        await ws.destroy()


def test_commands_are_asyncio_native() -> None:
    async def main() -> None:
        async with workspace() as ws:
            out: list[str] = []

            async def on_stdout(text: str) -> None:  # a coroutine callback
                out.append(text)

            with no_threads():
                r = await ws.commands.run("echo one; echo two >&2; exit 3", on_stdout=on_stdout)
                assert isinstance(r, CommandResult) and (r.stdout, r.stderr, r.exit_code) == ("one\n", "two\n", 3)
                assert out == ["one\n"]
                h = await ws.commands.run("read a; echo got $a; sleep 0.3", background=True, stdin=True)
                assert isinstance(h, AsyncCommandHandle)
                await h.send_stdin("x\n")
                r = await h.wait()  # the pidfd, read by the event loop
                assert r.stdout == "got x\n"
                long = await ws.commands.run("sleep 100", background=True)
                assert await ws.commands.kill(long.pid) is True
                assert (await long.wait()).error == "signal: killed"
                with pytest.raises(CommandTimeout):
                    await ws.commands.run("sleep 30", timeout=0.3)
                assert (await ws.commands.run("sleep 0.5; echo unlimited", timeout=0)).stdout == "unlimited\n"

    run(main)


def test_concurrent_commands_overlap() -> None:
    async def main() -> None:
        async with workspace() as ws:
            t0 = time.monotonic()
            results = await asyncio.gather(*(ws.commands.run(f"sleep 1; echo {i}") for i in range(6)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
            assert time.monotonic() - t0 < 4  # six 1 s commands at once, not one after the other

    run(main)


def test_background_callbacks_and_input_stream() -> None:
    async def main() -> None:
        async with workspace() as ws:
            seen: list[str] = []
            h = await ws.commands.run("cat", background=True, stdin=True, on_stdout=seen.append)
            stream = ws.commands.stream_input(h.pid)
            for word in ("a\n", "b\n", "c\n"):
                await stream.send(word)
            await stream.close()
            await h.close_stdin()
            r = await h.wait()
            assert r.stdout == "a\nb\nc\n" and "".join(seen) == "a\nb\nc\n"

    run(main)


def test_async_sandbox_semantics() -> None:
    async def main() -> None:
        sbx = await AsyncSandbox.create(timeout=120, envs={"K": "v"})
        try:
            r = await sbx.commands.run('id -un; echo "$K $PWD"')
            assert r.stdout == "user\nv /home/user\n"
            with pytest.raises(CommandExitException):
                await sbx.commands.run("exit 9")
            h = await sbx.commands.run("exit 4", background=True)
            with pytest.raises(CommandExitException):
                await h.wait()
            info = await AsyncSandbox.get_info(sbx.sandbox_id)  # by id, on the class
            assert info.sandbox_id == sbx.sandbox_id
            await sbx.set_timeout(30)
            assert (await sbx.get_info()).end_at.timestamp() - time.time() == pytest.approx(30, abs=3)
            assert await sbx.pause() is True
            await AsyncSandbox.connect(sbx.sandbox_id)
            assert (await sbx.get_info()).state == "running"
        finally:
            assert await sbx.kill() is True
        assert await AsyncSandbox.kill(sbx.sandbox_id) is False

    run(main)


def test_async_files_and_watch() -> None:
    async def main() -> None:
        sbx = await AsyncSandbox.create()
        try:
            events: list[Any] = []
            exited: list[Any] = []
            handle = await sbx.files.watch_dir("/home/user", on_event=events.append, on_exit=exited.append)

            async def chunks() -> AsyncIterator[bytes]:
                for part in (b"ab", b"cd"):
                    yield part

            await sbx.files.write("f.bin", chunks())
            assert await sbx.files.read("f.bin", format="bytes") == bytearray(b"abcd")
            assert (await sbx.files.get_info("f.bin")).owner == "user"
            for _ in range(100):
                if any(e.name == "f.bin" and e.type == FilesystemEventType.CREATE for e in events):
                    break
                await asyncio.sleep(0.05)
            assert any(e.name == "f.bin" and e.type == FilesystemEventType.CREATE for e in events)
            await handle.stop()
            assert exited == [None]
        finally:
            await sbx.kill()

    run(main)


def test_async_pty_and_fork() -> None:
    async def main() -> None:
        sbx = await AsyncSandbox.create()
        try:
            data = bytearray()
            term = await sbx.pty.create(PtySize(24, 80), on_data=data.extend)
            await sbx.pty.send_stdin(term.pid, b"echo $((3*4)); exit\n")
            await term.wait()
            assert b"12" in data
            await sbx.files.write("mark", "before")
            forks = await sbx.fork(count=2)
            try:
                for f in forks:
                    assert isinstance(f, AsyncSandbox)
                    assert await f.files.read("mark") == "before"
            finally:
                for f in forks:
                    if isinstance(f, AsyncSandbox):
                        await f.kill()
        finally:
            await sbx.kill()

    run(main)


def test_async_snapshot_has_all_of_snapshots_surface() -> None:
    public = {n for n in dir(Snapshot) if not n.startswith("_")}
    missing = {n for n in public if not hasattr(AsyncSnapshot, n)}
    assert not missing, missing
    for name in public:
        ours, theirs = inspect.getattr_static(AsyncSnapshot, name), inspect.getattr_static(Snapshot, name)
        assert isinstance(ours, property) == isinstance(theirs, property), name
        assert isinstance(ours, classmethod) == isinstance(theirs, classmethod), name


def test_async_snapshot_round_trip(tmp_path: Any) -> None:
    async def main() -> None:
        async with workspace() as ws:
            await ws.files.write("/root/mark", "kept")
            async with await ws.snapshot("copy") as snap:
                assert snap.source_id == ws.id and snap.kind == "image" and snap.memory == "copy"
                assert await snap.image_bytes() > 0 and await snap.retained_bytes() > 0
                assert (await snap.host_memory()).stores >= 0
                saved = await snap.save(tmp_path / "saved")
            loaded = await AsyncSnapshot.load(saved)
            try:
                (clone,) = await loaded.fork(1)
                assert isinstance(clone, AsyncWorkspace)
                try:
                    assert await clone.files.read("/root/mark") == "kept"
                finally:
                    await clone.destroy()
            finally:
                await loaded.release()

    run(main)
