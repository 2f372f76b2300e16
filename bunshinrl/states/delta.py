"""Directory trees as deduplicated deltas: a saved snapshot stored as what changed since its parent.

A manifest maps every path of a saved snapshot directory to its metadata and content digests.
A snapshot whose images are a delta against a stored one is saved as that delta
(Snapshot.save(incremental=True): its own pages only) and records the stored images it reads
(`images_parent`); a restore puts those at Snapshot.layout.parent, level by level. Complete page
images (Snapshot.layout names them) are split into 4 KiB blocks, so that a complete save still
stores only the pages its parent's lacks; every other file is one blob. A node's delta records
only the entries that differ from its parent's manifest (for page images, only the blocks that
differ) plus the digest of the parent's delta, so the delta chain from the root rebuilds any
node's directory.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from bunshinfork import Snapshot

from .store import BlobStore

BLOCK = 4096
Entry = dict[str, Any]
Manifest = dict[str, Entry]
LAYOUT = Snapshot.layout


def _xattrs(path: str) -> dict[str, str]:
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listxattr(path, follow_symlinks=False):
            # Overlay whiteouts and opaque directories live in trusted.overlay.* attributes.
            out[name] = os.getxattr(path, name, follow_symlinks=False).hex()
    return out


def scan(directory: str | os.PathLike[str], store: BlobStore) -> Manifest:
    """Store every file's content in `store` and return the tree's manifest."""
    root = os.fspath(directory)
    manifest: Manifest = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*dirnames, *sorted(filenames)]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if LAYOUT.is_log(rel):
                continue
            st = os.lstat(full)
            e: Entry = {"m": stat.S_IMODE(st.st_mode), "u": st.st_uid, "g": st.st_gid, "mt": st.st_mtime_ns}
            x = _xattrs(full)
            if x:
                e["x"] = x
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                e["t"] = "d"
            elif stat.S_ISLNK(mode):
                e["t"], e["to"] = "l", os.readlink(full)
            elif stat.S_ISREG(mode):
                if st.st_nlink > 1 and (st.st_dev, st.st_ino) in inodes:
                    e = {"t": "h", "to": inodes[(st.st_dev, st.st_ino)]}
                else:
                    inodes[(st.st_dev, st.st_ino)] = rel
                    data = Path(full).read_bytes()
                    e["n"] = len(data)
                    if LAYOUT.is_page_image(rel):
                        e["t"] = "k"
                        e["c"] = [store.put(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)]
                    else:
                        e["t"], e["b"] = "f", store.put(data)
            else:
                kinds = {stat.S_IFCHR: "c", stat.S_IFBLK: "b", stat.S_IFIFO: "p", stat.S_IFSOCK: "s"}
                e["t"], e["rdev"] = kinds[stat.S_IFMT(mode)], st.st_rdev
            manifest[rel] = e
    return manifest


def diff(parent: Manifest | None, child: Manifest) -> dict[str, Any]:
    """The entries of `child` that differ from `parent`, and the paths it no longer has."""
    base = parent or {}
    entries: dict[str, Entry] = {}
    for rel, e in child.items():
        old = base.get(rel)
        if old == e:
            continue
        if e["t"] == "k" and old is not None and old.get("t") == "k":
            oc = old["c"]
            patch = {str(i): d for i, d in enumerate(e["c"]) if i >= len(oc) or oc[i] != d}
            entries[rel] = {**{k: v for k, v in e.items() if k != "c"}, "t": "kp", "p": patch}
        else:
            entries[rel] = e
    return {"entries": entries, "removed": sorted(set(base) - set(child))}


def apply(parent: Manifest | None, delta: dict[str, Any]) -> Manifest:
    out = dict(parent or {})
    for rel in delta["removed"]:
        out.pop(rel, None)
    for rel, e in delta["entries"].items():
        if e["t"] == "kp":
            blocks = list(out[rel]["c"])
            n_blocks = (e["n"] + BLOCK - 1) // BLOCK
            del blocks[n_blocks:]
            blocks.extend([""] * (n_blocks - len(blocks)))
            for i, d in e["p"].items():
                blocks[int(i)] = d
            out[rel] = {**{k: v for k, v in e.items() if k != "p"}, "t": "k", "c": blocks}
        else:
            out[rel] = e
    return out


def materialize(manifest: Manifest, store: BlobStore, dest: str | os.PathLike[str]) -> None:
    """Recreate the tree `manifest` describes under the new directory `dest`."""
    root = Path(dest)
    root.mkdir(parents=True)
    for rel in sorted(manifest):
        e = manifest[rel]
        p = root / rel
        t = e["t"]
        if t == "h":
            continue  # linked below, once its first name exists wherever it sorts
        if t == "d":
            p.mkdir()
        elif t == "l":
            os.symlink(e["to"], p)
        elif t in ("f", "k"):
            with open(p, "wb") as f:
                if t == "f":
                    f.write(store.get(e["b"]))
                else:
                    for d in e["c"]:
                        f.write(store.get(d))
        elif t == "p":
            os.mkfifo(p)
        else:
            kind = {"c": stat.S_IFCHR, "b": stat.S_IFBLK, "s": stat.S_IFSOCK}[t]
            os.mknod(p, kind | 0o600, e["rdev"])
        _set_meta(p, e)
    for rel, e in manifest.items():
        if e["t"] == "h":
            os.link(root / e["to"], root / rel)
    # A directory's mtime changes as entries are created in it: set them last, deepest first.
    for rel in sorted((r for r, e in manifest.items() if e["t"] == "d"), reverse=True):
        os.utime(root / rel, ns=(manifest[rel]["mt"], manifest[rel]["mt"]))


def _set_meta(p: Path, e: Entry) -> None:
    os.chown(p, e["u"], e["g"], follow_symlinks=False)
    if e["t"] != "l":
        os.chmod(p, e["m"])
    for name, value in e.get("x", {}).items():
        os.setxattr(p, name, bytes.fromhex(value), follow_symlinks=False)
    os.utime(p, ns=(e["mt"], e["mt"]), follow_symlinks=False)


def _in_images(rel: str) -> bool:
    return rel.startswith(LAYOUT.images + "/")


class DeltaStore:
    """Directories saved as delta chains in a BlobStore; a delta is itself a blob, and its digest
    is the reference a cache node keeps."""

    def __init__(self, store: BlobStore, manifests_kept: int = 16) -> None:
        self.store = store
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._kept = manifests_kept
        self._lock = threading.Lock()

    def save(self, directory: str | os.PathLike[str], parent: str | None,
             images_parent: str | None = None) -> tuple[str, int]:
        """Store `directory` as a delta against the saved directory `parent`; returns the
        delta's reference and the bytes this save added to the store. images_parent: the stored
        snapshot whose images a snapshot saved incrementally reads (restore() puts them back)."""
        before = self.store.stats().bytes_written
        manifest = scan(directory, self.store)
        base = self.manifest(parent) if parent else None
        delta = {"v": 1, "parent": parent, "images_parent": images_parent, **diff(base, manifest)}
        ref = self.store.put_json(delta)
        self._remember(ref, manifest)
        return ref, self.store.stats().bytes_written - before

    def images_parent(self, ref: str) -> str | None:
        return self.store.get_json(ref).get("images_parent")

    def manifest(self, ref: str) -> Manifest:
        with self._lock:
            if ref in self._manifests:
                self._manifests.move_to_end(ref)
                return self._manifests[ref]
        chain: list[dict[str, Any]] = []
        cur: str | None = ref
        base: Manifest | None = None
        while cur is not None:
            with self._lock:
                cached = self._manifests.get(cur)
            if cached is not None:
                base = cached
                break
            delta = self.store.get_json(cur)
            chain.append(delta)
            cur = delta["parent"]
        for delta in reversed(chain):
            base = apply(base, delta)
        assert base is not None
        self._remember(ref, base)
        return base

    def delta_bytes(self, ref: str) -> int:
        """Bytes a restore of `ref` reads: the content of its whole manifest, and the images of
        the stored snapshots it reads pages from."""
        total = sum(e.get("n", 0) for e in self.manifest(ref).values())
        up = self.images_parent(ref)
        while up is not None:
            total += sum(e.get("n", 0) for rel, e in self.manifest(up).items() if _in_images(rel))
            up = self.images_parent(up)
        return total

    def restore(self, ref: str, dest: str | os.PathLike[str]) -> None:
        materialize(self.manifest(ref), self.store, dest)
        at = Path(dest) / LAYOUT.parent
        up = self.images_parent(ref)
        while up is not None:
            # Only the images of the stored snapshot this one reads, where its parent link points.
            materialize({rel.split("/", 1)[1]: e for rel, e in self.manifest(up).items() if _in_images(rel)},
                        self.store, at)
            at, up = at / os.path.basename(LAYOUT.parent), self.images_parent(up)

    def _remember(self, ref: str, manifest: Manifest) -> None:
        with self._lock:
            self._manifests[ref] = manifest
            self._manifests.move_to_end(ref)
            while len(self._manifests) > self._kept:
                self._manifests.popitem(last=False)
