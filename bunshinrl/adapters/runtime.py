"""bunshinrl inside another framework's loop: one rollout core per process, tasks by name,
rollouts by trajectory.

verl builds each tool from its own YAML entry and runs one agent-loop object per sample; SkyRL
makes one env per trajectory. All of them must reach the same prefix cache, the same
speculator and the same workspaces, so they share a process-wide Runtime: a RolloutCore (cache,
speculator, guard), the tasks configs name, and the open rollouts by trajectory key. A
trajectory's Rollout is started on its first use and closed when its driver ends it, or, for a
driver that never says (verl's stock tool agent loop), once nobody has used it for
`linger_seconds`.

The invariant (a sample's workspace is exactly the history it was shown) meets drivers that
cannot cut their model's conversation back, so neither rewinds (RolloutEngine's answer to a
served step that did not reproduce): verl's agent loop re-rolls the trajectory on a second core
without the prefix cache (`start(..., cached=False)`); SkyRL's env runs with `validate_hits`:
every cache hit is re-executed on the sample's own workspace and compared before it is served
(the guard audits every hit), so nothing it is shown comes from another workspace.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._async import LoopThread, run_blocking
from ..calls.guard import DeterminismGuard
from ..calls.policy import SampleContext
from ..calls.task import REWARD_TOOL, Task
from ..prefix.cache import SnapshotPolicy
from ..rollout.core import Rollout, RolloutCore
from ..rollout.wiring import CoreConfig, build_core

# ---- tasks by name ----

_TASKS: dict[str, Task] = {}
_TASKS_LOCK = threading.Lock()


def register_task(task: Task) -> Task:
    """Make `task` known by its id to configs (verl's tool config, SkyRL's env_config)."""
    with _TASKS_LOCK:
        _TASKS[task.id] = task
    return task


def resolve_task(name: str, template: Mapping[str, Any] | None = None) -> Task:
    """The task a config names: a registered id, a "module:attribute" path (a Task, or a function
    returning one), or a task of the built-in GRPO suite. template: WorkspaceSpec fields the
    task's workspaces are created with (rootfs, memory_limit, network, ...)."""
    with _TASKS_LOCK:
        task = _TASKS.get(name)
    if task is None and ":" in name:
        module, _, attr = name.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        task = obj() if callable(obj) and not isinstance(obj, Task) else obj
        if not isinstance(task, Task):
            raise TypeError(f"{name} is a {type(task).__name__}, not a bunshinrl Task")
    if task is None:
        from ..training.tasks import suite

        with _TASKS_LOCK:
            for t in suite():
                _TASKS.setdefault(t.id, t)
            task = _TASKS.get(name)
    if task is None:
        with _TASKS_LOCK:
            known = ", ".join(sorted(_TASKS))
        raise KeyError(f"unknown task {name!r}; known: {known} (or give 'module:attribute')")
    return task.with_spec(**dict(template or {}))


# ---- the runtime ----


@dataclass(frozen=True)
class RuntimeConfig:
    """cache_mib: the prefix cache's resident budget (0: no cache); store: a directory for
    states evicted to disk (None: memory only); speculation_depth: calls per speculative chain
    (0: no speculation); slow_tool_seconds: only calls recorded at least this slow are chained
    after the first; refit_every: retrain the next-call selector after this many trajectories;
    validate_hits: a cache hit is served only once its call, run on the sample's own workspace,
    observed what was recorded (SkyRL's env sets it: see the module doc)."""

    cache_mib: int = 512
    store: str | None = None
    snapshot_every: int = 1
    snapshot_policy: SnapshotPolicy = "cost"
    speculation_depth: int = 2
    slow_tool_seconds: float = 0.0
    min_probability: float = 0.3
    refit_every: int = 16
    memory: str = "auto"
    linger_seconds: float = 60.0
    validate_hits: bool = False

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> RuntimeConfig:
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown bunshinrl runtime option(s) {unknown}; known: "
                            f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**values)


@dataclass
class _Open:
    rollout: Rollout
    last_used: float = field(default_factory=time.monotonic)


class Runtime:
    """One RolloutCore and the open rollouts, by trajectory key."""

    _shared: Runtime | None = None
    _shared_lock = threading.Lock()

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig()
        c = self.config
        # validate_hits: the guard audits every hit (Rollout re-executes it on the sample's
        # workspace and serves that fresh observation; a different one drops the tool's subtrees).
        guard = DeterminismGuard(audit_rate=1.0) if c.validate_hits else None
        self.core = build_core(CoreConfig(
            cache_bytes=c.cache_mib << 20, store=Path(c.store) if c.store else None,
            snapshot_policy=c.snapshot_policy, snapshot_every=c.snapshot_every,
            # No trainer's epoch boundary reaches the runtime: it persists as states come.
            persist_between_epochs=False, speculation_depth=c.speculation_depth,
            slow_tool_seconds=c.slow_tool_seconds, min_probability=c.min_probability, memory=c.memory), guard=guard)
        # Re-rolled trajectories run here: no prefix cache, no speculation, nothing served that
        # the trajectory's own workspace did not run. Made on the first re-roll.
        self._uncached: RolloutCore | None = None
        self._open: dict[str, _Open] = {}
        # The last trajectories ended, (key, rollout), for inspection (tests, debugging); metrics
        # go to the framework.
        self.finished: collections.deque[tuple[str, Rollout]] = collections.deque(maxlen=1024)
        self._lock = threading.Lock()
        self._since_fit = 0
        self._fitting: asyncio.Future[Any] | None = None
        self._thread: LoopThread | None = None
        self.closed = False

    @classmethod
    def shared(cls, config: RuntimeConfig | Mapping[str, Any] | None = None) -> Runtime:
        """The process-wide runtime, made with `config` on first use; asking for another config
        later is an error (two caches in one process would each miss what the other holds)."""
        cfg = config if isinstance(config, RuntimeConfig) or config is None else RuntimeConfig.from_mapping(config)
        with cls._shared_lock:
            if cls._shared is None or cls._shared.closed:
                cls._shared = cls(cfg)
            elif cfg is not None and cfg != cls._shared.config:
                raise ValueError(f"bunshinrl's runtime already runs with {asdict(cls._shared.config)}, "
                                 f"not {asdict(cfg)}")
            return cls._shared

    # ---- trajectories ----

    def get(self, key: str) -> Rollout | None:
        with self._lock:
            o = self._open.get(key)
            if o is not None:
                o.last_used = time.monotonic()
            return o.rollout if o is not None else None

    @property
    def uncached(self) -> RolloutCore:
        """The core re-rolled trajectories run on (without the prefix cache and speculation)."""
        with self._lock:
            if self._uncached is None:
                self._uncached = build_core(CoreConfig(persist_between_epochs=False, memory=self.config.memory))
            return self._uncached

    async def start(self, key: str, task: Task, *, group: str | None = None, sample: int = 0,
                    epoch: int = 0, cached: bool = True) -> Rollout:
        """The rollout of trajectory `key` (started on first use; the same one after that).
        cached=False: on the core without the prefix cache and speculation (a re-roll)."""
        r = self.get(key)
        if r is not None:
            if r.task.id != task.id:
                raise ValueError(f"trajectory {key!r} belongs to task {r.task.id!r}, not {task.id!r}")
            return r
        await self.reap()
        core = self.core if cached else self.uncached
        r = await core.start(task, SampleContext(task.id, sample, epoch, task.prompt), group=group)
        with self._lock:
            if key in self._open:  # a concurrent first use won: keep one rollout per trajectory
                other = self._open[key].rollout
            else:
                self._open[key] = _Open(r)
                other = None
        if other is not None:
            await r.close()
            return other
        return r

    async def end(self, key: str, answer: str | None = "") -> Rollout | None:
        """Finish trajectory `key` (its verifier scores the final state) and close it."""
        with self._lock:
            o = self._open.pop(key, None)
        if o is None:
            return None
        try:
            await o.rollout.finish(answer)
        finally:
            await o.rollout.close()
            self.finished.append((key, o.rollout))
            self._trajectory_done()
        return o.rollout

    async def discard(self, key: str) -> None:
        """Close trajectory `key` without scoring it."""
        with self._lock:
            o = self._open.pop(key, None)
        if o is not None:
            await o.rollout.close()
            self._trajectory_done()

    async def reap(self, now: float | None = None) -> list[str]:
        """Close trajectories nobody has used for linger_seconds; their keys."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [k for k, o in self._open.items() if now - o.last_used >= self.config.linger_seconds]
        for k in stale:
            await self.discard(k)
        return stale

    def live(self) -> list[str]:
        with self._lock:
            return sorted(self._open)

    def _trajectory_done(self) -> None:
        self._since_fit += 1
        if self.core.speculator is None or self._since_fit < self.config.refit_every:
            return
        if self._fitting is not None and not self._fitting.done():
            return
        self._since_fit = 0
        # Retrained off the loop: the rollouts go on with the old selector meanwhile.
        self._fitting = self.core.background(run_blocking(self.core.fit_selector))

    # ---- synchronous callers ----

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the runtime's own loop thread (for synchronous callers)."""
        with self._lock:
            if self._thread is None:
                self._thread = LoopThread()
            thread = self._thread
        return thread.run(coro, timeout)

    # ---- the end ----

    async def aclose(self) -> None:
        """Close every open trajectory, wait for background work, release the cache."""
        for k in self.live():
            await self.discard(k)
        await self.core.drain()
        if self._uncached is not None:
            await self._uncached.close()
        if self.core.cache is not None:
            await run_blocking(self.core.cache.close)
        self.closed = True

    def close(self) -> None:
        """aclose(), from synchronous code (on the runtime's loop when it has one)."""
        if self.closed:
            return
        if self._thread is not None:
            self.run(self.aclose())
            self._thread.close()
            self._thread = None
        else:
            asyncio.run(self.aclose())

    def stats(self) -> dict[str, Any]:
        return {**self.core.stats(), "open_trajectories": len(self.live())}


def plain(value: Any) -> dict[str, Any]:
    """A framework's config section (an omegaconf DictConfig, a mapping or None) as a dict."""
    if value is None:
        return {}
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(value, resolve=True)
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping, not {value!r}")
    return dict(value)


def task_options(config: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """(task name, workspace template) from an adapter's config."""
    name = config.get("task")
    if not name:
        raise ValueError("the config needs 'task': a task id or a 'module:attribute' path")
    template = config.get("template")
    if template is not None and not isinstance(template, Mapping):
        raise TypeError(f"'template' must be a mapping of WorkspaceSpec fields, not {template!r}")
    return str(name), dict(template) if template is not None else None


def rollout_metrics(r: Rollout) -> dict[str, Any]:
    """What a framework logs per trajectory: the agent's tool calls by what served them (run for
    real, skipped by the prefix cache, adopted from speculation, rejected before running),
    speculative branches rolled back, the verifier's reward, and the invariant's counters
    (replays that diverged, rewinds, re-rolls and their seconds: SampleTimeline.invariant)."""
    agent = [kind for s, kind in zip(r.history, r.served, strict=True) if s.call.name != REWARD_TOOL]
    return {"tool_calls": len(agent), "executed": agent.count("executed"), "cache_hits": agent.count("cache"),
            "spec_hits": agent.count("speculation"), "rejected": agent.count("rejected"),
            "spec_misses": r.timeline.count("spec_miss"), "reward": r.reward, "errors": len(r.timeline.errors),
            **r.timeline.invariant()}


def with_discarded_attempt(metrics: dict[str, Any], discarded: Rollout) -> dict[str, Any]:
    """A re-rolled trajectory's metrics (`metrics`, the scored attempt's) with the discarded
    attempt's divergences added, each counted by its outcome: what that attempt refused was
    re-rolled, so the sum of outcomes still equals the divergences (divergences_unaccounted)."""
    discarded.timeline.rerolled_by_framework()
    first = discarded.timeline.invariant()
    out = dict(metrics)
    for k, v in first.items():
        if k != "divergences_unaccounted":
            out[k] = round(out[k] + v, 3) if isinstance(v, float) else out[k] + v
    out["rerolled"] += 1
    out["divergences_unaccounted"] = out["divergences"] - sum(v for k, v in out.items() if k.startswith("outcome_"))
    return out


__all__ = ["Runtime", "RuntimeConfig", "plain", "register_task", "resolve_task", "rollout_metrics", "task_options",
           "with_discarded_attempt"]
