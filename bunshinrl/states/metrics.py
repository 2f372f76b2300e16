"""Sampling the memory of every live workspace of a rollout over time."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable

from bunshinfork import BunshinError, Workspace

from .._async import run_blocking


class WorkspaceRegistry:
    """Workspaces a rollout holds right now; destroyed ones drop out when next sampled."""

    def __init__(self) -> None:
        self._ws: dict[str, Workspace] = {}
        self._lock = threading.Lock()

    def add(self, ws: Workspace) -> Workspace:
        with self._lock:
            self._ws[ws.id] = ws
        return ws

    def discard(self, ws: Workspace) -> None:
        with self._lock:
            self._ws.pop(ws.id, None)

    def snapshot(self) -> list[Workspace]:
        with self._lock:
            return list(self._ws.values())


def workspace_bytes(workspaces: Iterable[Workspace]) -> int:
    """Summed PSS: pages shared between forks (KSM-merged or copy-on-write) count once overall."""
    total = 0
    for ws in workspaces:
        with contextlib.suppress(BunshinError, OSError):
            if ws.is_running():
                total += ws.memory().pss
    return total


class MemorySampler:
    """Every `interval` seconds: (seconds since start, workspace PSS, extra bytes such as the
    prefix cache's resident snapshots)."""

    def __init__(self, sources: Callable[[], Iterable[Workspace]], extra: Callable[[], int] = lambda: 0,
                 interval: float = 0.25, observe: Callable[[int], None] | None = None) -> None:
        self._sources = sources
        self._extra = extra
        self._observe = observe  # told each sample's workspace bytes (the cache's ResidentBudget)
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval)

    async def sample(self) -> None:
        ws_bytes = await run_blocking(workspace_bytes, list(self._sources()))
        if self._observe is not None:
            await run_blocking(self._observe, ws_bytes)
        self.samples.append((time.monotonic() - self._t0, ws_bytes, self._extra()))

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[tuple[float, int, int]]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.sample()
        return self.samples
