"""build_core: the one place that wires a prefix cache, a speculator and a rollout core together.

Every driver builds its core here (RolloutEngine, the GRPO trainer's configurations, the Ray
pool's hosts, verl's and SkyRL's runtime), so a change of policy (when states are captured,
when they are persisted, warm workspaces behind hits, where speculation runs) reaches them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..calls.guard import DeterminismGuard
from ..prefix.cache import SnapshotPolicy, ToolPrefixCache
from ..speculation.gate import MeasuredGate
from ..speculation.speculator import Placement, Speculator
from ..speculation.tail import TailPolicy
from ..states.backend import SnapshotBackend
from .core import RolloutCore
from .reasoning import ReasoningClock
from .warm_policy import WarmPolicy


@dataclass(frozen=True)
class CoreConfig:
    """cache_bytes: the prefix cache's resident budget (0: no cache); store: its directory for
    states on disk (None: a private one); snapshot_policy and the rest of the snapshot_* fields:
    ToolPrefixCache's; persist_between_epochs: persistence waits for the gap between epochs;
    speculation_depth: calls per speculative chain (0: no speculation); slow_tool_seconds:
    "measured" (the speculator's MeasuredGate weighs each chain from measured call, snapshot and
    rollback times and the selector's calibrated probabilities) or the TailPolicy's fixed rule
    (seconds; None: its tool quantile); task_quantile, online_real_calls: the TailPolicy's;
    prefetch: warm workspaces behind hits and the root prefetched; warm: behind which hits ("always",
    or "predicted": where the next call is predicted to miss; bunshinrl.rollout.warm_policy);
    keep_initial, overlap_fork:
    Base's parity with the cache's root;
    critical_path_captures: captures weigh the next reasoning step and expected revisits;
    verify_seconds: RolloutCore's (a finishing sample's wait for the replay behind its last hit);
    cache_share: the resident budget follows the rollouts' own workspaces, at every memory sample
    what they leave under this share of their highest level (bunshinrl.prefix.budget; None:
    cache_bytes throughout)."""

    cache_bytes: int = 0
    store: Path | None = None
    snapshot_policy: SnapshotPolicy = "cost"
    snapshot_every: int = 1
    snapshot_slower_than: float | None = None
    persist_between_epochs: bool = True
    speculation_depth: int = 0
    slow_tool_seconds: float | Literal["measured"] | None = "measured"
    min_probability: float = 0.5
    placement: Placement = "live"
    task_quantile: float = 0.0
    online_real_calls: int | None = None
    memory: str = "auto"
    prefetch: bool = True
    keep_initial: bool = False
    overlap_fork: bool = False
    critical_path_captures: bool = True
    verify_seconds: float | None = 300.0
    warm: WarmPolicy = "predicted"
    cache_share: float | None = None


def build_core(config: CoreConfig, *, guard: DeterminismGuard | None = None, reasoning: ReasoningClock | None = None,
               cache: ToolPrefixCache | None = None, speculator: Speculator | None = None,
               tail: TailPolicy | None = None) -> RolloutCore:
    """A RolloutCore with the cache and speculator `config` describes. cache, speculator and tail
    given here are used as they are instead (drivers that bring their own); they must share
    `guard` when one is given."""
    guard = guard or (cache.guard if cache is not None else None) or DeterminismGuard()
    if cache is None and config.cache_bytes > 0:
        cache = ToolPrefixCache(SnapshotBackend(config.store), config.cache_bytes, guard=guard,
                                snapshot_every=config.snapshot_every, snapshot_slower_than=config.snapshot_slower_than,
                                snapshot_policy=config.snapshot_policy,
                                persist_between_epochs=config.persist_between_epochs)
    if speculator is None and config.speculation_depth > 0:
        measured = config.slow_tool_seconds == "measured"
        fixed = None if isinstance(config.slow_tool_seconds, str) else config.slow_tool_seconds
        tail = tail or TailPolicy(slow_tool_seconds=fixed,
                                  task_quantile=config.task_quantile, online_real_calls=config.online_real_calls)
        speculator = Speculator(depth=config.speculation_depth, memory=config.memory, tail=tail,
                                min_probability=config.min_probability, placement=config.placement,
                                gate=MeasuredGate() if measured else None)
    return RolloutCore(cache=cache, speculator=speculator, guard=guard, tail=tail, memory=config.memory,
                       prefetch=config.prefetch, keep_initial=config.keep_initial, overlap_fork=config.overlap_fork,
                       reasoning=reasoning, critical_path_captures=config.critical_path_captures,
                       verify_seconds=config.verify_seconds, warm=config.warm,
                       cache_share=config.cache_share)


__all__ = ["CoreConfig", "build_core"]
