"""ws.files: E2B's file-system module (read, write, list, stat, rename, remove, make_dir,
watch_dir) inside a workspace.

Every path is resolved with openat2(RESOLVE_IN_ROOT) against the workspace's root (inroot),
so absolute symlinks and ".." planted inside the workspace can never reach the host. Relative
paths start in the user's home. An operation runs with the credentials the user has inside
(users.as_sandbox: its ids, and for root only root's file capabilities, never the server's
others): the kernel checks its permissions, new files belong to it, and /proc and /sys show
what the workspace sees (kallsyms zeroed). Reads and writes open regular files only: opening
a device or a FIFO is an act of its own. Works on a paused workspace too: nothing runs inside it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import posixpath
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Literal, TypedDict

from . import idmap, inroot, users
from .entries import EntryInfo, FileType, WriteInfo
from .errors import FileOperationError, InvalidArgumentException, WorkspaceFileNotFound
from .watch import Inotify, WatchHandle

HOME = "/root"
MAX_SYMLINKS = 40  # the kernel's own limit, for the dangling symlinks a write follows by hand
CHUNK = 1 << 20
METADATA_PREFIX = "user.e2b."  # E2B keeps file metadata in these extended attributes


class WriteEntry(TypedDict):
    path: str
    data: str | bytes | IO | Iterable[bytes]


WriteData = str | bytes | IO | Iterable[bytes]


def _kind(mode: int) -> FileType | None:
    if stat.S_ISREG(mode):
        return FileType.FILE
    if stat.S_ISDIR(mode):
        return FileType.DIR
    if stat.S_ISLNK(mode):
        return FileType.SYMLINK
    return None


def go_filemode(mode: int) -> str:
    """What envd reports as `permissions`: Go's os.FileMode(...).String() of the lstat (type and
    setuid/setgid/sticky as letters before rwx: -rw-r--r--, drwxr-xr-x, Lrwxrwxrwx, Dcrw-rw-rw-)."""
    fmt = stat.S_IFMT(mode)
    flags = {"d": fmt == stat.S_IFDIR, "L": fmt == stat.S_IFLNK, "D": fmt in (stat.S_IFBLK, stat.S_IFCHR),
             "p": fmt == stat.S_IFIFO, "S": fmt == stat.S_IFSOCK, "u": bool(mode & stat.S_ISUID),
             "g": bool(mode & stat.S_ISGID), "c": fmt == stat.S_IFCHR, "t": bool(mode & stat.S_ISVTX)}
    kind = "".join(letter for letter, on in flags.items() if on) or "-"
    return kind + "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))


def _error(e: OSError, what: str, path: str) -> FileOperationError:
    cls = WorkspaceFileNotFound if e.errno == errno.ENOENT else FileOperationError
    return cls(e.errno, f"{what} {path} in workspace: {os.strerror(e.errno or 0)}", path)


def _chunks(data: WriteData) -> Iterator[bytes]:
    """The bytes of anything E2B's write accepts, in pieces: file objects and iterables stream."""
    if isinstance(data, str):
        yield data.encode()
    elif isinstance(data, (bytes, bytearray, memoryview)):
        yield bytes(data)
    elif hasattr(data, "read"):
        while chunk := data.read(CHUNK):  # type: ignore[union-attr]
            yield chunk.encode() if isinstance(chunk, str) else bytes(chunk)
    else:
        for chunk in data:
            if not isinstance(chunk, (bytes, bytearray, memoryview)):
                raise InvalidArgumentException(f"an iterable written to a file must yield bytes, got {type(chunk)}")
            yield bytes(chunk)


def _metadata(where: str | int) -> dict[str, str] | None:
    """E2B's user.e2b.* attributes of the file at `where` (a /proc/self/fd/... path, or an open fd)."""
    try:
        if isinstance(where, int):
            names = [n for n in os.listxattr(where) if n.startswith(METADATA_PREFIX)]
            out = {n[len(METADATA_PREFIX):]: os.getxattr(where, n).decode() for n in names}
        else:
            names = [n for n in os.listxattr(where, follow_symlinks=False) if n.startswith(METADATA_PREFIX)]
            out = {n[len(METADATA_PREFIX):]: os.getxattr(where, n, follow_symlinks=False).decode() for n in names}
    except OSError:
        return None
    return out or None


class FileStreamReader(Iterator[bytes]):
    """A file read in chunks (files.read(format="stream")); close it, or read it to the end."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        if self._fd is None:
            raise StopIteration
        chunk = os.read(self._fd, CHUNK)
        if not chunk:
            self.close()
            raise StopIteration
        return chunk

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read_at(self, offset: int, size: int) -> bytes:
        """Up to `size` bytes from `offset` (the stream's own position unmoved)."""
        return b"" if self._fd is None else os.pread(self._fd, size, offset)

    def __enter__(self) -> FileStreamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Files:
    """ws.files, resolved against the root of the workspace whose live init `init_pid()` names;
    operations without a `user` run as `default_user` (None: root)."""

    def __init__(self, init_pid: Callable[[], int], default_user: str | None = None) -> None:
        self._init_pid = init_pid
        self._default_user = default_user
        self._idmap: tuple[int, idmap.IdMap] = (0, idmap.IDENTITY)  # (init pid, its namespace's map)
        self._caps: tuple[int, int] = (0, 0)  # (init pid, root's capabilities inside)
        self.accounts = users.Accounts(self._stamp, self._read_as_root)

    # ---- users and paths ----

    def _user(self, user: str | None) -> users.User:
        return self.accounts.resolve(user or self._default_user or "root")

    def _abs(self, path: str, who: users.User | None = None) -> str:
        if not isinstance(path, str) or not path:
            raise FileOperationError(errno.EINVAL, f"a path must be a non-empty string, got {path!r}")
        if "\0" in path:
            # C would see the path cut at the NUL: another file than the one named.
            raise FileOperationError(errno.EINVAL, f"path {path!r} contains a NUL byte", path)
        return posixpath.normpath(posixpath.join(who.home if who else HOME, path))

    def _ids(self, pid: int) -> idmap.IdMap:
        """The id map of the workspace whose init is `pid` (userns=True: ids inside are the
        host's shifted), read once per init."""
        if self._idmap[0] != pid:
            self._idmap = (pid, idmap.of(pid))
        return self._idmap[1]

    def _root_caps(self, pid: int) -> int:
        """Root's capabilities inside the workspace whose init is `pid`, read once per init."""
        if self._caps[0] != pid:
            self._caps = (pid, users.init_caps(pid))
        return self._caps[1]

    @property
    def _map(self) -> idmap.IdMap:
        """The map _root read: every operation that describes or makes a file is inside one,
        so an entry of a listing costs no lookup of the init."""
        return self._idmap[1]

    @contextlib.contextmanager
    def _root(self, who: users.User = users.ROOT) -> Iterator[int]:
        # The host's credentials find the workspace and open its root: a user's would not be let
        # in (a root's block nested in a user's, the accounts' read, comes here as the user).
        with users.as_host():
            pid = self._init_pid()
            ids = self._ids(pid)
            caps = self._root_caps(pid)
            fd = inroot.open_root(pid)
        try:
            # The block runs as the user does inside: in a user namespace with the host's
            # shifted ids, and root with root's capabilities inside only.
            with users.as_sandbox(users.credentials(who, ids.to_host, caps)):
                yield fd
        finally:
            os.close(fd)

    def _own(self, fd: int) -> None:
        """A file made in a userns workspace by an id it does not map belongs to the namespace's
        root, as if root inside had made it (a host id shows inside as nobody). Only for files
        this process made: an existing one may be the host's own. (as_sandbox makes them with
        the shifted ids already: this is the guard, not the rule.)"""
        ids = self._map
        if ids.shifted and not ids.maps_host(os.fstat(fd).st_uid):
            os.fchown(fd, ids.to_host(0), ids.to_host(0))

    @contextlib.contextmanager
    def _open(self, root: int, path: str, flags: int, mode: int = 0o644) -> Iterator[int]:
        fd = inroot.named(root, path, flags, mode)
        try:
            yield fd
        finally:
            os.close(fd)

    def _entry(self, dirfd: int, name: str, path: str, root: int | None = None) -> EntryInfo:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        target = os.readlink(name, dir_fd=dirfd) if stat.S_ISLNK(st.st_mode) else None
        info = self._describe(st, name, path, target, f"/proc/self/fd/{dirfd}/{name}")
        if target is not None and root is not None:
            self._follow(root, path, info)
        return info

    def _follow(self, root: int, path: str, info: EntryInfo) -> None:
        """envd's view of a symlink (e2b-dev/infra packages/shared/pkg/filesystem/entry.go): the
        type and mode of what it resolves to, resolved inside the workspace's root, and that
        absolute path as its target; a dangling one has no type, mode 0 and its own path as
        target (Go's EvalSymlinks failing). permissions stay the link's own (Lrwxrwxrwx)."""
        try:
            fd = inroot.named(root, path, os.O_PATH)
        except OSError:
            info.type, info.mode, info.symlink_target = None, 0, path
            return
        try:
            st = os.fstat(fd)
            found, top = os.readlink(f"/proc/self/fd/{fd}"), os.readlink(f"/proc/self/fd/{root}")
        finally:
            os.close(fd)
        info.type, info.mode = _kind(st.st_mode), stat.S_IMODE(st.st_mode)
        if top == "/":
            info.symlink_target = found
        elif found == top or found.startswith(top + "/"):
            info.symlink_target = found[len(top):] or "/"
        else:  # not under the root's name as this process sees it: the link's text, made absolute
            info.symlink_target = posixpath.normpath(posixpath.join(posixpath.dirname(path), info.symlink_target or ""))

    def _describe(self, st: os.stat_result, name: str, path: str, target: str | None,
                  xattrs: str | int) -> EntryInfo:
        owners, groups = self.accounts.names()
        ids = self._map
        uid, gid = ids.from_host(st.st_uid), ids.from_host(st.st_gid)
        return EntryInfo(
            name=name, type=_kind(st.st_mode), path=path, size=st.st_size, mode=stat.S_IMODE(st.st_mode),
            permissions=go_filemode(st.st_mode), owner=owners.get(uid, str(uid)),
            group=groups.get(gid, str(gid)),
            modified_time=datetime.datetime.fromtimestamp(st.st_mtime, datetime.UTC),
            symlink_target=target, metadata=_metadata(xattrs),
        )

    def _info_at(self, root: int, p: str) -> EntryInfo:
        # The root has no parent inside the workspace to stat it from: "." of itself stands in.
        parent, name = (p, ".") if p == "/" else (posixpath.dirname(p), posixpath.basename(p))
        with self._open(root, parent, os.O_PATH | os.O_DIRECTORY) as fd:
            info = self._entry(fd, name, p, root)
        if p == "/":
            info.name = "/"
        return info

    def _stamp(self, paths: Sequence[str]) -> tuple[tuple[int, int, int] | None, ...]:
        """What changes when any of these files changes (inode, mtime, size), read as root."""
        out: list[tuple[int, int, int] | None] = []
        with self._root() as root:
            for p in paths:
                try:
                    with self._open(root, p, os.O_PATH) as fd:
                        st = os.fstat(fd)
                    out.append((st.st_ino, st.st_mtime_ns, st.st_size))
                except OSError:
                    out.append(None)
        return tuple(out)

    def _read_as_root(self, paths: Sequence[str]) -> list[str]:
        """The texts of these files ("" for a missing one), whatever the default user is."""
        out = []
        for p in paths:
            try:
                out.append(str(self.read(p, user="root")))
            except WorkspaceFileNotFound:
                out.append("")
        return out

    # ---- reading ----

    def read(self, path: str, format: Literal["text", "bytes", "stream"] = "text", user: str | None = None,
             request_timeout: float | None = None, gzip: bool = False,
             stream_idle_timeout: float | None = None) -> str | bytearray | FileStreamReader:
        """The file's content: a str, a bytearray, or (format="stream") an iterator of chunks.

        request_timeout, gzip and stream_idle_timeout are E2B's transport options: a local read
        has no transport, and they are accepted and ignored.
        """
        if format not in ("text", "bytes", "stream"):
            raise InvalidArgumentException(f"format must be 'text', 'bytes' or 'stream', not {format!r}")
        who = self._user(user)
        p = self._abs(path, who)
        try:
            with self._root(who) as root:
                # Devices, fifos and sockets are refused: /dev/zero would never end, and a fifo
                # would wait for a writer that may never come.
                fd = self._open_regular(root, p, os.O_RDONLY, "read")
                if format == "stream":
                    return FileStreamReader(fd)
                try:
                    data = bytearray()
                    while chunk := os.read(fd, CHUNK):
                        data += chunk
                finally:
                    os.close(fd)
        except FileOperationError:
            raise
        except OSError as e:
            raise _error(e, "read", p) from e
        return data if format == "bytes" else data.decode()

    def _open_regular(self, root: int, p: str, flags: int, what: str) -> int:
        """`p` opened with `flags` if it is a regular file (symlinks followed inside the root). A
        FIFO, a device or a socket is refused before anything opens it: the path is found as an
        O_PATH fd, checked, and that very inode reopened through /proc/self/fd, so nothing put
        there meanwhile is opened instead."""
        with self._open(root, p, os.O_PATH) as found:
            mode = os.fstat(found).st_mode
            if stat.S_ISDIR(mode):
                raise FileOperationError(errno.EISDIR, f"{what} {p} in workspace: is a directory", p)
            if not stat.S_ISREG(mode):
                raise FileOperationError(errno.EINVAL, f"{what} {p} in workspace: not a regular file", p)
            return os.open(f"/proc/self/fd/{found}", flags | os.O_CLOEXEC | os.O_NOCTTY)

    def _link_target(self, root: int, p: str) -> str:
        """Where the symlink `p` points, as a path a following openat2 resolves as the kernel would
        (a relative target from the link's own directory, unnormalised)."""
        with self._open(root, posixpath.dirname(p), os.O_PATH | os.O_DIRECTORY) as parent:
            link = os.readlink(posixpath.basename(p), dir_fd=parent)
        return link if link.startswith("/") else posixpath.join(posixpath.dirname(p), link)

    # ---- writing ----

    def _make_dirs(self, root: int, path: str) -> None:
        parts = [c for c in path.split("/") if c]
        for i in range(1, len(parts) + 1):
            prefix = "/" + "/".join(parts[:i])
            try:
                os.close(inroot.named(root, prefix, os.O_PATH | os.O_DIRECTORY))
                continue
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            with self._open(root, posixpath.dirname(prefix), os.O_PATH | os.O_DIRECTORY) as parent:
                try:
                    os.mkdir(parts[i - 1], 0o755, dir_fd=parent)
                except FileExistsError:
                    continue
            # NOFOLLOW: what a workspace process may have put there since is not ours to give.
            with self._open(root, prefix, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW) as made:
                self._own(made)

    def _create_regular(self, root: int, p: str, mode: int) -> int:
        """The regular file at `p` opened for writing and truncated, made if missing; only a file
        this call made is given to the namespace's root (_own): an existing one keeps its owner.
        Anything but a regular file is refused unopened (_open_regular). A dangling symlink's
        target is made, as a plain open would, by following the link here: an O_CREAT without
        O_EXCL would open whatever a workspace process put there meanwhile, a FIFO included."""
        target = p
        for _ in range(MAX_SYMLINKS):
            try:
                fd = inroot.named(root, target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOCTTY, mode)
            except FileExistsError:
                try:
                    return self._open_regular(root, target, os.O_WRONLY | os.O_TRUNC, "write")
                except FileNotFoundError:
                    target = self._link_target(root, target)  # dangling: make what it names
                    continue
            try:
                self._own(fd)
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise FileOperationError(errno.ELOOP, f"write {p} in workspace: too many levels of symbolic links", p)

    @contextlib.contextmanager
    def _create_or_truncate(self, root: int, p: str, mode: int) -> Iterator[int]:
        fd = self._create_regular(root, p, mode)
        try:
            yield fd
        finally:
            os.close(fd)

    def _write_one(self, root: int, p: str, data: WriteData, mode: int, metadata: dict[str, str] | None) -> EntryInfo:
        self._make_dirs(root, posixpath.dirname(p))
        with self._create_or_truncate(root, p, mode) as fd:
            # envd chowns each upload to its user between the create and the write, and watchers
            # see CREATE, CHMOD, WRITE (e2b-dev/infra packages/envd/internal/api/upload.go): the
            # same owner again, which an owner may always set, is that chown here.
            with contextlib.suppress(OSError):
                os.fchown(fd, os.fstat(fd).st_uid, -1)
            for chunk in _chunks(data):
                view = memoryview(chunk)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            # An upload replaces the file's metadata (envd: what the last upload sent, nothing
            # of an earlier one's); a rename keeps it, as the xattrs move with the inode.
            for name in os.listxattr(fd):
                if name.startswith(METADATA_PREFIX):
                    os.removexattr(fd, name)
            for key, value in (metadata or {}).items():
                os.setxattr(fd, METADATA_PREFIX + key.lower(), value.encode())
            # Described from the fd written, not by path: a workspace process may consume the file
            # (read and unlink it) the moment it appears, and the write still happened.
            return self._describe(os.fstat(fd), posixpath.basename(p), p, None, fd)

    def write(self, path: str, data: WriteData, user: str | None = None, request_timeout: float | None = None,
              gzip: bool = False, use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None,
              *, mode: int = 0o644) -> WriteInfo:
        """Write a whole file (str, bytes, a file object or an iterable of bytes, streamed),
        creating missing parent directories. Returns its EntryInfo (a WriteInfo).

        request_timeout, gzip and use_octet_stream choose E2B's upload encoding; nothing is
        uploaded here, and they are accepted and ignored.
        """
        return self.write_files([{"path": path, "data": data}], user, request_timeout, gzip, use_octet_stream,
                                metadata, mode=mode)[0]

    def write_files(self, files: Sequence[WriteEntry], user: str | None = None, request_timeout: float | None = None,
                    gzip: bool = False, use_octet_stream: bool | None = None,
                    metadata: dict[str, str] | None = None, *, mode: int = 0o644) -> list[WriteInfo]:
        """Write several files (each a {"path", "data"} entry), as write() does."""
        _check_metadata(metadata)
        who = self._user(user)
        out: list[WriteInfo] = []
        with self._root(who) as root:
            for entry in files:
                p = self._abs(entry["path"], who)
                try:
                    out.append(self._write_one(root, p, entry["data"], mode, metadata))
                except FileOperationError:
                    raise
                except OSError as e:
                    raise _error(e, "write", p) from e
        return out

    def make_dir(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        """Create a directory and its parents; False if it already existed."""
        who = self._user(user)
        p = self._abs(path, who)
        existed = self.exists(p, user)
        try:
            with self._root(who) as root:
                self._make_dirs(root, p)
        except OSError as e:
            raise _error(e, "make_dir", p) from e
        return not existed

    def chown(self, path: str, owner: str) -> None:
        """Give a file or directory to user `owner` and its primary group, as root's `chown` inside
        would: the path resolves in the workspace's root (a symlink to /tmp is the workspace's
        /tmp, never the host's), and the inode found is the one changed."""
        who = self._user(owner)
        p = self._abs(path)
        try:
            with self._root() as root, self._open(root, p, os.O_PATH) as fd:
                ids = self._map
                # An O_PATH fd cannot be fchown'd; its /proc/self/fd link names that inode only.
                os.chown(f"/proc/self/fd/{fd}", ids.to_host(who.uid), ids.to_host(who.gid))
        except OSError as e:
            raise _error(e, "chown", p) from e

    # ---- listing and stat ----

    def list(self, path: str, depth: int | None = 1, user: str | None = None,
             request_timeout: float | None = None) -> list[EntryInfo]:
        """The entries of a directory, and with depth > 1 those of its subdirectories."""
        if depth is not None and depth < 1:
            raise InvalidArgumentException("depth should be at least 1")
        who = self._user(user)
        p = self._abs(path, who)
        out: list[EntryInfo] = []
        try:
            with self._root(who) as root:
                self._list_into(root, p, depth or 1, out)
        except OSError as e:
            raise _error(e, "list", p) from e
        return out

    def _list_into(self, root: int, p: str, depth: int, out: list[EntryInfo]) -> None:
        with self._open(root, p, os.O_RDONLY | os.O_DIRECTORY) as fd:
            entries = [self._entry(fd, name, posixpath.join(p, name), root) for name in sorted(os.listdir(fd))]
        for e in entries:
            out.append(e)
            if depth > 1 and e.type == FileType.DIR and e.symlink_target is None:  # envd's walk follows none
                self._list_into(root, e.path, depth - 1, out)

    def exists(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        who = self._user(user)
        p = self._abs(path, who)
        try:
            with self._root(who) as root, self._open(root, p, os.O_PATH):
                return True
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return False
            raise _error(e, "stat", p) from e

    def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo:
        """Name, type, size, mode, owner and modification time of a file or directory."""
        who = self._user(user)
        p = self._abs(path, who)
        try:
            with self._root(who) as root:
                return self._info_at(root, p)
        except OSError as e:
            raise _error(e, "stat", p) from e

    # ---- changing ----

    def rename(self, old_path: str, new_path: str, user: str | None = None,
               request_timeout: float | None = None) -> EntryInfo:
        """Rename (move) a file or directory; returns the entry at its new path."""
        who = self._user(user)
        old, new = self._abs(old_path, who), self._abs(new_path, who)
        try:
            with self._root(who) as root, \
                    self._open(root, posixpath.dirname(old), os.O_PATH | os.O_DIRECTORY) as src, \
                    self._open(root, posixpath.dirname(new), os.O_PATH | os.O_DIRECTORY) as dst:
                os.rename(posixpath.basename(old), posixpath.basename(new), src_dir_fd=src, dst_dir_fd=dst)
                return self._entry(dst, posixpath.basename(new), new, root)
        except OSError as e:
            raise _error(e, "rename", old) from e

    def remove(self, path: str, user: str | None = None, request_timeout: float | None = None) -> None:
        """Remove a file, a symlink, or a directory with everything in it; a path that is not
        there is no error (envd's Remove is Go's os.RemoveAll: e2b-dev/infra
        packages/envd/internal/services/filesystem/remove.go)."""
        who = self._user(user)
        p = self._abs(path, who)
        if p == "/":
            raise FileOperationError(errno.EINVAL, "refusing to remove the workspace's root", p)
        try:
            with self._root(who) as root, self._open(
                root, posixpath.dirname(p), os.O_RDONLY | os.O_DIRECTORY
            ) as parent:
                name = posixpath.basename(p)
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=parent)
                else:
                    os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            return
        except OSError as e:
            raise _error(e, "remove", p) from e

    # ---- watching ----

    def watch_dir(self, path: str, user: str | None = None, request_timeout: float | None = None,
                  recursive: bool = False, include_entry: bool = False,
                  allow_network_mounts: bool = False) -> WatchHandle:
        """Watch a directory (inotify, from the host); handle.get_new_events() returns what
        happened since the last call. allow_network_mounts is accepted: a workspace has none."""
        return WatchHandle(self.open_watch(path, user, recursive=recursive, include_entry=include_entry))

    def open_watch(self, path: str, user: str | None = None, *, recursive: bool = False,
                   include_entry: bool = False) -> Inotify:
        """The inotify watch behind watch_dir, for a caller that reads it itself (the asyncio
        handle reads it from its event loop)."""
        who = self._user(user)
        p = self._abs(path, who)
        try:
            with self._root(who) as root, self._open(root, p, os.O_PATH | os.O_DIRECTORY) as fd:
                return Inotify(self, p, fd, recursive, include_entry, root=self._root)
        except OSError as e:
            raise _error(e, "watch", p) from e


def _check_metadata(metadata: dict[str, str] | None) -> None:
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not k or not isinstance(v, str) or "\0" in k + v or len(k) > 200:
            raise InvalidArgumentException(f"metadata entry {k!r}={v!r} is invalid: a non-empty key and a str value")

