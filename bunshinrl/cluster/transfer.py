"""Snapshots between a pool's hosts (replication): a saved copy of a snapshot as the bytes of
its tar, for Ray's object store, or as a directory on a filesystem every host reads, and its
load on the other side. Each returns the bytes it moved, for the host's counters."""

from __future__ import annotations

import io
import secrets
import shutil
import tarfile
import tempfile
from pathlib import Path

from bunshinfork import Snapshot
from bunshinfork.hosts import state_root, tree_bytes

from .._async import run_blocking
from ..states.backend import SharedSnapshot


async def save_snapshot(snap: Snapshot, shared_dir: str | None) -> tuple[bytes | str, int]:
    """(the saved copy, its bytes): with shared_dir, a directory there; otherwise a tar's bytes."""
    if shared_dir is not None:
        dest = Path(shared_dir) / f"{snap.id}-{secrets.token_hex(4)}"
        await run_blocking(lambda: snap.save(dest).result())
        return str(dest), tree_bytes(dest)
    with tempfile.TemporaryDirectory(dir=state_root()) as tmp:
        await run_blocking(lambda: snap.save(Path(tmp) / "s").result())
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(Path(tmp) / "s", arcname="s")
    data = buf.getvalue()
    return data, len(data)


async def load_snapshot(saved: bytes | str) -> tuple[SharedSnapshot, int]:
    """(the snapshot save_snapshot's copy holds, loaded here; the bytes read)."""
    if isinstance(saved, bytes):
        dest = state_root() / f"import-{secrets.token_hex(6)}"
        try:
            with tarfile.open(fileobj=io.BytesIO(saved), mode="r") as tar:
                await run_blocking(tar.extractall, dest)  # written by a host actor of this pool
            snap = await run_blocking(Snapshot.load, dest / "s")
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return SharedSnapshot(snap, owned_dir=dest), len(saved)
    dest = Path(saved)
    snap = await run_blocking(Snapshot.load, dest)
    return SharedSnapshot(snap, owned_dir=dest), tree_bytes(dest)
