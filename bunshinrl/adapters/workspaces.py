"""Workspaces per trajectory, forked from one initialized workspace per task.

What the adapters share: whatever calls come in (verl tool instances, SkyRL envs), a trajectory
owns one workspace, and every trajectory of a task is a fork of that task's initialized state,
so a GRPO group shares its memory the way RolloutEngine's groups do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bunshinfork import Workspace

from .._async import run_blocking
from ..backend import SharedSnapshot

if TYPE_CHECKING:
    from ..grpo.tasks import VerifiableTask


@dataclass
class _Entry:
    ws: Workspace
    task_id: str
    refs: int = 0
    idle_since: float | None = None


class TrajectoryWorkspaces:
    """key -> workspace. acquire() counts a user; release() uncounts it and, once nobody holds the
    trajectory for `linger_seconds`, reap() destroys it. finish() and close() destroy at once."""

    _shared: TrajectoryWorkspaces | None = None
    _shared_lock = threading.Lock()

    def __init__(self, tasks: Iterable[VerifiableTask] | Mapping[str, VerifiableTask] | None = None, *,
                 memory: str = "auto", linger_seconds: float = 60.0) -> None:
        self._tasks: dict[str, VerifiableTask] = {}
        if tasks is not None:
            for t in tasks.values() if isinstance(tasks, Mapping) else tasks:
                self.register(t)
        self.memory = memory
        self.linger_seconds = linger_seconds
        self._templates: dict[str, SharedSnapshot] = {}
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self.forks = 0

    @classmethod
    def shared(cls) -> TrajectoryWorkspaces:
        """The process-wide pool: verl builds each tool from its own config, and all tools of one
        trajectory must still act on one workspace."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def register(self, task: VerifiableTask) -> None:
        self._tasks[task.id] = task

    def task(self, task_id: str) -> VerifiableTask:
        if task_id not in self._tasks:
            from ..grpo.tasks import suite

            for t in suite():
                self._tasks.setdefault(t.id, t)
        try:
            return self._tasks[task_id]
        except KeyError:
            raise KeyError(f"unknown task {task_id!r}; known: {', '.join(sorted(self._tasks))}") from None

    def _template(self, task_id: str) -> SharedSnapshot:
        with self._lock:
            snap = self._templates.get(task_id)
        if snap is not None:
            return snap
        task = self.task(task_id)
        ws = Workspace.create(**task.spec)
        try:
            task.setup(ws)
            snap = SharedSnapshot.take(ws, self.memory)
        finally:
            ws.destroy()
        with self._lock:
            if task_id in self._templates:  # another thread won the race; keep one template
                snap.release()
                return self._templates[task_id]
            self._templates[task_id] = snap
            return snap

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    # ---- synchronous core ----

    def acquire_sync(self, key: str, task_id: str) -> Workspace:
        """The trajectory's workspace (forked on first use), counted as held until release."""
        self.reap_sync()
        with self._key_lock(key):
            with self._lock:
                e = self._entries.get(key)
            if e is None:
                ws = self._template(task_id).fork()
                e = _Entry(ws, task_id)
                with self._lock:
                    self._entries[key] = e
                    self.forks += 1
            elif e.task_id != task_id:
                raise ValueError(f"trajectory {key!r} belongs to task {e.task_id!r}, not {task_id!r}")
            with self._lock:
                e.refs += 1
                e.idle_since = None
            return e.ws

    def release_sync(self, key: str) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return
            e.refs = max(0, e.refs - 1)
            if e.refs == 0:
                e.idle_since = time.monotonic()

    def finish_sync(self, key: str) -> None:
        """The trajectory is over: destroy its workspace now."""
        with self._lock:
            e = self._entries.pop(key, None)
            self._key_locks.pop(key, None)
        if e is not None:
            e.ws.destroy()

    def reap_sync(self, now: float | None = None) -> list[str]:
        """Destroy trajectories nobody has held for linger_seconds; their keys."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [k for k, e in self._entries.items()
                     if e.refs == 0 and e.idle_since is not None and now - e.idle_since >= self.linger_seconds]
        for k in stale:
            self.finish_sync(k)
        return stale

    def close_sync(self) -> None:
        """Destroy every workspace and release every template."""
        with self._lock:
            keys = list(self._entries)
        for k in keys:
            self.finish_sync(k)
        with self._lock:
            templates, self._templates = list(self._templates.values()), {}
        for s in templates:
            s.release()

    def get(self, key: str) -> Workspace | None:
        with self._lock:
            e = self._entries.get(key)
            return e.ws if e is not None else None

    def live(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    # ---- asyncio front ----

    async def acquire(self, key: str, task_id: str) -> Workspace:
        return await run_blocking(self.acquire_sync, key, task_id)

    async def release(self, key: str) -> None:
        self.release_sync(key)

    async def finish(self, key: str) -> None:
        await run_blocking(self.finish_sync, key)

    async def aclose(self) -> None:
        await run_blocking(self.close_sync)
