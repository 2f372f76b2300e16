"""A workspace's user namespace (WorkspaceSpec(userns=True)): the id range its root maps to.

Inside, ids 0..SIZE-1 are the host's BASE..BASE+SIZE-1, the range Docker's userns-remap
gives its default `dockremap` user (/etc/subuid 100000:65536). Root inside is then an
unprivileged user outside: what it may do to the host is what uid 100000 may. Every
userns workspace and its forks share the one range, as Docker's containers do; a clone
must keep its source's map (CRIU restores the namespace with it).

The host writes the map (it is root in the initial namespace, so no newuidmap and no
/etc/subuid entry is needed), and whatever the host creates inside a workspace's layers on
its behalf is given to the mapped ids (shift_new).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .contract import Check
from .errors import KernelFeatureError

BASE = 100000
SIZE = 65536
OVERFLOW = 65534  # the id the kernel shows for one a namespace does not map (overflowuid)


@dataclass(frozen=True)
class IdMap:
    """One contiguous range: ids inside [0, size) are the host's [base, base + size)."""

    base: int = 0
    size: int = 1 << 32

    @property
    def shifted(self) -> bool:
        return self.base != 0

    def maps_host(self, host: int) -> bool:
        """Whether a host id has an id inside (one outside shows as the overflow id)."""
        return self.base <= host < self.base + self.size

    def to_host(self, inside: int) -> int:
        return inside + self.base if 0 <= inside < self.size else -1

    def from_host(self, host: int) -> int:
        """The id a host id has inside; 65534 (the kernel's overflow id) where it has none."""
        return host - self.base if self.maps_host(host) else OVERFLOW

    def line(self) -> str:
        return f"0 {self.base} {self.size}\n"


IDENTITY = IdMap()
WORKSPACE = IdMap(BASE, SIZE)


def write(pid: int, m: IdMap = WORKSPACE) -> None:
    """Give the (not yet released) child `pid` its uid and gid maps. setgroups stays allowed:
    the map is written by a privileged process, and the init's users take their groups."""
    for name in ("uid_map", "gid_map"):
        try:
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(m.line())
        except OSError as e:
            raise KernelFeatureError(f"writing {name} of the workspace's user namespace failed: {e}") from e


def of(pid: int) -> IdMap:
    """The uid map of `pid`'s user namespace, read from the host: IDENTITY for the host's own,
    else its first range (a workspace's is one range)."""
    try:
        text = Path(f"/proc/{pid}/uid_map").read_text()
    except OSError:
        return IDENTITY
    fields = text.split()
    if len(fields) < 3 or fields[0] != "0":
        return IDENTITY
    return IdMap(int(fields[1]), int(fields[2]))


def shift_tree(top: Path, m: IdMap = WORKSPACE) -> None:
    """Give `top` and everything under it to the ids `m` maps theirs to: a rootfs's copy, or
    what the host wrote into a new layer's upper (the init and the identity files).
    Entries already in the range keep their owners."""
    _shift_one(str(top), m)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in (*dirnames, *filenames):
            _shift_one(os.path.join(dirpath, name), m)


def _shift_one(path: str, m: IdMap) -> None:
    st = os.lstat(path)
    uid = st.st_uid if m.maps_host(st.st_uid) else m.to_host(st.st_uid)
    gid = st.st_gid if m.maps_host(st.st_gid) else m.to_host(st.st_gid)
    if (uid, gid) == (st.st_uid, st.st_gid) or uid < 0 or gid < 0:
        return
    link = stat.S_ISLNK(st.st_mode)
    cap = None if link else _xattr(path, CAPS)
    os.lchown(path, uid, gid)
    # chown clears a file's setuid bits and its file capabilities: put them back, the
    # capabilities as a v3 entry naming the namespace's root (a v2 one counts only for the
    # host's root, so ping's cap_net_raw would be lost inside).
    if not link and st.st_mode & 0o6000:
        os.chmod(path, stat.S_IMODE(st.st_mode))
    if cap is not None:
        os.setxattr(path, CAPS, _caps_v3(cap, m.base), follow_symlinks=False)


CAPS = "security.capability"
_V2, _V3 = 0x02000000, 0x03000000


def _xattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def _caps_v3(raw: bytes, rootid: int) -> bytes:
    """A file capability entry (linux/capability.h's vfs_cap_data) as revision 3 owned by
    `rootid`; an entry that is not revision 2 or 3 is kept as it was."""
    if len(raw) < 20:
        return raw
    magic = int.from_bytes(raw[:4], "little")
    if magic & 0xFF000000 not in (_V2, _V3):
        return raw
    flags = magic & 0x00FFFFFF
    return (_V3 | flags).to_bytes(4, "little") + raw[4:20] + rootid.to_bytes(4, "little")


def check_userns() -> Check:
    """userns=True only: the kernel must let the host create user namespaces."""
    try:
        limit = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        limit = 0
    if not os.path.exists("/proc/self/ns/user") or limit <= 0:
        return Check("user namespaces", False, "the kernel offers none (CONFIG_USER_NS, user.max_user_namespaces): "
                     "only userns=False workspaces can be created", required=False)
    return Check("user namespaces", True, f"userns=True maps root to host uid {BASE} "
                 f"(max_user_namespaces {limit})", required=False)
