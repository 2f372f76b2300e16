"""The host memory of a configuration's workspaces and snapshots, sampled over an epoch."""

from __future__ import annotations

import threading
import time
from typing import Any

from bunshinfork import BunshinError, host_memory
from bunshinrl import RolloutEngine


class HostSampler:
    """Every `interval` s: what the configuration's workspaces and snapshots cost the host
    (bunshinfork.host_memory: anon, shmem, page cache, kernel, snapshot stores)."""

    def __init__(self, engine: RolloutEngine, interval: float = 0.5) -> None:
        self.engine = engine
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _snapshots(self) -> list[Any]:
        core = self.engine.core
        snaps = [s.snap for s in core.kept_snapshots()]
        if core.cache is not None:
            snaps += [n.payload.snap for n in list(core.cache.lru.resident) if n.payload is not None]
        return snaps

    def measure(self) -> int | None:
        for _ in range(3):  # a workspace or snapshot may go while it is read
            try:
                return host_memory(self.engine.core.all_workspaces(), self._snapshots()).total
            except (BunshinError, OSError):
                continue
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            b = self.measure()
            if b is not None:
                self.samples.append((time.monotonic() - self.t0, b))
            self._stop.wait(self.interval)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples

