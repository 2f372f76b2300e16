"""Content-addressed blobs and directory deltas (no workspaces needed)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from bunshinrl.states.delta import BLOCK, DeltaStore, apply, diff, materialize, scan
from bunshinrl.states.store import BlobStore


def test_blob_store_deduplicates(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    d1 = store.put(b"hello")
    d2 = store.put(b"hello")
    assert d1 == d2 and store.get(d1) == b"hello"
    st = store.stats()
    assert st.blobs_written == 1 and st.bytes_written == 5 and st.bytes_deduplicated == 5
    assert store.get_json(store.put_json({"b": 1, "a": 2})) == {"a": 2, "b": 1}
    assert store.disk_bytes() > 0


def _tree(root: Path, pages: bytes) -> None:
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(pages)
    (root / "images" / "core-1.img").write_bytes(b"core")
    (root / "images" / "dump.log").write_text("skipped")
    up = root / "fs" / "upper"
    (up / "root").mkdir(parents=True)
    (up / "root" / "file").write_text("content")
    os.chmod(up / "root" / "file", 0o640)
    os.link(up / "root" / "file", up / "hard")
    (up / "root" / "link").symlink_to("file")
    os.mknod(up / "root" / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # an overlay whiteout
    os.mkfifo(up / "fifo")
    (up / "opaque").mkdir()
    os.setxattr(up / "opaque", "trusted.overlay.opaque", b"y")
    os.utime(up / "root" / "file", ns=(1_000_000_000, 1_000_000_000))
    (root / "fs" / "work" / "work").mkdir(parents=True)
    os.chmod(root / "fs" / "work" / "work", 0)


def _describe(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            st = p.lstat()
            content = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            target = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            xattrs = {} if stat.S_ISLNK(st.st_mode) else {
                k: os.getxattr(p, k) for k in os.listxattr(p)}
            mtime = None if stat.S_ISDIR(st.st_mode) else st.st_mtime_ns
            out[str(p.relative_to(root))] = (st.st_mode, st.st_rdev, content, target, xattrs, mtime, st.st_nlink)
    return out


def test_delta_chain_round_trip_and_dedup(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    pages = b"".join(bytes([i]) * BLOCK for i in range(8))
    _tree(tmp_path / "a", pages)
    changed = bytearray(pages)
    changed[3 * BLOCK:4 * BLOCK] = b"\xff" * BLOCK
    _tree(tmp_path / "b", bytes(changed) + b"\x07" * BLOCK)  # one page changed, one more page
    (tmp_path / "b" / "fs" / "upper" / "root" / "new").write_text("new file")
    (tmp_path / "b" / "fs" / "upper" / "fifo").unlink()

    deltas = DeltaStore(store)
    ref_a, stored_a = deltas.save(tmp_path / "a", None)
    before = store.stats().bytes_written
    ref_b, _ = deltas.save(tmp_path / "b", ref_a)
    # The child stored only its changed page and the new file (plus its own delta document).
    new_blob_bytes = store.stats().bytes_written - before
    assert new_blob_bytes < stored_a
    delta_b = store.get_json(ref_b)
    assert delta_b["parent"] == ref_a
    assert delta_b["removed"] == ["fs/upper/fifo"]
    patch = delta_b["entries"]["images/pages-1.img"]["p"]
    assert patch.keys() == {"3", "8"}
    # The appended page has page 7's content: referenced, not stored again.
    assert patch["8"] == deltas.manifest(ref_a)["images/pages-1.img"]["c"][7]
    assert "fs/upper/root/file" not in delta_b["entries"]

    fresh = DeltaStore(store, manifests_kept=0)  # forces the rebuild from the chain on disk
    for ref, src in ((ref_a, "a"), (ref_b, "b")):
        out = tmp_path / f"restored-{src}"
        fresh.restore(ref, out)
        expect = _describe(tmp_path / src)
        del expect["images/dump.log"]
        assert _describe(out) == expect


def test_diff_apply_are_inverse(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    _tree(tmp_path / "a", b"\x01" * (3 * BLOCK))
    _tree(tmp_path / "b", b"\x02" * BLOCK)
    ma, mb = scan(tmp_path / "a", store), scan(tmp_path / "b", store)
    assert apply(ma, diff(ma, mb)) == mb
    assert apply(None, diff(None, ma)) == ma
    materialize(mb, store, tmp_path / "m")
    assert (tmp_path / "m" / "images" / "pages-1.img").read_bytes() == b"\x02" * BLOCK
