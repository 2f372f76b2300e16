"""ws.files: read, write, list, exists, remove, make_dir inside a workspace.

Every path is resolved with openat2(RESOLVE_IN_ROOT) against the workspace's root, so
absolute symlinks and ".." planted inside the workspace can never reach the host.
Works on a paused workspace too: nothing runs inside it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from . import native
from .errors import FileOperationError, WorkspaceFileNotFound

HOME = "/root"


@dataclass(frozen=True)
class EntryInfo:
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


def _kind(mode: int) -> Literal["file", "dir", "symlink", "other"]:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _error(e: OSError, what: str, path: str) -> FileOperationError:
    cls = WorkspaceFileNotFound if e.errno == errno.ENOENT else FileOperationError
    return cls(e.errno, f"{what} {path} in workspace: {os.strerror(e.errno or 0)}", path)


class Files:
    """ws.files, resolved against the root of the workspace whose live init `init_pid()` names."""

    def __init__(self, init_pid: Callable[[], int]) -> None:
        self._init_pid = init_pid

    def _abs(self, path: str) -> str:
        if not isinstance(path, str) or not path:
            raise FileOperationError(errno.EINVAL, f"a path must be a non-empty string, got {path!r}")
        if "\0" in path:
            # C would see the path cut at the NUL: another file than the one named.
            raise FileOperationError(errno.EINVAL, f"path {path!r} contains a NUL byte", path)
        return posixpath.normpath(posixpath.join(HOME, path))

    @contextlib.contextmanager
    def _root(self) -> Iterator[int]:
        pid = self._init_pid()
        fd = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _open(self, root: int, path: str, flags: int, mode: int = 0o644) -> Iterator[int]:
        fd = native.openat2(root, path, flags, mode)
        try:
            yield fd
        finally:
            os.close(fd)

    def read(self, path: str, format: Literal["text", "bytes"] = "text") -> str | bytes:
        """A regular file's content. Devices, fifos and sockets are refused: /dev/zero would
        never end, and a fifo would wait for a writer that may never come."""
        p = self._abs(path)
        try:
            with self._root() as root, self._open(root, p, os.O_RDONLY | os.O_NONBLOCK) as fd:
                mode = os.fstat(fd).st_mode
                if stat.S_ISDIR(mode):
                    raise FileOperationError(errno.EISDIR, f"read {p} in workspace: is a directory", p)
                if not stat.S_ISREG(mode):
                    raise FileOperationError(errno.EINVAL, f"read {p} in workspace: not a regular file", p)
                os.set_blocking(fd, True)
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
        except FileOperationError:
            raise
        except OSError as e:
            raise _error(e, "read", p) from e
        data = b"".join(chunks)
        return data if format == "bytes" else data.decode()

    def _make_dirs(self, root: int, path: str) -> None:
        parts = [c for c in path.split("/") if c]
        for i in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:i])
            try:
                os.close(native.openat2(root, prefix, os.O_PATH | os.O_DIRECTORY))
                continue
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            with self._open(root, posixpath.dirname(prefix), os.O_PATH | os.O_DIRECTORY) as parent, \
                    contextlib.suppress(FileExistsError):
                os.mkdir(parts[i - 1], 0o755, dir_fd=parent)

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> EntryInfo:
        """Write a whole file, creating missing parent directories."""
        p = self._abs(path)
        raw = data.encode() if isinstance(data, str) else bytes(data)
        try:
            with self._root() as root:
                self._make_dirs(root, posixpath.dirname(p))
                # O_NONBLOCK: a fifo without a reader is an error (ENXIO), not a wait.
                with self._open(root, p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode) as fd:
                    os.set_blocking(fd, True)
                    view = memoryview(raw)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    st = os.fstat(fd)
        except OSError as e:
            raise _error(e, "write", p) from e
        return EntryInfo(posixpath.basename(p), p, "file", st.st_size, st.st_mode, st.st_mtime)

    def make_dir(self, path: str) -> bool:
        """Create a directory and its parents; False if it already existed."""
        p = self._abs(path)
        existed = self.exists(p)
        try:
            with self._root() as root:
                self._make_dirs(root, p)
        except OSError as e:
            raise _error(e, "make_dir", p) from e
        return not existed

    def list(self, path: str = HOME) -> list[EntryInfo]:
        p = self._abs(path)
        try:
            with self._root() as root, self._open(root, p, os.O_RDONLY | os.O_DIRECTORY) as fd:
                out = []
                for name in sorted(os.listdir(fd)):
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    out.append(EntryInfo(name, posixpath.join(p, name), _kind(st.st_mode), st.st_size,
                                         st.st_mode, st.st_mtime))
                return out
        except OSError as e:
            raise _error(e, "list", p) from e

    def exists(self, path: str) -> bool:
        p = self._abs(path)
        try:
            with self._root() as root, self._open(root, p, os.O_PATH):
                return True
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise _error(e, "stat", p) from e

    def remove(self, path: str) -> None:
        """Remove a file, a symlink, or a directory with everything in it."""
        p = self._abs(path)
        if p == "/":
            raise FileOperationError(errno.EINVAL, "refusing to remove the workspace's root", p)
        try:
            with self._root() as root, self._open(
                root, posixpath.dirname(p), os.O_RDONLY | os.O_DIRECTORY
            ) as parent:
                name = posixpath.basename(p)
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
        except OSError as e:
            raise _error(e, "remove", p) from e
