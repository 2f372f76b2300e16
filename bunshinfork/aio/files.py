"""ws.files for asyncio (E2B's AsyncFilesystem). Reads and writes are system calls on the
workspace's root with no asynchronous form, so they run on the pool; a directory watch is
an inotify descriptor read by the event loop."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from typing import Any, Literal

from ..commands import no_limit
from ..files import EntryInfo, FileStreamReader, WriteEntry, WriteInfo
from ..watch import AsyncWatchHandle, EventCallback, ExitCallback
from ..workspace import Workspace
from .pool import blocking


class AsyncFileStreamReader:
    """files.read(format="stream") for asyncio: `async with` and `async for` over chunks."""

    def __init__(self, reader: FileStreamReader) -> None:
        self._reader = reader

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        chunk = await blocking(next, self._reader, None)
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
    """ws.files for asyncio."""

    def __init__(self, ws: Workspace) -> None:
        self._sync = ws.files

    async def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text", user: str | None = None,
                   request_timeout: float | None = None, gzip: bool = False,
                   stream_idle_timeout: float | None = None) -> str | bytearray | AsyncFileStreamReader:
        out = await blocking(self._sync.read, path, format, user, request_timeout, gzip, stream_idle_timeout)
        return AsyncFileStreamReader(out) if isinstance(out, FileStreamReader) else out

    async def write(self, path: str, data: Any, user: str | None = None, request_timeout: float | None = None,
                    gzip: bool = False, use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None,
                    *, mode: int = 0o644) -> WriteInfo:
        return await blocking(self._sync.write, path, await _gather(data), user, request_timeout, gzip,
                              use_octet_stream, metadata, mode=mode)

    async def write_files(self, files: Sequence[Mapping[str, Any]], user: str | None = None,
                          request_timeout: float | None = None, gzip: bool = False,
                          use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None,
                          *, mode: int = 0o644) -> list[WriteInfo]:
        entries: list[WriteEntry] = [{"path": f["path"], "data": await _gather(f["data"])} for f in files]
        return await blocking(self._sync.write_files, entries, user, request_timeout, gzip, use_octet_stream,
                              metadata, mode=mode)

    async def list(self, path: str, depth: int | None = 1, user: str | None = None,
                   request_timeout: float | None = None) -> list[EntryInfo]:
        return await blocking(self._sync.list, path, depth, user, request_timeout)

    async def exists(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        return await blocking(self._sync.exists, path, user, request_timeout)

    async def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo:
        return await blocking(self._sync.get_info, path, user, request_timeout)

    async def remove(self, path: str, user: str | None = None, request_timeout: float | None = None) -> None:
        await blocking(self._sync.remove, path, user, request_timeout)

    async def rename(self, old_path: str, new_path: str, user: str | None = None,
                     request_timeout: float | None = None) -> EntryInfo:
        return await blocking(self._sync.rename, old_path, new_path, user, request_timeout)

    async def make_dir(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        return await blocking(self._sync.make_dir, path, user, request_timeout)

    async def watch_dir(self, path: str, on_event: EventCallback, on_exit: ExitCallback | None = None,
                        user: str | None = None, request_timeout: float | None = None, timeout: float | None = 60,
                        recursive: bool = False, include_entry: bool = False,
                        allow_network_mounts: bool = False) -> AsyncWatchHandle:
        """Watch a directory: on_event gets each event from the event loop until stop() (or
        `timeout` seconds, 0 for no limit), then on_exit."""
        watch = await blocking(self._sync.open_watch, path, user, recursive=recursive, include_entry=include_entry)
        return AsyncWatchHandle(watch, on_event, on_exit, None if no_limit(timeout) else timeout)
