"""The layer store: where workspaces' private layers and snapshots' frozen layers live by default.

It is a btrfs in a sparse loop file (/var/lib/bunshin/layers.img mounted at
/var/lib/bunshin/layers; BUNSHIN_LAYERS moves it), made by the set-up step
(`bunshin storage setup`, which scripts/setup.sh runs) and mounted again on first use after a
reboot. On it every workspace's layer is a subvolume (one qgroup each, for quotas) and a
snapshot is a read-only subvolume snapshot: copy-on-write, nothing copied. Where it cannot
exist (no btrfs, or the image on a file system that cannot back a loop device, as the qemu
guest's 9p root) layers are directories on the state root's tmpfs, each snapshot copies its
layer once, and a StorageWarning says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import warnings
from pathlib import Path

from .. import native, state
from ..contract import Check
from ..errors import KernelFeatureError
from ..host import HOST
from . import btrfs

STORE = HOST.layer_store
IMAGE = STORE.with_name(STORE.name + ".img")
DEFAULT_SIZE = 32 << 30
TMPFS_MAGIC = 0x01021994
# statfs magics of file systems an image must not be looped from: a second kernel's view of
# the host's disk (9p, the guest's overlay root), or memory (tmpfs) where direct I/O is impossible.
_NO_IMAGE_FS = {0x01021997: "9p", 0x794C7630: "overlay", TMPFS_MAGIC: "tmpfs", 0x858458F6: "ramfs",
                0x6969: "nfs", 0x65735546: "fuse"}


# What a local user of the host may do with the stores: pass through a root (0711) to nothing
# it can name, since each workspace's layer (and the snapshots' directory) is 0700; and were a
# path reachable, nosuid,nodev mounts make a setuid file, a file capability or a device node
# that a sandbox wrote, or an image shipped, nothing but bytes. A workspace's upper/ stays
# 0755: it is the sandbox's /.
ROOT_MODE = 0o711
PRIVATE_MODE = 0o700
MS_REMOUNT, MS_BIND = 32, 4096
_PER_MOUNT = os.ST_RDONLY | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME | os.ST_RELATIME


def seal(path: Path) -> None:
    """Make the mount `path` lies on nosuid,nodev: remounted where `path` is a mount point
    without them, else bound onto itself first (a directory on the host's root file system).
    The other per-mount flags are kept (statvfs's ST_* bits are the MS_* ones)."""
    flag = os.statvfs(path).f_flag
    if flag & os.ST_NOSUID and flag & os.ST_NODEV:
        return
    if not os.path.ismount(path):
        native.mount(str(path), str(path), None, MS_BIND)
        flag = os.statvfs(path).f_flag
    native.mount(None, str(path), None,
                 MS_BIND | MS_REMOUNT | native.MS_NOSUID | native.MS_NODEV | (flag & _PER_MOUNT))


def private_dirs(root: Path, names: list[str]) -> None:
    """chmod 0700 each of `names` under `root` (a store made before these modes: set-up reuses
    /var/lib/bunshin across checkouts)."""
    for n in names:
        with contextlib.suppress(OSError):
            os.chmod(root / n, PRIVATE_MODE)


_hardened: set[str] = set()


def harden() -> None:
    """Once per process: the layer store's mount nosuid,nodev and its modes, and the paused
    workspaces' root (beside it) 0700."""
    if str(STORE) in _hardened or os.geteuid() != 0:  # only root changes them (doctor may run as anyone)
        return
    if mounted():
        seal(STORE)
        os.chmod(STORE, ROOT_MODE)
        private_dirs(STORE, [n for n in os.listdir(STORE) if n.startswith("ws-")])
    if state.PAUSED_ROOT.parent.is_dir():
        state.PAUSED_ROOT.mkdir(mode=PRIVATE_MODE, exist_ok=True)
        os.chmod(state.PAUSED_ROOT, PRIVATE_MODE)
    _hardened.add(str(STORE))


class StorageWarning(UserWarning):
    """Layers are copied (once per snapshot) because the storage cannot copy-on-write."""


_libc = ctypes.CDLL(None, use_errno=True)


def fs_magic(path: Path) -> int | None:
    """statfs(2)'s f_type (the first field of struct statfs, a long)."""
    buf = ctypes.create_string_buffer(256)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value


def mounted() -> bool:
    return os.path.ismount(STORE) and btrfs.is_btrfs(STORE)


def _image_refusal() -> str | None:
    """Why IMAGE cannot back the store here, or None."""
    where = IMAGE.parent
    while not where.exists() and where != where.parent:  # setup creates it on its nearest ancestor's fs
        where = where.parent
    magic = fs_magic(where)
    if magic in _NO_IMAGE_FS:
        return f"{IMAGE} lies on {_NO_IMAGE_FS[magic]}, which cannot back a loop device for it"
    return None


def setup(size: int | None = None) -> Path:
    """Create the store's image if it is missing, and mount it. Idempotent."""
    state.require_root()
    if why := _image_refusal():
        raise KernelFeatureError(why)
    with state.lock("layer-store", root=IMAGE.parent):
        if mounted():
            btrfs.limit_dirty(str(STORE))
            harden()
            return STORE
        if size is None:
            IMAGE.parent.mkdir(parents=True, exist_ok=True)
            # Sparse: it takes what the layers hold. Never promise more than half the free space.
            size = min(DEFAULT_SIZE, shutil.disk_usage(IMAGE.parent).free // 2)
        btrfs.setup_btrfs_loop(str(IMAGE), str(STORE), size=size)
        harden()
    return STORE


def ensure() -> Path | None:
    """The store's mountpoint, mounting an existing image first (after a reboot); None where
    there is no store to use."""
    if mounted():
        harden()
        return STORE
    if not IMAGE.is_file() or _image_refusal() is not None:
        harden()
        return None
    try:
        return setup()
    except (KernelFeatureError, OSError):
        return None


def fallback_root() -> Path:
    """Where layers live without a store: the state root's tmpfs."""
    return state.run_root() / "layers" / "ws"


def default_root() -> Path:
    return ensure() or fallback_root()


def warn_copy(what: str, nbytes: int, root: Path) -> None:
    fix = (f"run 'bunshin storage setup' (scripts/setup.sh does) for a btrfs layer store at {STORE}, "
           "or see 'bunshin doctor' for why there is none") if root == fallback_root() else \
        f"put storage_dir on btrfs (it is {root.parent})"
    warnings.warn(
        f"{what}: its layer was copied ({nbytes / 2**20:.1f} MiB) because its storage cannot "
        f"copy-on-write; every snapshot there copies its workspace's layer once. To copy nothing, {fix}",
        StorageWarning, stacklevel=4,
    )


def check_store() -> Check:
    """Where layers live, and whether snapshots of them are copy-on-write."""
    if mounted():
        limit = btrfs.dirty_limit(str(STORE))
        usage = shutil.disk_usage(STORE)
        dirty = f"dirty data held at {limit >> 20} MiB" if limit else \
            "no dirty limit (Linux < 6.2): a snapshot flushes what was written since the pre-flush"
        return Check("layer store", True,
                     f"btrfs at {STORE} ({IMAGE}, {usage.used >> 30}/{usage.total >> 30} GiB used): snapshots "
                     f"are copy-on-write; {dirty}", required=False)
    why = _image_refusal() or (f"{IMAGE} does not exist: run 'bunshin storage setup' (scripts/setup.sh does)"
                               if not IMAGE.exists() else f"{IMAGE} exists but does not mount")
    return Check("layer store", False,
                 f"{why}; layers live on the state root's tmpfs ({state.RUN_ROOT}), in memory, and every "
                 "snapshot copies its workspace's layer once", required=False)
