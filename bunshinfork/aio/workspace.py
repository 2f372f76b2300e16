"""AsyncWorkspace and AsyncSnapshot: Workspace and Snapshot for asyncio.

Commands, stdin and watches are asyncio-native (aio.commands, aio.files). Create, snapshot,
fork, pause and destroy are the fork pipeline (CRIU, mounts, cgroups), which has no
asynchronous form: they run on the pool (aio.pool), as do file reads and writes.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, TypeVar

from ..accounting import HostMemory
from ..commands import Conventions
from ..contract import Captured
from ..spec import WorkspaceSpec
from ..state import Timing
from ..workspace import MemoryStats, Snapshot, Workspace, WorkspaceInfo
from .commands import AsyncCommands, AsyncPty
from .files import AsyncFiles
from .pool import blocking

W = TypeVar("W", bound="AsyncWorkspace")


class AsyncWorkspace:
    """Workspace for asyncio (same methods, awaited)."""

    def __init__(self, ws: Workspace) -> None:
        self._ws = ws
        self.commands = AsyncCommands(ws)
        self.files = AsyncFiles(ws)
        self.pty = AsyncPty(ws, self.commands)

    @property
    def workspace(self) -> Workspace:
        """The synchronous object behind this one."""
        return self._ws

    @property
    def conventions(self) -> Conventions:
        return self._ws.conventions

    @classmethod
    async def create(cls: type[W], spec: WorkspaceSpec | None = None, *, timeout: float | None = None,
                     die_with_creator: bool = False, **overrides: Any) -> W:
        ws = await blocking(Workspace.create, spec, timeout=timeout, die_with_creator=die_with_creator, **overrides)
        return cls(ws)

    @classmethod
    async def connect(cls: type[W], ws_id: str) -> W:
        return cls(await blocking(Workspace.connect, ws_id))

    @staticmethod
    async def list() -> list[WorkspaceInfo]:
        return await blocking(Workspace.list)

    @property
    def id(self) -> str:
        return self._ws.id

    @property
    def init_pid(self) -> int:
        return self._ws.init_pid

    def live_init_pid(self) -> int:
        return self._ws.live_init_pid()

    def host_pids(self) -> list[int]:
        return self._ws.host_pids()

    async def is_running(self) -> bool:
        return self._ws.is_running()

    async def info(self) -> WorkspaceInfo:
        return self._ws.info()

    async def memory(self) -> MemoryStats:
        return await blocking(self._ws.memory)

    async def pause(self) -> None:
        await blocking(self._ws.pause)

    async def resume(self) -> None:
        await blocking(self._ws.resume)

    async def snapshot(self, memory: str = "auto", *, incremental: bool = True) -> AsyncSnapshot:
        return AsyncSnapshot(await blocking(self._ws.snapshot, memory, incremental=incremental))

    async def fork(self, count: int = 1, memory: str = "auto", *, timeout: float | None = None,
                   die_with_creator: bool = False) -> list[AsyncWorkspace | Exception]:
        out = await blocking(self._ws.fork, count, memory, timeout=timeout, die_with_creator=die_with_creator)
        return [r if isinstance(r, Exception) else type(self)(r) for r in out]

    async def set_timeout(self, timeout: float) -> None:
        await blocking(self._ws.set_timeout, timeout)

    async def set_egress(self, egress: dict[str, list[str]] | str | None) -> None:
        await blocking(self._ws.set_egress, egress)

    async def hold_egress(self) -> bool:
        return await blocking(self._ws.hold_egress)

    async def release_egress_hold(self) -> None:
        await blocking(self._ws.release_egress_hold)

    async def egress_refused(self) -> int:
        return await blocking(self._ws.egress_refused)

    async def destroy(self) -> None:
        await blocking(self._ws.destroy)

    async def __aenter__(self: W) -> W:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id}>"


class AsyncSnapshot:
    """Snapshot for asyncio: its properties as they are, what reads or writes its stores awaited."""

    layout = Snapshot.layout

    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap

    @property
    def snapshot(self) -> Snapshot:
        """The synchronous object behind this one."""
        return self._snap

    @classmethod
    async def take(cls, ws: Workspace | AsyncWorkspace, memory: str = "auto", *,
                   incremental: bool = True) -> AsyncSnapshot:
        """Snapshot.take for asyncio (see Workspace.snapshot)."""
        sync = ws.workspace if isinstance(ws, AsyncWorkspace) else ws
        return cls(await blocking(Snapshot.take, sync, memory, incremental=incremental))

    @classmethod
    async def load(cls, path: str | os.PathLike[str], memory: str | None = None) -> AsyncSnapshot:
        return cls(await blocking(Snapshot.load, path, memory))

    # ---- properties ----

    @property
    def captured(self) -> Captured:
        return self._snap.captured

    @property
    def id(self) -> str:
        return self._snap.id

    @property
    def source_id(self) -> str:
        return self._snap.source_id

    @property
    def dir(self) -> Path:
        return self._snap.dir

    @property
    def memory(self) -> str:
        return self._snap.memory

    @property
    def kind(self) -> str:
        return self._snap.kind

    @property
    def timing(self) -> Timing:
        return self._snap.timing

    @property
    def parent(self) -> str | None:
        return self._snap.parent

    @property
    def images_dir(self) -> Path:
        return self._snap.images_dir

    @property
    def rootfs_digest(self) -> str:
        return self._snap.rootfs_digest

    async def image_bytes(self) -> int:
        return await blocking(self._snap.image_bytes)

    async def retained_bytes(self) -> int:
        return await blocking(self._snap.retained_bytes)

    async def host_memory(self) -> HostMemory:
        return await blocking(self._snap.host_memory)

    # ---- forking and durability ----

    async def fork(self, count: int = 1, memory: str | None = None, *, timeout: float | None = None,
                   die_with_creator: bool = False) -> list[AsyncWorkspace | Exception]:
        out = await blocking(self._snap.fork, count, memory, timeout=timeout, die_with_creator=die_with_creator)
        return [r if isinstance(r, Exception) else AsyncWorkspace(r) for r in out]

    async def save(self, path: str | os.PathLike[str], *, incremental: bool = False) -> str:
        """Snapshot.save, awaited to its end: the path written."""
        return await asyncio.wrap_future(await blocking(self._snap.save, path, incremental=incremental))

    async def release(self) -> None:
        await blocking(self._snap.release)

    async def __aenter__(self) -> AsyncSnapshot:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    def __repr__(self) -> str:
        return f"<AsyncSnapshot {self.id}>"
