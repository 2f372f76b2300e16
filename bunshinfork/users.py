"""Users of a workspace: who a command or a file operation runs as.

Names resolve through the workspace's own /etc/passwd and /etc/group, never the host's. A
command switches to the user inside the workspace (the init does setgroups/setgid/setuid
before exec); a file operation done from the host takes the user's file-system identity for
the calling thread only (setfsuid, setfsgid and a per-thread setgroups), so the kernel checks
permissions and gives new files the owner it would give them inside.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

# Raw system call numbers: glibc's setgroups() would change every thread of this process.
_SYSCALLS = {"x86_64": (122, 123, 116), "aarch64": (151, 152, 159)}  # setfsuid, setfsgid, setgroups
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def shifted(self, to_host: Callable[[int], int]) -> User:
        """The same user with the host's ids for its own (a user namespace's map)."""
        return User(self.name, to_host(self.uid), to_host(self.gid), tuple(to_host(g) for g in self.groups),
                    self.home, self.shell)

    def spec(self) -> str:
        """The init's "uid:gid:gid,gid" form."""
        return f"{self.uid}:{self.gid}:{','.join(str(g) for g in self.groups)}"

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell}


ROOT = User("root", 0, 0, (0,), "/root", "/bin/bash")


def parse_passwd(text: str) -> dict[str, tuple[int, int, str, str]]:
    """name -> (uid, gid, home, shell)."""
    out: dict[str, tuple[int, int, str, str]] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 7 and parts[2].isdigit() and parts[3].isdigit():
            out.setdefault(parts[0], (int(parts[2]), int(parts[3]), parts[5] or "/", parts[6] or "/bin/sh"))
    return out


def parse_group(text: str) -> list[tuple[str, int, list[str]]]:
    """(name, gid, members) per line."""
    out = []
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[2].isdigit():
            out.append((parts[0], int(parts[2]), [m for m in parts[3].split(",") if m]))
    return out


def lookup(name: str, passwd: str, group: str) -> User | None:
    entry = parse_passwd(passwd).get(name)
    if entry is None:
        return None
    uid, gid, home, shell = entry
    groups = sorted({gid} | {g for _, g, members in parse_group(group) if name in members})
    return User(name, uid, gid, tuple(groups), home, shell)


def lookup_spec(spec: str, passwd: str, group: str) -> User | None:
    """A user as an image's User names it, the way Docker resolves it: 'name', 'uid',
    'name:group' or 'uid:gid' (numbers need no entry in /etc/passwd: such a user has gid 0 and
    home /, as under Docker). None where a name is not in the workspace's files."""
    who, _, grp = spec.partition(":")
    if not who:
        return None
    base = lookup(who, passwd, group)
    if base is None and who.isdigit():
        uid = int(who)
        by_uid = [n for n, (u, *_rest) in parse_passwd(passwd).items() if u == uid]
        base = lookup(by_uid[0], passwd, group) if by_uid else User(who, uid, 0, (0,), "/", "/bin/sh")
    if base is None:
        return None
    if not grp:
        return base
    if grp.isdigit():
        gid = int(grp)
    else:
        found = [g for n, g, _ in parse_group(group) if n == grp]
        if not found:
            return None
        gid = found[0]
    return User(base.name, base.uid, gid, tuple(sorted({gid, *base.groups} - {base.gid})), base.home, base.shell)


def names_by_id(text: str, field: int) -> dict[int, str]:
    """uid (field 2 of passwd) or gid (field 2 of group) -> name."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) > field and parts[field].isdigit():
            out.setdefault(int(parts[field]), parts[0])
    return out


def _syscall(nr: int, *args: object) -> int:
    rc = _libc.syscall(nr, *args)
    if rc == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(rc)


def _numbers() -> tuple[int, int, int]:
    try:
        return _SYSCALLS[platform.machine()]
    except KeyError:
        raise OSError(errno.ENOSYS, f"per-thread credentials are not wired up for {platform.machine()}") from None


def _set_groups(groups: tuple[int, ...] | list[int]) -> None:
    arr = (ctypes.c_uint * max(len(groups), 1))(*groups)
    _syscall(_numbers()[2], ctypes.c_size_t(len(groups)), arr)


_current = threading.local()  # the identity fs_identity gave this thread, if any


def _take(user: User) -> None:
    setfsuid, setfsgid, _ = _numbers()
    if user.is_root:
        _libc.syscall(setfsuid, 0)
        _libc.syscall(setfsgid, 0)
        _set_groups(getattr(_current, "saved_groups", [0]))
        return
    _set_groups(user.groups)
    _libc.syscall(setfsgid, user.gid)
    _libc.syscall(setfsuid, user.uid)


@contextlib.contextmanager
def fs_identity(user: User) -> Iterator[None]:
    """Take `user`'s file-system identity in the calling thread for the block (nested blocks
    included: root's inside a user's is root's again).

    Leaving fsuid 0 drops CAP_DAC_OVERRIDE and the other file capabilities from the thread's
    effective set, and going back to 0 restores them, so the block is checked as the user is.
    """
    outer: User = getattr(_current, "user", ROOT)
    if outer == user:
        yield
        return
    if outer.is_root:
        _current.saved_groups = os.getgroups()
    _take(user)
    _current.user = user
    try:
        yield
    finally:
        _take(outer)
        _current.user = outer


class Accounts:
    """A workspace's users and groups, read from its /etc as root and re-read when it changes."""

    PATHS = ("/etc/passwd", "/etc/group")

    def __init__(self, stamp: Callable[[Sequence[str]], object],
                 read_as_root: Callable[[Sequence[str]], Sequence[str]]) -> None:
        # Both from files.Files: what changes when the files change, and their texts.
        self._stamp_of, self._read = stamp, read_as_root
        self._stamp: object = None
        self._texts = ("", "")
        self._lock = threading.Lock()

    def _current(self) -> tuple[str, str]:
        with self._lock:
            stamp = self._stamp_of(self.PATHS)
            if stamp != self._stamp:
                texts = self._read(self.PATHS)
                self._stamp, self._texts = stamp, (texts[0], texts[1])
            return self._texts

    def resolve(self, name: str) -> User:
        if name == "root":
            return ROOT
        passwd, group = self._current()
        user = lookup(name, passwd, group) or (lookup_spec(name, passwd, group) if ":" in name or name.isdigit()
                                                 else None)
        if user is None:
            from .errors import InvalidArgumentException

            raise InvalidArgumentException(f"no user {name!r} in the workspace's /etc/passwd")
        return user

    def names(self) -> tuple[dict[int, str], dict[int, str]]:
        """uid -> user name and gid -> group name."""
        passwd, group = self._current()
        return names_by_id(passwd, 2), names_by_id(group, 2)


def add_user(passwd: str, group: str, name: str, uid: int = 1000) -> tuple[str, str, User]:
    """passwd and group texts with `name` added (uid and a same-named group at the first free
    id from `uid`), and the user; unchanged texts when it exists."""
    existing = lookup(name, passwd, group)
    if existing is not None:
        return passwd, group, existing
    used_uids = {u for u, _, _, _ in parse_passwd(passwd).values()}
    used_gids = {g for _, g, _ in parse_group(group)}
    while uid in used_uids or uid in used_gids:
        uid += 1
    home = f"/home/{name}"
    def line(text: str, entry: str) -> str:
        return text + ("\n" if text and not text.endswith("\n") else "") + entry + "\n"

    passwd = line(passwd, f"{name}:x:{uid}:{uid}::{home}:/bin/bash")
    group = line(group, f"{name}:x:{uid}:")
    return passwd, group, User(name, uid, uid, (uid,), home, "/bin/bash")
