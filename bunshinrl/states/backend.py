"""Workspace states as retained bunshinfork snapshots, in memory and as on-disk deltas."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from bunshinfork import AsyncSnapshot, AsyncWorkspace, Snapshot, Workspace

from .._async import run_blocking
from .delta import DeltaStore
from .store import BlobStore

P = TypeVar("P")


@dataclass(frozen=True)
class Persisted:
    ref: str
    stored_bytes: int  # what this state added to the store (its delta)
    logical_bytes: int  # what a restore reads back


class StateBackend(Protocol, Generic[P]):
    """What the prefix cache needs from a state representation. `P` is a resident state. fork
    may be a coroutine function (awaited on the event loop) or a sync one (run on a thread)."""

    @property
    def persists(self) -> bool: ...
    def size(self, payload: P) -> int: ...
    def fork(self, payload: P) -> Workspace | Awaitable[Workspace]: ...
    def release(self, payload: P) -> None: ...
    def persist(self, payload: P, parent_ref: str | None) -> Persisted: ...
    def load(self, ref: str) -> P: ...


class SharedSnapshot:
    """A retained Snapshot with reference counting, so the prefix cache and a speculative branch
    can both fork from one post-call capture; the last release() releases it."""

    def __init__(self, snap: Snapshot, owned_dir: Path | None = None) -> None:
        self.snap = snap
        self._owned_dir = owned_dir  # a directory restored from disk, removed with the snapshot
        self._refs = 1
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """Measured now: a cow snapshot grows as its source writes pages it shared."""
        return self.snap.retained_bytes()

    def acquire(self) -> SharedSnapshot:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError(f"{self.snap} was already released")
            self._refs += 1
        return self

    def _drop(self) -> bool:
        with self._lock:
            self._refs -= 1
            return self._refs == 0

    def release(self) -> None:
        if self._drop():
            self.snap.release()
            if self._owned_dir is not None:
                shutil.rmtree(self._owned_dir, ignore_errors=True)

    async def release_async(self) -> None:
        """release() from the event loop, through bunshinfork's AsyncSnapshot."""
        if self._drop():
            await AsyncSnapshot(self.snap).release()
            if self._owned_dir is not None:
                await run_blocking(shutil.rmtree, self._owned_dir, ignore_errors=True)

    @property
    def memory(self) -> str:
        """The memory engine it was captured for; every fork of it uses that engine."""
        return self.snap.memory

    def fork(self, memory: str | None = None) -> Workspace:
        """A clone, with the engine the state was captured for (or one that restores the same
        capture: see Snapshot.fork)."""
        out = self.snap.fork(1, memory)[0]
        if isinstance(out, Exception):
            raise out
        return out

    async def fork_async(self, memory: str | None = None) -> Workspace:
        """fork() from the event loop, through bunshinfork's AsyncSnapshot."""
        out = (await self.fork_many_async(1, memory))[0]
        if isinstance(out, Exception):
            raise out
        return out

    async def fork_many_async(self, count: int, memory: str | None = None) -> list[Workspace | Exception]:
        """`count` clones, each a Workspace or the Exception its fork failed with (Snapshot.fork)."""
        return [r if isinstance(r, Exception) else r.workspace
                for r in await AsyncSnapshot(self.snap).fork(count, memory)]

    @classmethod
    def take(cls, ws: Workspace, memory: str = "auto", incremental: bool = True) -> SharedSnapshot:
        """Capture `ws`; its forks use the memory engine chosen here. An incremental state (the
        default) stores only what differs from the state `ws` was forked from, and that is
        what it costs the cache (Workspace.snapshot)."""
        return cls(ws.snapshot(memory, incremental=incremental))

    @classmethod
    async def take_async(cls, ws: Workspace, memory: str = "auto", incremental: bool = True) -> SharedSnapshot:
        """take() from the event loop, through bunshinfork's AsyncWorkspace."""
        return cls((await AsyncWorkspace(ws).snapshot(memory, incremental=incremental)).snapshot)


class SnapshotBackend:
    """Resident states are SharedSnapshots; on-disk states are delta chains in a blob store.

    A state forks with the memory engine it was captured with (a state read back from disk:
    the same engine where its images serve it), so the backend takes no engine of its own.
    A state whose snapshot is a delta against one this backend has stored (Snapshot.parent) is
    stored as that delta: only its own pages are read and hashed."""

    def __init__(self, store_dir: str | os.PathLike[str] | None = None) -> None:
        self.deltas = DeltaStore(BlobStore(Path(store_dir) / "blobs")) if store_dir is not None else None
        self._scratch = Path(store_dir) / "scratch" if store_dir is not None else None
        self._stored: dict[str, str] = {}  # snapshot id -> the reference of its stored copy

    @property
    def persists(self) -> bool:
        return self.deltas is not None

    def size(self, payload: SharedSnapshot) -> int:
        return payload.bytes

    async def fork(self, payload: SharedSnapshot) -> Workspace:
        return await payload.fork_async()

    def release(self, payload: SharedSnapshot) -> None:
        payload.release()

    def persist(self, payload: SharedSnapshot, parent_ref: str | None) -> Persisted:
        assert self.deltas is not None and self._scratch is not None
        self._scratch.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self._scratch, prefix="save-"))
        snap = payload.snap
        images_parent = self._stored.get(snap.parent) if snap.parent is not None else None
        try:
            saved = snap.save(tmp / "s", incremental=images_parent is not None).result()
            ref, stored = self.deltas.save(saved, parent_ref, images_parent=images_parent)
            self._stored[snap.id] = ref
            return Persisted(ref, stored, self.deltas.delta_bytes(ref))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, ref: str) -> SharedSnapshot:
        assert self.deltas is not None and self._scratch is not None
        dest = self._scratch / f"load-{secrets.token_hex(6)}"
        try:
            self.deltas.restore(ref, dest)
            return SharedSnapshot(Snapshot.load(dest), owned_dir=dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
