"""One image layer (a tar stream) applied to an empty directory as an overlay lower layer.

What Docker's and containerd's overlay snapshotters do, done here entry by entry rather than
by tarfile.extractall, which drops setuid/setgid/sticky bits (filter="tar"), xattrs (file
capabilities) and cannot make overlay whiteouts:
- `.wh.NAME` becomes an overlay whiteout (a 0:0 character device) named NAME;
- `.wh..wh..opq` marks its directory opaque (trusted.overlay.opaque=y);
- owners, full modes (chmod after chown, which clears setuid bits), PAX `SCHILY.xattr.*` xattrs
  (security.capability among them), hard links, symlinks, fifos and 0:0 character devices
  (whiteouts in a layer exported from an overlay) are kept;
- every other device node is dropped and reported (`skipped`), as rootless importers do: a node
  in a layer would open the host's device of that number. FIFOs are kept: a pipe reaches nothing
  of the host's, and images ship them (/run/initctl).
Entries whose path is absolute or climbs with `..`, hard links to outside the layer, symlinks
whose relative target climbs out of it, and paths through a symlink are refused
(UnsafeLayerEntry): nothing is ever written outside `dest`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import shutil
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import CorruptLayer, UnsafeLayerEntry

WHITEOUT = ".wh."
OPAQUE_MARK = ".wh..wh..opq"
META_PREFIX = ".wh..wh."  # aufs bookkeeping (.wh..wh.plnk and the like): not content
OPAQUE_XATTR = "trusted.overlay.opaque"
XATTR_PAX = "SCHILY.xattr."
_CHUNK = 1 << 20


@dataclass
class Unpacked:
    """What unpacking a layer did: its uncompressed digest, and the nodes it could not make."""

    diff_id: str
    entries: int = 0
    skipped: list[str] = field(default_factory=list)  # "path: why"


class HashingReader:
    """A read-only stream that hashes what passes through it (sha256)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.hash = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass

    def digest(self) -> str:
        return "sha256:" + self.hash.hexdigest()


def clean_name(name: str) -> str:
    """The entry's path relative to the layer root ('' for the root), or UnsafeLayerEntry."""
    if "\0" in name:
        raise UnsafeLayerEntry(f"layer entry {name!r} has a NUL in its name")
    if name.startswith("/"):
        raise UnsafeLayerEntry(f"layer entry {name!r} is an absolute path")
    if not name:
        # tarfile strips a directory's trailing '/', so an entry named '/' arrives as '':
        # it is absolute like any other, and a real layer names its root '.' or './'.
        raise UnsafeLayerEntry("layer entry has an empty name (an absolute '/' reads as one)")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayerEntry(f"layer entry {name!r} climbs out of the layer with '..'")
    return "/".join(parts)


def _check_symlink(rel: str, target: str) -> None:
    if "\0" in target or not target:
        raise UnsafeLayerEntry(f"symlink {rel!r} has an empty or NUL target")
    if target.startswith("/"):
        return  # resolved against the workspace's root, where it is confined
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    if joined == ".." or joined.startswith("../"):
        raise UnsafeLayerEntry(f"symlink {rel!r} -> {target!r} points outside the layer")


class _Applier:
    def __init__(self, dest: Path) -> None:
        self.root = str(dest)
        self.dir_times: list[tuple[str, int]] = []

    def _parent(self, rel: str) -> str:
        """The host path of `rel`'s parent, made as directories where missing; a component that
        is not a real directory (a symlink above all) is refused, so nothing lands outside."""
        here = self.root
        for part in rel.split("/")[:-1]:
            here = os.path.join(here, part)
            try:
                st = os.lstat(here)
            except FileNotFoundError:
                os.mkdir(here, 0o755)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeLayerEntry(f"layer entry {rel!r} lies under {part!r}, which is not a directory")
        return here

    def _clear(self, path: str, keep_dir: bool) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def apply(self, tf: tarfile.TarFile, m: tarfile.TarInfo, out: Unpacked) -> None:
        rel = clean_name(m.name)
        base = rel.rsplit("/", 1)[-1]
        if rel == "":
            return  # the workspace's root directory is its upper's, as under Docker
        parent = self._parent(rel)
        path = os.path.join(parent, base)
        if base == OPAQUE_MARK:
            os.setxattr(parent, OPAQUE_XATTR, b"y")
            return
        if base.startswith(META_PREFIX):
            return
        if base.startswith(WHITEOUT):
            hidden = base[len(WHITEOUT):]
            if not hidden or hidden in (".", ".."):
                raise UnsafeLayerEntry(f"layer entry {rel!r} is a whiteout of nothing")
            target = os.path.join(parent, hidden)
            self._clear(target, keep_dir=False)
            os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(0, 0))
            return
        if m.isdir():
            self._clear(path, keep_dir=True)
            if not os.path.isdir(path):
                os.mkdir(path, 0o700)
            self._meta(path, m)
            self.dir_times.append((path, int(m.mtime * 1e9)))
            return
        self._clear(path, keep_dir=False)
        if m.isreg():
            src = tf.extractfile(m)
            assert src is not None
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                while chunk := src.read(_CHUNK):
                    f.write(chunk)
        elif m.issym():
            _check_symlink(rel, m.linkname)
            os.symlink(m.linkname, path)
        elif m.islnk():
            target_rel = clean_name(m.linkname)
            if not target_rel:
                raise UnsafeLayerEntry(f"hard link {rel!r} points at the layer's root")
            target = os.path.join(self._parent(target_rel), target_rel.rsplit("/", 1)[-1])
            try:
                st = os.lstat(target)
            except FileNotFoundError:
                raise UnsafeLayerEntry(f"hard link {rel!r} -> {m.linkname!r} points outside the layer "
                                       "(no such entry before it)") from None
            if stat.S_ISDIR(st.st_mode):
                raise UnsafeLayerEntry(f"hard link {rel!r} -> {m.linkname!r} points at a directory")
            os.link(target, path, follow_symlinks=False)
            return  # the link shares its target's inode: owner, mode and xattrs are the target's
        elif m.isfifo():
            os.mkfifo(path, 0o600)
        elif (m.ischr() or m.isblk()) and not (m.ischr() and m.devmajor == m.devminor == 0):
            # A layer's device node would be the host's device, under the image's chosen owner
            # and mode: dropped, as rootless importers drop them. The workspace's /dev is its own
            # tmpfs with the standard nodes; a 0:0 character device is an overlay whiteout.
            out.skipped.append(f"{rel}: a device node ({m.devmajor}:{m.devminor}); images carry none")
            return
        elif m.ischr():
            try:
                os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(0, 0))
            except PermissionError as e:
                out.skipped.append(f"{rel}: {e.strerror} (whiteouts cannot be made here)")
                return
        else:
            raise UnsafeLayerEntry(f"layer entry {rel!r} has an unknown tar type {m.type!r}")
        self._meta(path, m)

    def _meta(self, path: str, m: tarfile.TarInfo) -> None:
        os.chown(path, m.uid, m.gid, follow_symlinks=False)
        if not m.issym():
            # After chown, which clears setuid and setgid bits.
            os.chmod(path, stat.S_IMODE(m.mode))
        for key, value in m.pax_headers.items():
            if key.startswith(XATTR_PAX):
                raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
                try:
                    os.setxattr(path, key[len(XATTR_PAX):], raw, follow_symlinks=False)
                except OSError as e:
                    if e.errno not in (errno.ENOTSUP, errno.EPERM):
                        raise
        if not m.isdir():
            ns = int(m.mtime * 1e9)
            os.utime(path, ns=(ns, ns), follow_symlinks=False)

    def finish(self) -> None:
        for path, ns in reversed(self.dir_times):
            os.utime(path, ns=(ns, ns), follow_symlinks=False)


def unpack(stream: IO[bytes], dest: Path) -> Unpacked:
    """Apply the uncompressed layer tar `stream` to the empty directory `dest`; the digest of
    every byte read (the layer's diff_id once compared). CorruptLayer if it is not a tar."""
    reader = HashingReader(stream)
    out = Unpacked("")
    applier = _Applier(dest)
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tf:  # type: ignore[call-overload]
            for m in tf:
                applier.apply(tf, m, out)
                out.entries += 1
    except (tarfile.TarError, EOFError) as e:
        raise CorruptLayer(f"the layer is not a readable tar: {e}") from e
    applier.finish()
    reader.drain()  # the tar's end padding counts toward its digest
    out.diff_id = reader.digest()
    return out
