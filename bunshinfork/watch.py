"""files.watch_dir: file-system events of a workspace directory, watched from the host.

inotify watches the workspace's own overlay mount (reached through /proc/<init>/root), so it
sees every change the workspace's processes make, and nothing runs inside the workspace
for it. The watched directory is opened with openat2(RESOLVE_IN_ROOT) first and the watch is
put on that descriptor, so a symlink inside cannot point it at the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import inspect
import os
import posixpath
import struct
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from .entries import EntryInfo
from .errors import FileOperationError


class Tree(Protocol):
    """What a watch reads of a workspace's files: files.Files, which builds the watches."""

    def list(self, path: str, depth: int | None = 1, user: str | None = None,
             request_timeout: float | None = None) -> list[EntryInfo]: ...

    def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo: ...


_libc = ctypes.CDLL(None, use_errno=True)
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_IGNORED, IN_ISDIR, IN_Q_OVERFLOW = 0x400, 0x800, 0x8000, 0x40000000, 0x4000
MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
_EVENT = struct.Struct("iIII")


class FilesystemEventType(Enum):
    CHMOD = "chmod"
    CREATE = "create"
    REMOVE = "remove"
    RENAME = "rename"
    WRITE = "write"


@dataclass
class FilesystemEvent:
    """What happened to `name` (relative to the watched directory)."""

    name: str
    type: FilesystemEventType
    entry: EntryInfo | None = None


def _type(mask: int) -> FilesystemEventType | None:
    if mask & IN_CREATE or mask & IN_MOVED_TO:
        return FilesystemEventType.CREATE if mask & IN_CREATE else FilesystemEventType.RENAME
    if mask & IN_DELETE:
        return FilesystemEventType.REMOVE
    if mask & IN_MOVED_FROM:
        return FilesystemEventType.RENAME
    if mask & IN_MODIFY:
        return FilesystemEventType.WRITE
    if mask & IN_ATTRIB:
        return FilesystemEventType.CHMOD
    return None


class Inotify:
    """One inotify instance over a directory (and, recursive, its subdirectories)."""

    def __init__(self, files: Tree, path: str, dirfd: int, recursive: bool, include_entry: bool, *,
                 root: Callable[[], AbstractContextManager[int]]) -> None:
        self._files = files
        self._root = root  # opens the workspace's root (Files._root) for watches added inside it
        self._path = path
        self._recursive = recursive
        self._include_entry = include_entry
        self.fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            e = ctypes.get_errno()
            raise FileOperationError(e, f"inotify: {os.strerror(e)}", path)
        self._dirs: dict[int, str] = {}  # watch descriptor -> path relative to the watched dir
        self._add(f"/proc/self/fd/{dirfd}", "")
        if recursive:
            for e in files.list(path, depth=64, user="root"):
                if e.type == "dir" and e.symlink_target is None:  # as envd's walk: links unfollowed
                    with contextlib.suppress(OSError):
                        self._add_inside(e.path)

    def _add(self, host_path: str, rel: str) -> None:
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(host_path), MASK | (IN_DELETE_SELF | IN_MOVE_SELF))
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self._dirs[wd] = rel

    def _add_inside(self, path: str) -> None:
        from . import native

        with self._root() as root:
            fd = native.openat2(root, path, os.O_PATH | os.O_DIRECTORY)
            try:
                self._add(f"/proc/self/fd/{fd}", posixpath.relpath(path, self._path))
            finally:
                os.close(fd)

    def read(self) -> list[FilesystemEvent]:
        """The events queued now; never blocks."""
        out: list[FilesystemEvent] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                raise
            pos = 0
            while pos < len(buf):
                wd, mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                name = buf[pos + _EVENT.size:pos + _EVENT.size + length].rstrip(b"\0").decode(errors="replace")
                pos += _EVENT.size + length
                if mask & IN_IGNORED:
                    self._dirs.pop(wd, None)
                    continue
                base = self._dirs.get(wd)
                kind = _type(mask)
                if base is None or kind is None or not name:
                    continue
                rel = posixpath.join(base, name) if base else name
                out.append(self._event(rel, kind))
                if self._recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                    out += self._watch_new_dir(rel)

    def _event(self, rel: str, kind: FilesystemEventType) -> FilesystemEvent:
        entry = None
        if self._include_entry and kind is not FilesystemEventType.REMOVE:
            with contextlib.suppress(OSError):
                entry = self._files.get_info(posixpath.join(self._path, rel), user="root")
        return FilesystemEvent(rel, kind, entry)

    def _watch_new_dir(self, rel: str) -> list[FilesystemEvent]:
        """Watch a directory that just appeared, and report what was made in it before the
        watch was in place (mkdir -p a/b && touch a/b/f can all happen in between; a polled
        watcher adds the watch only at its next poll): CREATE for each entry, and WRITE for a
        file with content, which was written since (envd's watcher sees both)."""
        top = posixpath.join(self._path, rel)
        with contextlib.suppress(OSError):
            self._add_inside(top)
        out = []
        with contextlib.suppress(OSError):
            for e in self._files.list(top, depth=64, user="root"):
                sub = posixpath.relpath(e.path, self._path)
                if e.type == "dir" and e.symlink_target is None:
                    with contextlib.suppress(OSError):
                        self._add_inside(e.path)
                out.append(self._event(sub, FilesystemEventType.CREATE))
                if e.type == "file" and e.symlink_target is None and e.size > 0:
                    out.append(self._event(sub, FilesystemEventType.WRITE))
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WatchHandle:
    """A watched directory (E2B's WatchHandle): get_new_events() since the last call; stop()."""

    def __init__(self, watch: Inotify) -> None:
        self._watch = watch
        self._closed = False

    def get_new_events(self, request_timeout: float | None = None) -> list[FilesystemEvent]:
        if self._closed:
            raise FileOperationError(errno.EBADF, "the watcher is already stopped")
        return self._watch.read()

    def stop(self, request_timeout: float | None = None) -> None:
        self._closed = True
        self._watch.close()


EventCallback = Callable[[FilesystemEvent], None] | Callable[[FilesystemEvent], Awaitable[None]]
ExitCallback = Callable[[Exception | None], None] | Callable[[Exception | None], Awaitable[None]]


class AsyncWatchHandle:
    """E2B's AsyncWatchHandle: events go to on_event as they happen, from the event loop
    (the inotify descriptor is a reader of the loop: no thread); stop() ends it."""

    def __init__(self, watch: Inotify, on_event: EventCallback, on_exit: ExitCallback | None,
                 timeout: float | None) -> None:
        self._watch = watch
        self._on_event = on_event
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(watch.fd, self._ready)
        self._timer = self._loop.call_later(timeout, self._expire) if timeout else None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    def _call(self, fn: Callable[..., object], arg: object) -> None:
        result = fn(arg)
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _ready(self) -> None:
        try:
            events = self._watch.read()
        except OSError as e:
            self._finish(e)
            return
        for ev in events:
            self._call(self._on_event, ev)

    def _expire(self) -> None:
        self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._loop.remove_reader(self._watch.fd)
        if self._timer:
            self._timer.cancel()
        self._watch.close()
        if self._on_exit:
            self._call(self._on_exit, error)

    async def stop(self) -> None:
        self._finish(None)
