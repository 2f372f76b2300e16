"""BunshinRL's rollout configurations on real agent workspaces (paper sections 5.2-5.3, Figs. 6-11).

python benchmarks/agent_rollouts.py [--quick] --out DIR [--seeds 3 | --seed S] [--families code,shop]
                                    [--regime paper|local] [--exploration decaying|constant]
                                    [--placements live,fork_first] [--snapshot-policies cost,depth]
                                    [--audit all|sample|off] [--check-families]
python benchmarks/agent_rollouts.py --merge DIR0 DIR1 DIR2 --out DIR   (per-seed runs -> one result)

The headline (docs/rl_rollouts_method.md), fixed before any run: --regime paper (every step
priced with the paper's 128 requests in flight on one H100: the model's table stops at 64, so
tpot is its linear extrapolation, ~95 ms per output token, ~11 s per step), code + shop + gui x
G=8 (24 rollouts per epoch), 5 epochs, seeds 0-2 (one --seed each, then --merge), exploration
0.16, 0.12, 0.08, 0.06, 0.04; Base and Full every seed and epoch, Spec and CRIU at seed 0 in
epochs 1-2 only (--short-configs, --short-epochs). Beside it: --exploration constant (0.08) at
seed 0 and --regime local (this configuration's own requests in flight, ~0.9 s steps) at seed 0.

Tasks (each with a verifier that reads the final workspace):
  code   bunshinrl.envs.coding: a C project with a bug; `build` and `run_tests` are real gcc/make
         runs (seconds each), the reward reads build/test.log
  shop   bunshinrl.envs.webshop: PostgreSQL + the shop + headless Chromium; search, add to cart,
         check out; the reward reads the orders in SQL
  gui    bunshinrl.envs.gui: the X11 desktop (Xvfb + openbox + Mousepad); find and focus the
         editor, replace the text, save, check the title; the reward reads the saved file
The agent (benchmarks/agent_policy.py) is closed-loop: its candidates come from what it observed;
its reasoning time comes from the documented GPU-server latency model, printed before the run.

Configurations, interleaved within every seed (each epoch runs every configuration in turn,
the order rotating per epoch), each with its own engine kept across epochs:
  CRIU  every fork a private copy (memory="copy", processes not opted into KSM)
  Base  memory sharing only (--share-engine: ksm on this host, cow in a guest with the module)
  Spec  Base + speculative tool execution (selector retrained after every epoch)
  Full  Base + the tool-prefix cache + speculation
  Spec@P  with --placements: Spec with the speculator's chain placed by P (live: in the sample's
        workspace, forking on a mismatch; fork_first: in a fork, the sample's workspace kept for
        the real call); "Spec" and "Full" use the speculator's default placement
  Full@S  with --snapshot-policies: Full whose cache captures states by policy S (depth: every
        other depth and every slow call; cost: when the replay a capture saves takes as long as
        a capture, measured); "Full" uses cost
Parity: every configuration keeps its initialized task snapshots across epochs (Full in its
cache's root, the others through keep_initial) and forks while the first step is reasoned
(overlap_fork; Full's prefetch of its root). epoch_seconds ends when the last rollout finishes
(the paper's epoch); the teardown after it and the cache's persistence (deferred to the gap
between epochs, the trainer's update phase) are reported beside it, and persistence is waited
for before the next epoch starts, so it is shown done before the next epoch needs it.
The trajectory audit (--audit; all in the headline, sample in --quick and CI): after every epoch of a
Full configuration, each sample's history (all, or one per task) is re-executed from the task's
root in a fresh fork (bunshinrl.rollout.audit), every observation it was shown and its reward
compared; it runs in the gap between epochs, outside epoch_seconds. Its result per epoch is the
row's `audit` (audited, passed, mismatches, not_auditable, errors, seconds, the failing samples).
--check-families runs check_family (bunshinrl.calls.determinism) on each task first: the agent's
first candidate calls, each in two forks of the initial state (per seed: check_family).
Hit rates count the agents' tool calls only (the hidden verifier call is none); a call served by
waiting for a sibling's running call is counted apart (sibling_waits) and is no hit.

DIR/agent_rollouts.json: per configuration and seed epoch_seconds, oracle_seconds (the longest
rollout's reasoning alone), hit_rate_per_epoch (cache and speculation split), peak_memory_bytes
(host-cost accounting of the configuration's workspaces and snapshots, sampled over the epoch),
reward_per_epoch, phases_per_epoch (where each epoch's time went: the seconds per event kind of
the rollout that finished last and of all rollouts, and the time after the last rollout);
rewards_identical across Base, Spec and Full; summary: per configuration the
mean and spread over seeds; placements: epoch time and peak memory per speculation placement;
snapshot_policies: the same (and captures) per prefix-cache snapshot policy;
the targets with what was reached. --seed S runs one seed (a run short enough to hold the host
lock for); --merge combines such runs' JSONs into one, figures included.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_policy import (
    DEFAULT_LATENCY,
    EXPLORATION,
    EXPLORATION_SOURCE,
    PAPER_IN_FLIGHT,
    AgentConfig,
    LatencyModel,
    Server,
    StochasticAgent,
    coding_candidates,
    gui_candidates,
    shop_candidates,
)

from bunshinfork import BunshinError, host_memory
from bunshinrl import (
    EpochResult,
    RolloutEngine,
    Speculator,
    Task,
    ToolCall,
    ToolPrefixCache,
    check_family_async,
)
from bunshinrl.envs import coding, gui, webshop
from bunshinrl.envs.faults import FaultAuditor, FaultGuard, KeyedPolicy, inject_faults
from bunshinrl.rollout.audit import AUDIT_MODES, TrajectoryAuditor, cache_roots
from bunshinrl.rollout.configs import CONFIGS as ENGINE_CONFIGS
from bunshinrl.rollout.configs import caches, check_config, speculates
from bunshinrl.rollout.reasoning import ReasoningClock
from bunshinrl.rollout.timeline import DIVERGENCE_KINDS, DIVERGENCE_OUTCOMES
from bunshinrl.rollout.wiring import CoreConfig, build_core
from bunshinrl.speculation.speculator import PLACEMENTS

DEFAULT_PLACEMENT = Speculator().placement
SNAPSHOT_POLICIES = ("depth", "cost")
DEFAULT_SNAPSHOT_POLICY = "cost"

MiB = 1 << 20
CONFIGS = ("CRIU", *ENGINE_CONFIGS)  # CRIU: Base with its processes out of KSM (restored copies private)
SHOP_ORDERS = ({"MUG-BLU": 2, "TEA-GRN": 1}, {"TEA-GRN": 1}, {"MUG-BLU": 1})
GUI_TARGETS = ("Meeting moved to Friday 10:00", "Ship it on Friday", "Lunch at noon in room 4")
FAMILIES = ("code", "shop", "gui")
REGIMES = {"paper": PAPER_IN_FLIGHT, "local": None}  # requests in flight a step is priced with
# The headline's size, fixed before any run (the issue: >= 16 rollouts per epoch, G >= 8, 5 epochs,
# seeds 0-2; Spec and CRIU at seed 0 in epochs 1-2).
HEADLINE = {"families": "code,shop,gui", "code_tasks": 1, "group_size": 8, "epochs": 5, "seeds": 3, "rollouts": 24,
            "regime": "paper", "exploration": "decaying", "short_configs": "CRIU,Spec", "short_epochs": 2,
            "short_seeds": "0", "audit": "all"}
QUICK = {"families": "code,shop", "code_tasks": 1, "group_size": 3, "epochs": 3, "seeds": 1, "regime": "local",
         "exploration": "decaying", "short_configs": "CRIU,Spec", "short_epochs": 2, "short_seeds": "0",
         "audit": "sample"}
PAPER_ROLLOUTS_PER_THREAD = 2  # the paper's host: 128 rollouts on 64 hardware threads
GUI_HELP = "/root/Desktop/help.html"
GUI_HELP_PAGE = ("<html><head><title>Editor help</title></head><body><h1>Editing notes</h1>"
                 "<p>Start the editor, select all (ctrl+a), type the new text and save with ctrl+s.</p>"
                 + "<p>" + "Notes are plain text files. " * 400 + "</p></body></html>")


# ---- tasks ----

def build_tasks(families: list[str], seed: int, code_tasks: int) -> tuple[list[Task], dict[str, Any]]:
    tasks: list[Task] = []
    cands: dict[str, Any] = {}
    if "code" in families:
        for i in range(code_tasks):
            t = coding.make_env(seed * 100 + i)
            tasks.append(t)
            cands[t.id] = coding_candidates
    if "shop" in families:
        items = SHOP_ORDERS[seed % len(SHOP_ORDERS)]
        t = dataclasses.replace(webshop.make_env(items=items), id=f"shop-{seed}")
        tasks.append(t)
        cands[t.id] = shop_candidates(items, webshop.DEFAULT_NAME, webshop.DEFAULT_ADDRESS)
    if "gui" in families:
        # The agent starts the editor itself (an application start) or first reads the help page
        # in Chromium (a page load): tools that take real time, as OSWorld's do.
        target = GUI_TARGETS[seed % len(GUI_TARGETS)]
        t = dataclasses.replace(gui.make_env(target=target, apps=(), files={GUI_HELP: GUI_HELP_PAGE}),
                                id=f"gui-{seed}")
        tasks.append(t)
        cands[t.id] = gui_candidates(target, launch=True, help_page=GUI_HELP)
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown task families {sorted(unknown)}; use {', '.join(FAMILIES)}")
    return tasks, cands


# ---- host memory over an epoch ----

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


# ---- one configuration ----

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
                store: Path, cache_mib: int, spec_depth: int, slow_seconds: float, share: str = "ksm",
                in_flight: int | None = None, audit: str = "off", seed: int = 0, faults: bool = False,
                auto_disable: bool = True) -> ConfigRun:
    """name: one of CONFIGS, or Spec@PLACEMENT, Full@POLICY. The core is built by build_core, as
    every driver's is; its reasoning prediction is the latency model's step at the server's load.
    faults: the tasks' tools are faulty (--inject-faults): the agent's decisions and the audit run
    as their sample, which keys the faults; auto_disable False: the guard's is off (FaultGuard)."""
    kind, _, variant = name.partition("@")
    config = "Base" if kind == "CRIU" else check_config(kind)  # CRIU's parts are Base's
    server = Server(model, in_flight)
    cfg = CoreConfig(
        # Full: the cache captures by cost (a state when the replay it saves takes as long as a
        # capture), beside reasoning steps predicted to outlast a capture; Full@depth: every
        # other depth and every slow call.
        cache_bytes=cache_mib * MiB if caches(config) else 0, store=store / name,
        snapshot_policy=(variant or DEFAULT_SNAPSHOT_POLICY) if caches(config) else DEFAULT_SNAPSHOT_POLICY,  # type: ignore[arg-type]
        snapshot_every=2, snapshot_slower_than=slow_seconds,
        speculation_depth=spec_depth if speculates(config) else 0, slow_tool_seconds=slow_seconds,
        task_quantile=0.5, online_real_calls=2 if caches(config) else None, min_probability=0.5,
        placement=variant if kind == "Spec" and variant else DEFAULT_PLACEMENT,  # type: ignore[arg-type]
        memory="copy" if name == "CRIU" else share, keep_initial=True, overlap_fork=True)
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


PHASES = ("setup", "reason", "tool", "cache_hit", "sibling_wait", "audit", "materialize", "post_wait", "spec_hit",
          "spec_miss")


def phases(r: EpochResult, epoch_seconds: float) -> dict[str, Any]:
    """Where an epoch's time went: per event kind, the seconds of the rollout that finished last
    (the critical path) and the sum over all rollouts, and the time after the last rollout
    (teardown; the cache's persistence is reported apart)."""
    if not r.samples:
        return {}
    last = max(r.samples, key=lambda t: t.finished)
    return {
        "critical_path": {k: round(last.seconds(k), 3) for k in PHASES},
        "critical_path_calls": {"real": last.count("tool"), "cache_hits": last.count("cache_hit"),
                                "spec_hits": last.count("spec_hit")},
        "all_rollouts": {k: round(sum(t.seconds(k) for t in r.samples), 3) for k in PHASES},
        "after_last_rollout": round(epoch_seconds - r.seconds, 3),
    }


async def run_epoch(run: ConfigRun, group: int, epoch: int) -> dict[str, Any]:
    sampler = HostSampler(run.engine)
    sampler.start()
    t0 = time.monotonic()
    try:
        r = await run.engine.run_epoch(run.tasks, group, epoch)
    finally:
        memory = sampler.stop()
    wall = time.monotonic() - t0
    # The gap between epochs (the trainer's update phase): the cache's persistence runs there,
    # and is done before the next epoch starts.
    tp = time.monotonic()
    persist = await run.engine.persistence()
    persist_wait = time.monotonic() - tp
    if run.engine.speculator is not None:
        run.engine.fit_selector()
    audit = (await run.auditor.audit(r)).summary() if run.auditor is not None else None
    run.results.append(r)
    reason = [s for (e, _t, _s), s in run.server.reasoning_seconds.items() if e == epoch]
    rewards = {f"{s.task_id}/{s.sample}": s.reward for s in r.samples}
    calls = r.tool_calls
    row = {
        "epoch_seconds": round(r.seconds, 3),
        "wall_seconds": round(wall, 3),
        "teardown_seconds": round(r.teardown_seconds, 3),
        "persist_seconds": round(persist, 3),
        "persist_wait_after_epoch": round(persist_wait, 3),
        "persist_running_at_start": run.engine.persist_running_at_start,
        "oracle_seconds": round(max(reason, default=0.0), 3),
        "median_rollout_seconds": round(statistics.median(s.finished for s in r.samples), 3) if r.samples else 0.0,
        "cache_hit_rate": round(r.cache_hits / calls, 4) if calls else 0.0,
        "spec_hit_rate": round(r.spec_hits / calls, 4) if calls else 0.0,
        "hit_rate": round(r.hit_rate, 4),
        "sibling_waits": r.sibling_waits,
        "tool_calls": calls,
        "peak_memory_bytes": max((b for _, b in memory), default=0),
        "memory": [(round(t, 2), b) for t, b in memory],
        "running": r.running_over_time(100),
        "reward": round(statistics.mean(v for v in rewards.values() if v is not None), 4)
        if any(v is not None for v in rewards.values()) else None,
        "rewards": rewards,
        "errors": [e for s in r.samples for e in s.errors],
        "wasted_speculation_seconds": round(r.wasted_seconds, 3),
        **r.invariant(),  # divergences, rewound, rerolled and the seconds they cost
        "phases": phases(r, r.seconds + r.teardown_seconds),
        "audit": audit,
    }
    run.epochs.append(row)
    print(f"  {run.name:4s} epoch {epoch}: {r.seconds:6.1f} s (oracle {row['oracle_seconds']:5.1f} s, median "
          f"rollout {row['median_rollout_seconds']:5.1f} s)  hit rate {row['hit_rate']:5.1%} (cache "
          f"{r.cache_hits}, spec {r.spec_hits}, sibling waits {r.sibling_waits} of {calls})  peak "
          f"{row['peak_memory_bytes'] / MiB:7.1f} MiB  reward {row['reward']}  errors {len(row['errors'])}",
          flush=True)
    print(f"        beside it: teardown {r.teardown_seconds:.1f} s, persistence {persist:.1f} s (done before the "
          f"next epoch: yes)", flush=True)
    if audit is not None:
        print(f"        audit ({audit['mode']}): {audit['audited']} samples, {audit['steps']} steps re-executed in "
              f"{audit['seconds']:.1f} s: {audit['mismatches']} mismatches, {audit['not_auditable']} not auditable, "
              f"{audit['errors']} errors", flush=True)
    if r.divergences or row["sibling_checks"] or row["speculation_checks"]:
        print("        invariant: " + "  ".join(f"{k} {v}" for k, v in r.invariant().items()), flush=True)
    if row["phases"]:
        path = row["phases"]["critical_path"]
        print("        last rollout: " + "  ".join(f"{k} {v:.1f}" for k, v in path.items() if v), flush=True)
    return row


def summarize(run: ConfigRun) -> dict[str, Any]:
    ep = run.epochs
    return {
        "epoch_seconds": [e["epoch_seconds"] for e in ep],
        "oracle_seconds": [e["oracle_seconds"] for e in ep],
        "median_rollout_seconds": [e["median_rollout_seconds"] for e in ep],
        "teardown_seconds": [e["teardown_seconds"] for e in ep],
        "persist_seconds": [e["persist_seconds"] for e in ep],
        "sibling_waits_per_epoch": [e["sibling_waits"] for e in ep],
        "hit_rate_per_epoch": {"cache": [e["cache_hit_rate"] for e in ep],
                               "speculation": [e["spec_hit_rate"] for e in ep],
                               "total": [e["hit_rate"] for e in ep]},
        "peak_memory_bytes": max(e["peak_memory_bytes"] for e in ep),
        "peak_memory_bytes_per_epoch": [e["peak_memory_bytes"] for e in ep],
        "reward_per_epoch": [e["reward"] for e in ep],
        "rewards_per_sample_per_epoch": [e["rewards"] for e in ep],
        "tool_calls_per_epoch": [e["tool_calls"] for e in ep],
        "wasted_speculation_seconds_per_epoch": [e["wasted_speculation_seconds"] for e in ep],
        "errors": [x for e in ep for x in e["errors"]],
        # The invariant at work: replays that diverged, samples rewound, trajectories re-rolled,
        # the divergences by kind (divergences_mid_plan, _removed_node, _speculation, _sibling_race)
        # and by outcome (outcome_rewound, ..., divergences_unaccounted: 0 when each has one), and
        # the chances to meet the rarer kinds (sibling_checks, speculation_checks).
        "invariant_per_epoch": [{k: e[k] for k in ("divergences", "divergence_seconds", "rewound", "rewound_steps",
                                                   "rewound_seconds", "rerolled",
                                                   *(f"divergences_{d}" for d in DIVERGENCE_KINDS),
                                                   *(f"outcome_{o}" for o in DIVERGENCE_OUTCOMES),
                                                   "divergences_unaccounted", "sibling_checks",
                                                   "speculation_checks")} for e in ep],
        "phases_per_epoch": [e["phases"] for e in ep],
        # The trajectory audit per epoch (Full's; None where it did not run).
        "audit_per_epoch": [e["audit"] for e in ep],
        "cache": run.results[-1].cache if run.results else None,
        "speculation": run.results[-1].speculation if run.results else None,
    }


async def check_tools(task: Task, candidates: Any) -> dict[str, Any]:
    """check_family on the agent's first candidate calls (each in two forks of the initial state),
    before the family meets the cache."""
    calls = [c for c in candidates(task.id, []) if isinstance(c, ToolCall)]
    t0 = time.monotonic()
    report = await check_family_async(task, calls)
    print(f"  check_family {task.id}: {len(report.checked)} calls in {time.monotonic() - t0:.1f} s, differing "
          f"{report.differing_tools or 'none'}", flush=True)
    return {**report.summary(), "seconds": round(time.monotonic() - t0, 3)}


async def run_seed(seed: int, args: argparse.Namespace, agent_cfg: AgentConfig, model: LatencyModel,
                   store: Path) -> dict[str, Any]:
    tasks, cands = build_tasks(args.families, seed, args.code_tasks)
    if args.inject_faults:
        tasks = [inject_faults(t, args.inject_faults, seed) for t in tasks]
    checks = [await check_tools(t, cands[t.id]) for t in tasks] if args.check_families else []
    print(f"seed {seed}: tasks {[t.id for t in tasks]} x {args.group_size} samples x {args.epochs} epochs", flush=True)
    # Spec and CRIU (--short-configs) run at the first seed and in the first --short-epochs only:
    # Spec for its memory figure, CRIU for Base's memory against it.
    short = [n for n in args.configs if n in args.short_configs]
    names = [n for n in args.configs if n not in short or seed in args.short_seeds]
    runs = {n: make_config(n, tasks, cands, dataclasses.replace(agent_cfg, seed=seed), model, store,
                           args.cache_mib, args.spec_depth, args.slow_seconds, args.share_engine,
                           REGIMES[args.regime], args.audit, seed, args.inject_faults > 0,
                           args.guard_auto_disable == "on")
            for n in names}
    try:
        for e in range(args.epochs):
            order = names[e % len(names):] + names[:e % len(names)]  # interleaved, rotating
            for n in order:
                if n in short and e >= args.short_epochs:
                    continue
                await run_epoch(runs[n], args.group_size, e)
    finally:
        for r in runs.values():
            if r.auditor is not None:
                await r.auditor.close()
            await r.engine.close()
            if r.cache is not None:
                await asyncio.to_thread(r.cache.close)
    out = {n: summarize(r) for n, r in runs.items()}
    trio = [n for n in runs if n.partition("@")[0] in ENGINE_CONFIGS]
    out["rewards_identical"] = all(runs[trio[0]].epochs[e]["rewards"] == runs[n].epochs[e]["rewards"]
                                   for n in trio for e in range(min(len(runs[n].epochs), len(runs[trio[0]].epochs))))
    audits = [e["audit"] for r in runs.values() for e in r.epochs if e["audit"] is not None]
    out["audit"] = {"mode": args.audit, **{k: sum(a[k] for a in audits)
                                           for k in ("audited", "mismatches", "not_auditable", "errors")},
                    "seconds": round(sum(a["seconds"] for a in audits), 3)}
    if checks:
        out["check_family"] = checks
    out["_series"] = {n: {"memory": [x["memory"] for x in r.epochs], "running": [x["running"] for x in r.epochs]}
                      for n, r in runs.items()}
    return out


# ---- targets and figures ----

def _spread(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"mean": round(statistics.mean(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "n": len(xs)}


def _later(epochs: int) -> list[int]:
    """The epochs compared: all but the first, whose selector is untrained and cache empty."""
    return list(range(1, epochs)) or [0]


def _with(seeds: dict[int, dict[str, Any]], *names: str) -> list[dict[str, Any]]:
    """The seeds that ran every configuration named."""
    return [s for s in seeds.values() if all(n in s for n in names)]


def _common(s: dict[str, Any], later: list[int], *names: str) -> list[int]:
    """The epochs of `later` every configuration named ran in this seed."""
    return [e for e in later if all(e < len(s[n]["epoch_seconds"]) for n in names)] or \
        list(range(min(len(s[n]["epoch_seconds"]) for n in names)))


def _epoch_ratios(seeds: dict[int, dict[str, Any]], a: str, b: str, later: list[int]) -> list[float]:
    """Per seed, configuration a's summed epoch time over `later` over b's: paired within the seed."""
    out = []
    for s in _with(seeds, a, b):
        es = _common(s, later, a, b)
        out.append(sum(s[a]["epoch_seconds"][e] for e in es) / sum(s[b]["epoch_seconds"][e] for e in es))
    return out


def _peak_ratios(seeds: dict[int, dict[str, Any]], a: str, b: str) -> list[float]:
    """Per seed, configuration a's peak memory over b's, over the epochs both ran."""
    out = []
    for s in _with(seeds, a, b):
        es = _common(s, list(range(max(len(s[a]["epoch_seconds"]), len(s[b]["epoch_seconds"])))), a, b)
        out.append(max(s[a]["peak_memory_bytes_per_epoch"][e] for e in es)
                   / max(max(s[b]["peak_memory_bytes_per_epoch"][e] for e in es), 1))
    return out


def summary(seeds: dict[int, dict[str, Any]], epochs: int) -> dict[str, Any]:
    """Per configuration, the mean and spread over the seeds it ran (epoch figures: the mean of
    the later epochs it ran)."""
    later = _later(epochs)
    names: list[str] = []
    for v in seeds.values():
        names += [n for n in v if isinstance(v[n], dict) and "epoch_seconds" in v[n] and n not in names]
    out = {}
    for n in names:
        vals = _with(seeds, n)
        ran = lambda s, n=n: _common(s, later, n)  # noqa: E731
        e3 = lambda s, n=n: min(2, len(s[n]["epoch_seconds"]) - 1)  # noqa: E731
        out[n] = {
            "epoch_seconds": _spread([statistics.mean(s[n]["epoch_seconds"][e] for e in ran(s)) for s in vals]),
            "oracle_seconds": _spread([statistics.mean(s[n]["oracle_seconds"][e] for e in ran(s)) for s in vals]),
            "median_rollout_seconds": _spread([statistics.mean(s[n]["median_rollout_seconds"][e] for e in ran(s))
                                               for s in vals]),
            "peak_memory_mib": _spread([s[n]["peak_memory_bytes"] / MiB for s in vals]),
            "hit_rate_epoch3": _spread([s[n]["hit_rate_per_epoch"]["total"][e3(s)] for s in vals]),
            "reward": _spread([statistics.mean(r for r in s[n]["reward_per_epoch"] if r is not None) for s in vals]),
            "errors": sum(len(s[n]["errors"]) for s in vals), "epochs": sorted({e for s in vals for e in ran(s)}),
            "seeds": len(vals)}
    return out


def placements(seeds: dict[int, dict[str, Any]], summ: dict[str, Any], epochs: int) -> dict[str, Any]:
    """Epoch time and peak memory per speculation placement ("Spec" is the default's), and each
    other placement's ratios to the default's, paired within every seed."""
    out: dict[str, Any] = {}
    for n, v in summ.items():
        kind, _, p = n.partition("@")
        if kind == "Spec":
            stats = [s[n].get("speculation") or {} for s in seeds.values() if n in s]
            out.setdefault(p or DEFAULT_PLACEMENT, {
                "config": n, "epoch_seconds": v["epoch_seconds"], "peak_memory_mib": v["peak_memory_mib"],
                # chains launched, calls adopted and chains mismatched, over all epochs and seeds
                "speculation": {k: sum(x.get(k, 0) for x in stats) for k in ("launched", "hits", "mismatches")}})
    if _paired_to_default(seeds, out, DEFAULT_PLACEMENT, epochs):
        out["shorter_epoch"] = min(out, key=lambda p: out[p]["epoch_seconds"]["mean"])
        out["default"] = DEFAULT_PLACEMENT
    return out


def _paired_to_default(seeds: dict[int, dict[str, Any]], out: dict[str, Any], default: str, epochs: int) -> bool:
    """Give each variant in `out` (by name; its "config" the configuration) its epoch-time and
    peak-memory ratios to the default's, paired within every seed; False when there is nothing
    to pair (one variant, or no default)."""
    if len(out) < 2 or default not in out:
        return False
    later = _later(epochs)
    for p, v in out.items():
        if p != default:
            a, b = v["config"], out[default]["config"]
            v["epoch_ratio_to_default"] = _spread(_epoch_ratios(seeds, a, b, later))
            v["peak_memory_ratio_to_default"] = _spread(_peak_ratios(seeds, a, b))
    return True


def snapshot_policies(seeds: dict[int, dict[str, Any]], summ: dict[str, Any], epochs: int) -> dict[str, Any]:
    """Epoch time, peak memory and captures per prefix-cache snapshot policy ("Full" is the
    default's), and each other policy's ratios to the default's, paired within every seed."""
    out: dict[str, Any] = {}
    for n, v in summ.items():
        kind, _, p = n.partition("@")
        if kind == "Full":
            caches = [s[n].get("cache") or {} for s in seeds.values() if n in s]
            out[p or DEFAULT_SNAPSHOT_POLICY] = {
                "config": n, "epoch_seconds": v["epoch_seconds"], "peak_memory_mib": v["peak_memory_mib"],
                "hit_rate_epoch3": v["hit_rate_epoch3"],
                # states captured, replayed calls and states persisted, over all epochs and seeds
                "cache": {k: sum(c.get(k, 0) for c in caches) for k in ("captured", "replayed_calls", "persisted")}}
    if _paired_to_default(seeds, out, DEFAULT_SNAPSHOT_POLICY, epochs):
        out["default"] = DEFAULT_SNAPSHOT_POLICY
    return out


def _met(value: float, target: float, at_most: bool = False) -> bool:
    return value <= target if at_most else value >= target


def targets(seeds: dict[int, dict[str, Any]], epochs: int, share: str = "ksm") -> dict[str, Any]:
    """The issue's targets with what was reached (printed, never asserted in a test). Speedups
    are per seed: summed epoch times over epochs 2-5, Base's over Full's; the oracle is the
    longest rollout's reasoning alone (the same decisions in every configuration)."""
    later = _later(epochs)
    out: dict[str, Any] = {}
    bf = _with(seeds, "Base", "Full")
    if bf:
        def tot(s: dict[str, Any], n: str, key: str) -> float:
            return sum(s[n][key][e] for e in _common(s, later, "Base", "Full"))

        speed = [tot(s, "Base", "epoch_seconds") / tot(s, "Full", "epoch_seconds") for s in bf]
        ceiling = [tot(s, "Base", "epoch_seconds") / tot(s, "Base", "oracle_seconds") for s in bf]
        over_oracle = [tot(s, "Full", "epoch_seconds") / tot(s, "Full", "oracle_seconds") for s in bf]
        removable = [(tot(s, "Base", "epoch_seconds") - tot(s, "Full", "epoch_seconds"))
                     / max(tot(s, "Base", "epoch_seconds") - tot(s, "Base", "oracle_seconds"), 1e-9) for s in bf]
        median = [tot(s, "Base", "median_rollout_seconds") / tot(s, "Full", "median_rollout_seconds") for s in bf]
        per_epoch = [[round(s["Base"]["epoch_seconds"][e] / s["Full"]["epoch_seconds"][e], 3)
                      for e in _common(s, later, "Base", "Full")] for s in bf]
        sp = _spread(speed)
        out["full_speedup_vs_base"] = {**sp, "target_mean": 1.2, "target_min_seed": 1.1, "paper": 1.22,
                                       "met": sp["mean"] >= 1.2 and sp["min"] >= 1.1,
                                       "epochs": [e + 1 for e in later], "per_epoch_per_seed": per_epoch,
                                       "ceiling_base_over_oracle": _spread(ceiling),
                                       "removable_share_removed": _spread(removable),
                                       "median_rollout_speedup": _spread(median)}
        fo = _spread(over_oracle)
        out["full_vs_oracle"] = {**fo, "target_at_most": 1.25, "met": _met(fo["mean"], 1.25, True)}
        rs = _spread(removable)
        out["removable_share"] = {**rs, "target": 0.5, "met": _met(rs["mean"], 0.5)}
        e3 = min(2, epochs - 1)
        h3 = _spread([s["Full"]["hit_rate_per_epoch"]["total"][e3] for s in bf])
        through = _spread([min(s["Full"]["hit_rate_per_epoch"]["total"][e3:]) for s in bf])
        out["full_hit_rate_epoch3"] = {**h3, "target": 0.65, "epoch": e3 + 1, "met": _met(h3["min"], 0.65)}
        out["full_hit_rate_through_epoch5"] = {**through, "target": 0.60, "epochs": [e3 + 1, epochs],
                                               "met": _met(through["min"], 0.60)}
        pm = _spread(_peak_ratios(seeds, "Full", "Base"))
        out["full_peak_memory_vs_base"] = {**pm, "target_at_most": 1.1, "paper": 1.014,
                                           "met": _met(pm["max"], 1.1, True)}
    bc = _with(seeds, "Base", "CRIU")
    if bc:
        per_epoch = [[s["Base"]["peak_memory_bytes_per_epoch"][e] / max(s["CRIU"]["peak_memory_bytes_per_epoch"][e], 1)
                      for s in bc if e < len(s["CRIU"]["epoch_seconds"])] for e in range(epochs)]
        ratio = _spread(_peak_ratios(seeds, "Base", "CRIU"))
        out["base_peak_memory_vs_criu"] = {
            **ratio, "target_at_most": 0.6, "engine": share,
            "per_epoch": [_spread(r) for r in per_epoch if r],
            "met": _met(ratio["max"], 0.6, True) if "max" in ratio else None,
            **({"note": "the target is for cow in a guest; ksm merges the clones only as ksmd scans, "
                        "after the fork"} if share == "ksm" else {})}
    if _with(seeds, "Base", "Spec"):
        out["spec_speedup_vs_base"] = _spread([1 / x for x in _epoch_ratios(seeds, "Spec", "Base", later)])
    out["rewards_identical"] = {"value": all(s["rewards_identical"] for s in seeds.values()),
                                "met": all(s["rewards_identical"] for s in seeds.values())}
    audits = [s["audit"] for s in seeds.values() if s.get("audit") and s["audit"]["audited"]]
    if audits:
        # Merged runs from before the audit have none: the target is then not reported.
        out["audit_mismatches"] = {"value": sum(a["mismatches"] for a in audits), "target_at_most": 0,
                                   "audited": sum(a["audited"] for a in audits),
                                   "not_auditable": sum(a["not_auditable"] for a in audits),
                                   "errors": sum(a["errors"] for a in audits),
                                   "met": all(a["mismatches"] == 0 and a["errors"] == 0 for a in audits)}
    return out


def explain_misses(seeds: dict[int, dict[str, Any]], tg: dict[str, Any], epochs: int) -> list[str]:
    """For every target missed, why: the critical path's phases (the last rollout's seconds per
    kind) of Base and Full in each compared epoch, and the time-consuming phases all rollouts
    summed."""
    missed = [k for k, v in tg.items() if isinstance(v, dict) and v.get("met") is False]
    if not missed:
        return []
    lines = [f"targets missed: {', '.join(missed)}; the critical path of each compared epoch "
             "(the last rollout's seconds per phase, Base | Full), and Full's summed over all rollouts:"]
    for k, s in seeds.items():
        if "Base" not in s or "Full" not in s:
            continue
        for e in _common(s, _later(epochs), "Base", "Full"):
            b, f = s["Base"]["phases_per_epoch"][e], s["Full"]["phases_per_epoch"][e]
            if not b or not f:
                continue
            cp = "  ".join(f"{p} {b['critical_path'][p]:.1f}|{f['critical_path'][p]:.1f}" for p in PHASES
                           if b["critical_path"].get(p) or f["critical_path"].get(p))
            calls = f["critical_path_calls"]
            lines.append(f"  seed {k} epoch {e + 1}: Base {s['Base']['epoch_seconds'][e]:.1f} s, Full "
                         f"{s['Full']['epoch_seconds'][e]:.1f} s, oracle {s['Full']['oracle_seconds'][e]:.1f} s; "
                         f"{cp}; Full's last rollout: {calls['real']} real calls, {calls['cache_hits']} hits, "
                         f"{calls['spec_hits']} speculative")
            lines.append("      Full, all rollouts: " + "  ".join(
                f"{p} {f['all_rollouts'][p]:.1f}" for p in ("tool", "materialize", "post_wait", "sibling_wait",
                                                            "spec_miss") if f["all_rollouts"].get(p)))
    return lines


def headline_estimate(seeds: dict[int, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The headline's wall time, estimated from this run: per rollout step, the reasoning the
    paper's regime prices plus the tool and wait time this run measured on the critical path,
    scaled to the headline's size; compared with the 2-hour budget."""
    size = meta["size"]
    step_paper = meta["latency_model"].get("paper_step_seconds")
    if step_paper is None or not any("Base" in s for s in seeds.values()):
        return {}
    nonreason, steps = [], []
    for s in seeds.values():
        for n in ("Base", "Full"):
            for ph in s.get(n, {}).get("phases_per_epoch", []):
                if not ph:
                    continue
                cp = ph["critical_path"]
                calls = sum(ph["critical_path_calls"].values())
                steps.append(calls + 1)
                nonreason.append(sum(v for p, v in cp.items() if p != "reason"))
    if not steps:
        return {}
    # Tool time on the path grows with the rollouts sharing the CPUs: the pessimistic bound
    # scales it by the headline's rollouts per epoch over this run's.
    measured = statistics.mean(len(s["Base"]["rewards_per_sample_per_epoch"][0]) for s in seeds.values() if "Base" in s)
    scale = max(1.0, HEADLINE["rollouts"] / measured)
    per_epoch = statistics.mean(steps) * step_paper + statistics.mean(nonreason)
    worst_epoch = statistics.mean(steps) * step_paper + statistics.mean(nonreason) * scale
    # Base and Full: 3 seeds x 5 epochs; Spec and CRIU: seed 0, 2 epochs; the constant
    # exploration (Base, Full) at seed 0; the local regime (Base, Full) at seed 0, ~0.9 s steps.
    local_epoch = statistics.mean(steps) * 0.9 + statistics.mean(nonreason)
    epochs = 3 * 5 * 2 + 2 * 2 + 5 * 2
    setup = 60.0 * (3 + 1 + 1)  # initialized workspaces per seed run (measured order: a minute)
    total = epochs * per_epoch + 5 * 2 * local_epoch + setup
    worst = epochs * worst_epoch + 5 * 2 * local_epoch * scale + setup
    return {"epoch_seconds_estimate": round(per_epoch, 1), "epoch_seconds_pessimistic": round(worst_epoch, 1),
            "epochs": epochs, "total_seconds": round(total), "total_seconds_pessimistic": round(worst),
            "fits_2_hours": total <= 7200, "fits_2_hours_pessimistic": worst <= 7200,
            "from": {"steps_per_rollout": round(statistics.mean(steps), 1),
                     "non_reasoning_seconds_on_path": round(statistics.mean(nonreason), 1), "measured_size": size}}


def plots(out: Path, seeds: dict[int, dict[str, Any]], epochs: int, share: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"CRIU": "tab:red", "Base": "tab:gray", "Spec": "tab:orange", "Full": "tab:blue"}
    first = seeds[min(seeds)]
    series = first["_series"]
    names = list(series)
    for n in names:
        colors.setdefault(n, "tab:green")
    files = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(name)

    def memory_chart(which: list[str], epoch: int, title: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for n in which:
            if epoch >= len(series[n]["memory"]):
                continue  # a configuration run in the first epochs only
            pts = series[n]["memory"][epoch]
            ax.plot([t for t, _ in pts], [b / MiB for _, b in pts], color=colors[n],
                    label=f"{n} (peak {max((b for _, b in pts), default=0) / MiB:.0f} MiB)")
        ax.set_xlabel("time since the epoch started (s)")
        ax.set_ylabel("host memory of all environments (MiB)")
        ax.set_title(title)
        ax.legend(fontsize=8)
        save(fig, name)

    if "CRIU" in series and "Base" in series:
        memory_chart(["CRIU", "Base"], 0, f"Figs. 6/7: CRIU (copy) vs Base ({share}), epoch 1",
                     "fig6_7_memory_criu_base.png")
    fig, axes = plt.subplots(1, epochs, figsize=(4 * epochs, 3.2), sharey=True, squeeze=False)
    for e in range(epochs):
        ax = axes[0][e]
        for n in names:
            if e >= len(series[n]["running"]):
                continue
            pts = series[n]["running"][e]
            ax.step([t for t, _ in pts], [k for _, k in pts], where="post", color=colors[n],
                    label=f"{n} ({first[n]['epoch_seconds'][e]:.0f} s)")
        ax.set_title(f"epoch {e + 1}")
        ax.set_xlabel("time (s)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("rollouts still running")
    save(fig, "fig8_rollouts_running.png")
    trio = [n for n in names if n.partition("@")[0] in ENGINE_CONFIGS]
    memory_chart(trio, epochs - 1, f"Fig. 9: memory over epoch {epochs}", "fig9_memory_base_spec_full.png")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    xs = list(range(1, epochs + 1))
    for n in names:
        config = n.partition("@")[0]
        if config not in ENGINE_CONFIGS or not speculates(config):
            continue
        for kind, style in (("cache", "-"), ("speculation", "--"), ("total", ":")):
            if kind == "cache" and n != "Full":
                continue
            ran = [s for s in seeds.values() if n in s]
            es = range(min(len(s[n]["hit_rate_per_epoch"][kind]) for s in ran))
            ys = [100 * statistics.mean(s[n]["hit_rate_per_epoch"][kind][e] for s in ran) for e in es]
            ax.plot(xs[:len(ys)], ys, style, marker="o", color=colors[n], label=f"{n} {kind}")
    ax.axhline(65, color="k", linewidth=0.5)
    ax.set_xticks(xs)
    ax.set_xlabel("epoch")
    ax.set_ylabel("hit rate (%), mean over seeds")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7)
    save(fig, "fig10_hit_rate.png")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for i, n in enumerate(names):
        ran = [s for s in seeds.values() if n in s]
        es = range(min(len(s[n]["reward_per_epoch"]) for s in ran))
        ys = [statistics.mean(s[n]["reward_per_epoch"][e] or 0.0 for s in ran) for e in es]
        ax.plot([x + 0.03 * i for x in xs[:len(ys)]], ys, marker="o", color=colors[n], label=n)
    ax.set_xticks(xs)
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean reward")
    ident = all(s["rewards_identical"] for s in seeds.values())
    ax.set_title(f"Fig. 11: reward per epoch (Base = Spec = Full: {ident})")
    ax.legend(fontsize=8)
    save(fig, "fig11_reward.png")
    return files


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 seed, code + shop, 3 samples x 3 epochs (CRIU and Spec 2), the local regime (CI)")
    ap.add_argument("--regime", choices=sorted(REGIMES),
                    help=f"paper: steps priced with {PAPER_IN_FLIGHT} requests in flight (the headline); local: "
                         "with this configuration's own")
    ap.add_argument("--exploration", choices=sorted(EXPLORATION),
                    help="the exploration schedule over epochs (decaying: the headline's; constant: 0.08)")
    ap.add_argument("--short-configs", help="configurations run only at --short-seeds and in the first "
                                            "--short-epochs epochs (default CRIU,Spec in the headline)")
    ap.add_argument("--short-epochs", type=int)
    ap.add_argument("--short-seeds", help="comma-separated seeds the short configurations run at")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seeds", type=int, help="run seeds 0..N-1")
    ap.add_argument("--seed", type=int, help="run this one seed only (merge such runs with --merge)")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                    help="combine the agent_rollouts.json of per-seed runs in these folders into --out")
    ap.add_argument("--placements", default=DEFAULT_PLACEMENT,
                    help=f"speculation placements to compare, of {','.join(PLACEMENTS)}: each one but the "
                         f"default ({DEFAULT_PLACEMENT}, Spec's) adds a configuration Spec@PLACEMENT")
    ap.add_argument("--snapshot-policies", default=DEFAULT_SNAPSHOT_POLICY,
                    help=f"prefix-cache snapshot policies to compare, of {','.join(SNAPSHOT_POLICIES)}: each one "
                         f"but the default ({DEFAULT_SNAPSHOT_POLICY}, Full's) adds a configuration Full@POLICY")
    ap.add_argument("--families", help="comma-separated: code, shop, gui")
    ap.add_argument("--code-tasks", type=int)
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cache-mib", type=int, default=1024, help="resident budget of Full's prefix cache")
    ap.add_argument("--spec-depth", type=int, default=2)
    ap.add_argument("--share-engine", default="ksm", help="fork engine of Base, Spec and Full (cow in a guest)")
    ap.add_argument("--slow-seconds", type=float, default=1.0, help="a call this slow is a 'slow tool'")
    ap.add_argument("--check-families", action="store_true",
                    help="before the epochs, run check_family on each task (its agent's first candidate calls, "
                         "each in two forks of the initial state) and record check_family per seed")
    ap.add_argument("--audit", choices=AUDIT_MODES,
                    help="re-execute Full's trajectories after each epoch from a fresh fork of the root and compare "
                         "every observation and the reward: all samples (the headline's default), one per task "
                         "(sample: --quick's and CI's) or off")
    ap.add_argument("--inject-faults", type=float, default=0.0, metavar="RATE",
                    help="fault injection (issue 37's proof): each agent tool observes a token specific to the "
                         "sample running it with this probability per (sample, call), keyed by the seed "
                         "(bunshinrl.envs.faults)")
    ap.add_argument("--guard-auto-disable", choices=("on", "off"), default="on",
                    help="off: a tool found non-deterministic stays reusable (its cached subtrees are still "
                         "dropped at each mismatch), so injected faults keep meeting the cache")
    a = ap.parse_args()
    for k, v in (QUICK if a.quick else HEADLINE).items():
        if hasattr(a, k) and getattr(a, k) is None:
            setattr(a, k, v)
    a.families = [f for f in a.families.split(",") if f]
    a.short_configs = [c for c in a.short_configs.split(",") if c]
    a.short_seeds = [int(x) for x in a.short_seeds.split(",") if x]
    a.configs = [c for c in a.configs.split(",") if c]
    extra = [p for p in a.placements.split(",") if p]
    if set(extra) - set(PLACEMENTS):
        ap.error(f"unknown placements {sorted(set(extra) - set(PLACEMENTS))}; use {', '.join(PLACEMENTS)}")
    a.configs += [f"Spec@{p}" for p in extra if p != DEFAULT_PLACEMENT and f"Spec@{p}" not in a.configs]
    pols = [p for p in a.snapshot_policies.split(",") if p]
    if set(pols) - set(SNAPSHOT_POLICIES):
        ap.error(f"unknown snapshot policies {sorted(set(pols) - set(SNAPSHOT_POLICIES))}; use "
                 f"{', '.join(SNAPSHOT_POLICIES)}")
    a.configs += [f"Full@{p}" for p in pols if p != DEFAULT_SNAPSHOT_POLICY and f"Full@{p}" not in a.configs]
    known = {*CONFIGS, *(f"Spec@{p}" for p in PLACEMENTS), *(f"Full@{p}" for p in SNAPSHOT_POLICIES)}
    if bad := [c for c in a.configs if c not in known]:
        ap.error(f"unknown configurations {bad}")
    a.seed_list = [a.seed] if a.seed is not None else list(range(a.seeds))
    return a


def preamble(args: argparse.Namespace, model: LatencyModel, agent_cfg: AgentConfig) -> list[str]:
    """The constants, with their citations, and the run's size, printed before the run."""
    n_tasks = len(args.families) + (args.code_tasks - 1 if "code" in args.families else 0)
    rollouts = n_tasks * args.group_size
    cpus = os.cpu_count() or 1
    fixed = REGIMES[args.regime]
    tpot128 = model.tpot(PAPER_IN_FLIGHT)
    return [
        f"latency model: {model.describe()}",
        f"regime {args.regime}: " + (
            f"every step priced with {fixed} requests in flight (the paper's 128 rollouts on one H100), whatever "
            f"this host runs. The table stops at {model.tpot_table[-1][0]} in flight: tpot({fixed}) = "
            f"{tpot128 * 1e3:.1f} ms per output token is its linear extrapolation (the 16 -> 64 slope), not a "
            f"measurement; a median step ({agent_cfg.output_median} output tokens) takes "
            f"{model.seconds(200, agent_cfg.output_median, fixed):.1f} s" if fixed else
            f"steps priced with this configuration's own requests in flight (at most {rollouts}); a median step "
            f"takes {model.seconds(200, agent_cfg.output_median, rollouts):.2f} s with all in flight"),
        f"exploration ({args.exploration}, fixed before any run): "
        f"{', '.join(f'{x:g}' for x in agent_cfg.schedule)} in epochs 1-{len(agent_cfg.schedule)} (the last "
        f"beyond); direction: {EXPLORATION_SOURCE}",
        f"agent: output tokens median {agent_cfg.output_median} (sigma {agent_cfg.output_sigma}, max "
        f"{agent_cfg.output_max})",
        f"size: {n_tasks} tasks ({', '.join(args.families)}) x G={args.group_size} = {rollouts} rollouts per epoch, "
        f"{args.epochs} epochs, seeds {args.seed_list}; configs {args.configs} (interleaved)"
        + (f"; {', '.join(args.short_configs)} at seeds {args.short_seeds} in epochs 1-{args.short_epochs} only"
           if args.short_configs else ""),
        f"CPU oversubscription: {rollouts} rollouts on {cpus} hardware threads = {rollouts / cpus:.1f} per thread "
        f"(the paper: {PAPER_ROLLOUTS_PER_THREAD} per thread)",
        "targets (printed after the run, never asserted): Full >= 1.2x Base over epochs 2-5 (per seed, summed; the "
        "mean over seeds, no seed below 1.1x); Full within 1.25x of the oracle; removable share >= 50%; hit rate "
        ">= 65% by epoch 3 and >= 60% through epoch 5; Full's peak memory <= 1.1x Base's; Base's <= 0.6x CRIU's "
        "(cow); rewards identical across Base, Spec and Full",
    ]


def finish(out: Path, seeds: dict[int, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Targets, summary, figures and the JSON of `seeds` (each with its "_series")."""
    epochs = meta["size"]["epochs"]
    tg = targets(seeds, epochs, meta["share_engine"])
    summ = summary(seeds, epochs)
    figures = plots(out, seeds, epochs, meta["share_engine"])
    result = {
        **meta,
        "seeds": {str(k): {n: v for n, v in s.items() if n != "_series"} for k, s in seeds.items()},
        "series": {str(k): s["_series"] for k, s in seeds.items()},
        "summary": summ,
        "placements": placements(seeds, summ, epochs),
        "snapshot_policies": snapshot_policies(seeds, summ, epochs),
        "targets": tg,
        "figures": figures,
    }
    (out / "agent_rollouts.json").write_text(json.dumps(result, indent=1))
    print("per configuration, mean [min, max] over seeds " + str(sorted(seeds)) + ":")
    for n, v in summ.items():
        e, m = v["epoch_seconds"], v["peak_memory_mib"]
        print(f"  {n:16s} epoch {e['mean']:6.1f} s [{e['min']:.1f}, {e['max']:.1f}]  peak {m['mean']:7.1f} MiB "
              f"[{m['min']:.1f}, {m['max']:.1f}]  hit rate {v['hit_rate_epoch3']['mean']:5.1%}  "
              f"errors {v['errors']}")
    print("placements: " + json.dumps(result["placements"]))
    print("snapshot policies: " + json.dumps(result["snapshot_policies"]))
    print("targets (reached vs target; printed, never asserted):")
    print(json.dumps(tg, indent=1))
    for line in explain_misses(seeds, tg, epochs):
        print(line)
    est = headline_estimate(seeds, meta)
    result["headline_estimate"] = est
    (out / "agent_rollouts.json").write_text(json.dumps(result, indent=1))
    if est:
        print(f"headline wall time, estimated from this run ({est['from']}): {est['epoch_seconds_estimate']} s per "
              f"epoch ({est['epoch_seconds_pessimistic']} s if tool time grows with the rollouts per CPU), "
              f"{est['epochs']} paper-regime epochs: {est['total_seconds']} s ({est['total_seconds_pessimistic']} s); "
              f"within 2 hours: {est['fits_2_hours']} ({est['fits_2_hours_pessimistic']})")
    return result


def merge(dirs: list[Path], out: Path) -> int:
    """One result from per-seed runs of one size (each dir holds an agent_rollouts.json)."""
    parts = [json.loads((d / "agent_rollouts.json").read_text()) for d in dirs]
    keys = ("latency_model", "agent", "share_engine")
    size = {k: v for k, v in parts[0]["size"].items() if k != "seeds"}
    for p in parts[1:]:
        if {k: p[k] for k in keys} != {k: parts[0][k] for k in keys} or \
                {k: v for k, v in p["size"].items() if k != "seeds"} != size:
            raise SystemExit("--merge: the runs differ in size, model, agent or engine")
    seeds: dict[int, dict[str, Any]] = {}
    for p in parts:
        for k, s in p["seeds"].items():
            if int(k) in seeds:
                raise SystemExit(f"--merge: seed {k} appears twice")
            seeds[int(k)] = {**s, "_series": p["series"][k]}
    out.mkdir(parents=True, exist_ok=True)
    meta = {**{k: parts[0][k] for k in keys}, "size": {**size, "seeds": sorted(seeds)},
            "runs": [{"dir": str(d), "host": p["host"], "wall_seconds": p["wall_seconds"]}
                     for d, p in zip(dirs, parts, strict=True)]}
    finish(out, seeds, meta)
    print(f"merged {len(parts)} runs into {out / 'agent_rollouts.json'}")
    return 0


async def main() -> int:
    args = parse()
    if args.merge:
        return merge(args.merge, args.out)
    model = DEFAULT_LATENCY
    agent_cfg = AgentConfig(schedule=EXPLORATION[args.exploration])
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "prefix-store"
    shutil.rmtree(store, ignore_errors=True)
    for line in preamble(args, model, agent_cfg):
        print(line, flush=True)
    t0 = time.monotonic()
    seeds: dict[int, dict[str, Any]] = {}
    for seed in args.seed_list:
        seeds[seed] = await run_seed(seed, args, agent_cfg, model, store)
    shutil.rmtree(store, ignore_errors=True)
    meta = {
        "latency_model": {**dataclasses.asdict(model), "formula": model.describe(), "regime": args.regime,
                          "in_flight": REGIMES[args.regime],
                          "paper_tpot_seconds": round(model.tpot(PAPER_IN_FLIGHT), 5),
                          "paper_step_seconds": round(model.seconds(200, agent_cfg.output_median, PAPER_IN_FLIGHT), 3),
                          "extrapolated_beyond": model.tpot_table[-1][0]},
        "agent": {**dataclasses.asdict(agent_cfg), "exploration": args.exploration,
                  "exploration_source": EXPLORATION_SOURCE},
        "share_engine": args.share_engine,
        "size": {"seeds": args.seed_list, "families": args.families, "code_tasks": args.code_tasks,
                 "group_size": args.group_size, "epochs": args.epochs, "quick": args.quick,
                 "configs": args.configs, "short_configs": args.short_configs, "short_epochs": args.short_epochs,
                 "short_seeds": args.short_seeds, "audit": args.audit, "inject_faults": args.inject_faults,
                 "guard_auto_disable": args.guard_auto_disable},
        "host": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "wall_seconds": round(time.monotonic() - t0, 1),
    }
    result = finish(args.out, seeds, meta)
    print(f"wrote {args.out / 'agent_rollouts.json'} and {', '.join(result['figures'])} in {meta['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
