"""One configuration of the benchmark: its rollout core (built by build_core, as every
driver's), its agent and modelled server, and Full's trajectory auditor."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from agent_policy import AgentConfig, LatencyModel, Server, StochasticAgent, make_server

from bunshinrl import EpochResult, RolloutEngine, Speculator, Task, ToolPrefixCache
from bunshinrl.envs.faults import FaultAuditor, FaultGuard, KeyedPolicy
from bunshinrl.rollout.audit import TrajectoryAuditor, cache_roots
from bunshinrl.rollout.configs import CONFIGS as ENGINE_CONFIGS
from bunshinrl.rollout.configs import caches, check_config, speculates
from bunshinrl.rollout.reasoning import ReasoningClock
from bunshinrl.rollout.wiring import CoreConfig, build_core

DEFAULT_PLACEMENT = Speculator().placement
SNAPSHOT_POLICIES = ("depth", "cost")
DEFAULT_SNAPSHOT_POLICY = "cost"
# Full@eager: a warm workspace behind every hit (the core's warm="always"), beside Full's
# "predicted" (one only where the next call is predicted to miss; bunshinrl.rollout.warm_policy).
EAGER = "eager"

MiB = 1 << 20
CONFIGS = ("CRIU", *ENGINE_CONFIGS)  # CRIU: Base with its processes out of KSM (restored copies private)


@dataclasses.dataclass
class ConfigRun:
    name: str
    engine: RolloutEngine
    server: Server
    tasks: list[Task]
    cache: ToolPrefixCache | None
    auditor: TrajectoryAuditor | None = None  # Full's: --audit
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    results: list[EpochResult] = dataclasses.field(default_factory=list)


def make_config(name: str, tasks: list[Task], cands: dict[str, Any], agent_cfg: AgentConfig, model: LatencyModel,
                store: Path, cache_mib: int, spec_depth: int, slow_seconds: float | str, share: str = "ksm",
                regime: str = "local", rollouts: int = 1, audit: str = "off", seed: int = 0, faults: bool = False,
                auto_disable: bool = True, cache_share: float | None = None) -> ConfigRun:
    """name: one of CONFIGS, or Spec@PLACEMENT, Full@POLICY, Full@eager. The core is built by build_core, as
    every driver's is; its reasoning prediction is the latency model's step at the server's load.
    faults: the tasks' tools are faulty (--inject-faults): the agent's decisions and the audit run
    as their sample, which keys the faults; auto_disable False: the guard's is off (FaultGuard).
    regime: how the server prices a step (paper, local, batch); rollouts: the configuration's
    rollouts per epoch (the batch regime's N); cache_share: the cache's resident budget relative to
    the rollouts' measured workspace peak (CoreConfig's; --cache-share)."""
    kind, _, variant = name.partition("@")
    config = "Base" if kind == "CRIU" else check_config(kind)  # CRIU's parts are Base's
    eager = kind == "Full" and variant == EAGER
    if eager:
        variant = ""
    server: Server = make_server(model, regime, rollouts)
    cfg = CoreConfig(
        # Full: the cache captures by cost (a state when the replay it saves takes as long as a
        # capture), beside reasoning steps predicted to outlast a capture; Full@depth: every
        # other depth and every slow call.
        cache_bytes=cache_mib * MiB if caches(config) else 0, store=store / name,
        snapshot_policy=(variant or DEFAULT_SNAPSHOT_POLICY) if caches(config) else DEFAULT_SNAPSHOT_POLICY,  # type: ignore[arg-type]
        snapshot_every=2, snapshot_slower_than=1.0 if isinstance(slow_seconds, str) else slow_seconds,
        speculation_depth=spec_depth if speculates(config) else 0, slow_tool_seconds=slow_seconds,
        # Full speculates for every rollout (its siblings' real calls price the straggler's steps
        # in the batch regime; method note 2026-12-05 (2)); Spec for the slower half of the tasks.
        task_quantile=0.0 if caches(config) else 0.5, online_real_calls=2 if caches(config) else None,
        min_probability=0.5,
        placement=variant if kind == "Spec" and variant else DEFAULT_PLACEMENT,  # type: ignore[arg-type]
        memory="copy" if name == "CRIU" else share, keep_initial=True, overlap_fork=True,
        warm="always" if eager else "predicted", cache_share=cache_share if caches(config) else None)
    core = build_core(cfg, reasoning=ReasoningClock(model=lambda: server.predicted_step(agent_cfg.output_median)),
                      guard=None if auto_disable else FaultGuard())
    agent: Any = StochasticAgent(agent_cfg, server, cands)
    if faults:
        agent = KeyedPolicy(agent)
    # CRIU: processes stay out of KSM, so restored copies are really private.
    own = [t.with_spec(ksm=False) for t in tasks] if name == "CRIU" else tasks
    engine = RolloutEngine(agent, core=core)
    # The audit re-executes Full's trajectories from a fresh fork of the cache's root (the state
    # every sample started from): what caching and speculation served must be what a plain run sees.
    auditor = (FaultAuditor if faults else TrajectoryAuditor)(own, mode=audit, root=cache_roots(core), seed=seed) \
        if kind == "Full" and audit != "off" else None
    return ConfigRun(name, engine, server, own, core.cache, auditor)

