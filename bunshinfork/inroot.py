"""The host's one way to a path inside a workspace: resolved under the workspace's root, acted on by fd.

The host reaches a workspace's files through /proc/<init>/root. A path joined onto that
string is resolved by the kernel from the host's root as soon as it meets an absolute
symlink: root inside workspace A who makes /.bunshin a symlink to /proc/<B's init>/root/.bunshin
had A's next command run in B, and an image whose /home is a symlink to /tmp had the host
chown its own /tmp/<user>. So nothing else in bunshin opens /proc/<pid>/root or joins a path
onto it (tests/test_parts.py checks): this module opens the root as a directory fd and
resolves every path against it with openat2, where "/" and ".." stay at the workspace's root.

Two kinds of path, two resolutions:
- bunshin's own (/.bunshin/...): fixed() takes no symlink at all (RESOLVE_NO_SYMLINKS), and
  a socket is used only if it is one and belongs to the namespace's root (bunshin_socket).
- a path a user or an image names (a home, a file of the files API): named() follows
  symlinks as the workspace itself would, inside its root (RESOLVE_IN_ROOT), and never
  /proc's magic links (RESOLVE_NO_MAGICLINKS), since an image whose /home is a symlink is
  legitimate.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from . import idmap, native
from .errors import WorkspaceStateError

RESOLVE_NO_SYMLINKS = 0x04
FIXED = native.RESOLVE_IN_ROOT | native.RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS
NAMED = native.RESOLVE_IN_ROOT | native.RESOLVE_NO_MAGICLINKS


class NotBunshins(WorkspaceStateError, OSError):
    """What was found at one of bunshin's own paths inside a workspace is not bunshin's: a
    symlink on the way, or not a socket of the namespace's root. An OSError too, so that a
    caller that copes with a missing path copes with this one the same way."""


def open_root(init_pid: int) -> int:
    """An O_PATH fd of the root directory of the workspace whose init is `init_pid`, for fixed()
    and named(); the caller closes it. Opened with the caller's credentials: the host's root
    may; a workspace's user may not."""
    return os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


@contextlib.contextmanager
def root(init_pid: int) -> Iterator[int]:
    """open_root() for the block."""
    fd = open_root(init_pid)
    try:
        yield fd
    finally:
        os.close(fd)


def fixed(root_fd: int, path: str, flags: int, mode: int = 0o600) -> int:
    """Open bunshin's own `path` (/.bunshin/...) under `root_fd`: a symlink anywhere on the way is
    refused, as nothing of bunshin's is one: NotBunshins says so."""
    try:
        return native.openat2(root_fd, path, flags, mode, resolve=FIXED)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EXDEV):
            raise NotBunshins(e.errno, f"{path} in the workspace goes through a symlink: it is not "
                                       "bunshin's, refusing it") from None
        raise


def named(root_fd: int, path: str, flags: int, mode: int = 0o644) -> int:
    """Open `path`, named by a user or an image, under `root_fd`, following its symlinks as the
    workspace would (inside its root)."""
    return native.openat2(root_fd, path, flags, mode, resolve=NAMED)


@contextlib.contextmanager
def bunshin_socket(init_pid: int, path: str) -> Iterator[str]:
    """An address that connects to the unix socket bunshin's init (or a shim) listens on at
    `path` in the workspace, and to nothing else: /proc/self/fd/N of an O_PATH fd of it, valid
    for the block. A connect through it reaches the very inode checked here, whatever is
    renamed or replaced meanwhile. FileNotFoundError where nothing is there; NotBunshins
    where a symlink, or anything but a socket of the namespace's root, is."""
    with root(init_pid) as r:
        fd = fixed(r, path, os.O_PATH)
    try:
        st = os.fstat(fd)
        # The init and its shims bind as the namespace's root (and CRIU restores a clone's and a
        # resumed workspace's sockets with that owner): in a user namespace no one inside but
        # root could have made this one.
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != idmap.of(init_pid).to_host(0):
            raise NotBunshins(errno.EPERM, f"{path} in the workspace is not bunshin's socket (mode "
                                           f"{st.st_mode:o}, owner {st.st_uid}): refusing to connect")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
