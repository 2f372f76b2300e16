"""Users of a workspace: who a command or a file operation runs as.

Names resolve through the workspace's own /etc/passwd and /etc/group, never the host's. A
command switches to the user inside the workspace (the init does setgroups/setgid/setuid
before exec); a file operation done from the host takes the user's credentials for the
calling thread only (as_sandbox: per-thread setresuid, setresgid, setgroups and capset), so
the kernel checks permissions, gives new files the owner, and shows /proc and /sys as it
would inside.
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

# Raw system call numbers: glibc's set*id() and setgroups() change every thread of the process
# (it signals each one); the system calls themselves change the calling thread only.
_SYSCALLS = {"x86_64": {"setgroups": 116, "setresuid": 117, "setresgid": 119, "capget": 125, "capset": 126},
             "aarch64": {"setgroups": 159, "setresuid": 147, "setresgid": 149, "capget": 90, "capset": 91}}
_libc = ctypes.CDLL(None, use_errno=True)

# The most a file operation as root inside a workspace holds: Docker's default capability set
# (CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID, SETPCAP, NET_BIND_SERVICE, NET_RAW,
# SYS_CHROOT, MKNOD, AUDIT_WRITE, SETFCAP), cut to what the workspace's init holds. Nothing else
# of the server's: CAP_SYSLOG reads kernel addresses, CAP_SYS_PTRACE any process's /proc files,
# CAP_SYS_ADMIN much more. The whole set and not only the file capabilities: the kernel lets a
# caller into another process's /proc entries when its capabilities cover that process's, so
# root's /proc/1/... answers as it does inside.
ROOT_CAPS_MAX = sum(1 << c for c in (0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31))
_CAP_V3 = 0x20080522


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


def _syscall(name: str, *args: object) -> int:
    try:
        nr = _SYSCALLS[platform.machine()][name]
    except KeyError:
        raise OSError(errno.ENOSYS, f"per-thread credentials are not wired up for {platform.machine()}") from None
    rc = _libc.syscall(nr, *args)
    if rc == -1:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}: {os.strerror(e)}")
    return int(rc)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capget() -> tuple[int, int, int]:
    """The calling thread's (effective, permitted, inheritable) capability sets."""
    data = (_CapData * 2)()
    _syscall("capget", ctypes.byref(_CapHeader(_CAP_V3, 0)), data)
    effective, permitted, inheritable = ((getattr(data[1], f) << 32) | getattr(data[0], f)
                                         for f in ("effective", "permitted", "inheritable"))
    return effective, permitted, inheritable


def _capset(effective: int, permitted: int, inheritable: int) -> None:
    data = (_CapData * 2)()
    for i in (0, 1):
        data[i].effective, data[i].permitted, data[i].inheritable = (
            (v >> (32 * i)) & 0xFFFFFFFF for v in (effective, permitted, inheritable))
    _syscall("capset", ctypes.byref(_CapHeader(_CAP_V3, 0)), data)


def _set_groups(groups: tuple[int, ...]) -> None:
    arr = (ctypes.c_uint * max(len(groups), 1))(*groups)
    _syscall("setgroups", ctypes.c_size_t(len(groups)), arr)


@dataclass(frozen=True)
class Credentials:
    """A thread's identity for a file operation: host ids, and the effective capabilities kept."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    caps: int


def credentials(user: User, to_host: Callable[[int], int], root_caps: int) -> Credentials:
    """What `user` of a workspace is on the host: its ids through the namespace's map, and
    `root_caps` (root's effective set inside) within ROOT_CAPS_MAX for root, none for anyone else."""
    shifted = user.shifted(to_host)
    return Credentials(shifted.uid, shifted.gid, shifted.groups, root_caps & ROOT_CAPS_MAX if user.is_root else 0)


def init_caps(pid: int) -> int:
    """The effective capability set of process `pid` (a workspace's init: root's inside), 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


@dataclass(frozen=True)
class _Host:
    """The thread's own credentials, put back when it leaves the workspace's."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    caps: tuple[int, int, int]

    @classmethod
    def now(cls) -> _Host:
        return cls(os.geteuid(), os.getegid(), tuple(os.getgroups()), _capget())


_thread = threading.local()  # .host: _Host, .current: the Credentials taken (None: the host's)


def _take(c: Credentials | None) -> None:
    """Give the calling thread `c` (None: its host credentials). The real and saved uids stay the
    host's root, so the permitted set is kept and the way back is open to this thread only;
    the effective set, the euid (which the kernel's checks of /proc/sys and ptrace use, not
    only the fsuid) and the groups are the workspace's."""
    host: _Host = _thread.host
    was: Credentials | None = getattr(_thread, "current", None)
    if was is not None:
        # Back to the host first: euid 0 gives the effective set back (cap_emulate_setxuid), and
        # only then may the gids and groups change again.
        if was.uid != host.uid:
            _syscall("setresuid", -1, host.uid, -1)
        _capset(*host.caps)
        if was.gid != host.gid:
            _syscall("setresgid", -1, host.gid, -1)
        if was.groups != host.groups:
            _set_groups(host.groups)
    _thread.current = None
    if c is None:
        return
    _thread.current = c  # set first: a failure half-way is undone from here
    if c.groups != host.groups:
        _set_groups(c.groups)
    if c.gid != host.gid:
        _syscall("setresgid", -1, c.gid, -1)
    if c.uid != host.uid:
        _syscall("setresuid", -1, c.uid, -1)  # the fsuid follows; a non-zero euid clears the effective set
    _, permitted, inheritable = host.caps
    _capset(c.caps & permitted, permitted, inheritable)


@contextlib.contextmanager
def _switched(c: Credentials | None) -> Iterator[None]:
    outer: Credentials | None = getattr(_thread, "current", None)
    if outer == c:
        yield
        return
    if outer is None:
        _thread.host = _Host.now()
    try:
        _take(c)
        yield
    finally:
        _take(outer)


def as_sandbox(c: Credentials) -> contextlib.AbstractContextManager[None]:
    """Run the block in the calling thread with credentials `c` only: what the kernel lets the
    block do is what it lets the workspace's user do (its ids, root's capabilities at most),
    on files and on /proc and /sys alike (kallsyms is zeroed, another user's process files are
    closed). Nested blocks take theirs and give the outer one back."""
    return _switched(c)


def as_host() -> contextlib.AbstractContextManager[None]:
    """The thread's own credentials for the block, inside an as_sandbox block: opening a
    workspace's root needs the host's (a no-op outside one)."""
    return _switched(None) if getattr(_thread, "current", None) is not None else contextlib.nullcontext()


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
