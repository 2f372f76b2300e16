"""The prefix cache's resident budget following the rollouts' own workspaces (issue 38).

The target it serves: the host's peak with the cache within `share` of its peak without one.
Without copy-on-write between a cached state and the workspaces (ksm's snapshots are CRIU images
on tmpfs), a cached byte costs the host a byte, so the cache may only hold what the workspaces
leave under `share` x the highest level they have reached: little while they stand at their
highest (the first epoch, every rollout cold), more as they shrink (later epochs' hits skip work,
forks share), everything up to the cache's own ceiling in the gap between epochs, when they are
gone. A budget fixed per epoch cannot hold it: the first epoch fills the cache while its
workspaces peak, and a later epoch's workspaces are not the last one's.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import ToolPrefixCache


class ResidentBudget:
    """observe(workspace_bytes) at every memory sample of an epoch (the engine's sampler) sets the
    cache's budget to min(ceiling, roots + share x peak - workspace_bytes), peak the highest
    level seen, roots the tasks' initialized states (held over budget until on disk, evicted
    last), and evicts at once what no longer fits and has a copy on disk; what has none goes at
    the next capture, the cache's deferred persists flushed for it (ToolPrefixCache.attach). A
    change smaller than `step` x ceiling is not applied, so that a sample's noise does not resize
    the cache at every sample."""

    def __init__(self, cache: ToolPrefixCache, share: float, step: float = 1 / 64) -> None:
        if share < 0:
            raise ValueError(f"share must be >= 0, not {share}")
        self.cache = cache
        self.share = share
        self.ceiling = int(cache.lru.capacity)
        self.step = max(1, int(step * self.ceiling))
        self.peak = 0
        self.lowest = self.ceiling  # the smallest budget applied: the hit-rate cost's measure
        self._lock = threading.Lock()

    def budget(self, workspace_bytes: int) -> int:
        """The budget at this level of the workspaces (the peak updated first), above the tasks'
        roots: every sample starts from its task's root, and Base keeps those states too."""
        self.peak = max(self.peak, workspace_bytes)
        headroom = max(0, int(self.share * self.peak) - workspace_bytes)
        return min(self.ceiling, self.cache.lru.root_bytes + headroom)

    def observe(self, workspace_bytes: int) -> None:
        with self._lock:  # samples of overlapping epochs' samplers apply in order
            target = self.budget(workspace_bytes)
            now = self.cache.lru.capacity
            if target == now or (abs(target - now) < self.step and target not in (0, self.ceiling)):
                return
            self.lowest = min(self.lowest, target)
            self.cache.set_capacity(target)

    def stats(self) -> dict[str, int | float]:
        return {"share": self.share, "workspace_peak_bytes": self.peak, "budget_bytes": int(self.cache.lru.capacity),
                "lowest_budget_bytes": self.lowest}
