"""BunshinRL's rollout configurations on real agent workspaces (paper sections 5.2-5.3, Figs. 6-11).

python benchmarks/agent_rollouts.py [--quick] --out DIR [--seeds 3 | --seed S] [--families code,shop]
                                    [--placements live,fork_first] [--snapshot-policies cost,depth]
python benchmarks/agent_rollouts.py --merge DIR0 DIR1 DIR2 --out DIR   (per-seed runs -> one result)

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
(overlap_fork; Full's prefetch of a fresh root). epoch_seconds is the wall time of the whole
epoch, teardown and the cache's persistence included.

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
    DeterminismGuard,
    EpochResult,
    RolloutEngine,
    SnapshotBackend,
    Speculator,
    TailPolicy,
    Task,
    ToolPrefixCache,
)
from bunshinrl.envs import coding, gui, webshop
from bunshinrl.speculator import PLACEMENTS

DEFAULT_PLACEMENT = Speculator().placement
SNAPSHOT_POLICIES = ("depth", "cost")
DEFAULT_SNAPSHOT_POLICY = "cost"

MiB = 1 << 20
CONFIGS = ("CRIU", "Base", "Spec", "Full")
SHOP_ORDERS = ({"MUG-BLU": 2, "TEA-GRN": 1}, {"TEA-GRN": 1}, {"MUG-BLU": 1})
GUI_TARGETS = ("Meeting moved to Friday 10:00", "Ship it on Friday", "Lunch at noon in room 4")
FAMILIES = ("code", "shop", "gui")


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
        target = GUI_TARGETS[seed % len(GUI_TARGETS)]
        t = dataclasses.replace(gui.make_env(target=target, apps=("editor",)), id=f"gui-{seed}")
        tasks.append(t)
        cands[t.id] = gui_candidates(target)
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
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    results: list[EpochResult] = dataclasses.field(default_factory=list)


def make_config(name: str, tasks: list[Task], cands: dict[str, Any], agent_cfg: AgentConfig, model: LatencyModel,
                store: Path, cache_mib: int, spec_depth: int, slow_seconds: float, share: str = "ksm") -> ConfigRun:
    """name: one of CONFIGS, or Spec@PLACEMENT."""
    kind, _, placement = name.partition("@")
    guard = DeterminismGuard()
    cache = spec = None
    if kind == "Full":
        # depth: every other depth and every slow call captured; cost: a state is captured when the
        # replay it saves takes as long as a capture (ToolPrefixCache's snapshot_policy).
        policy = placement or DEFAULT_SNAPSHOT_POLICY
        cache = ToolPrefixCache(SnapshotBackend(store / name), cache_mib * MiB, guard=guard,
                                snapshot_every=2, snapshot_slower_than=slow_seconds,
                                snapshot_policy=policy)  # type: ignore[arg-type]
    if kind in ("Spec", "Full"):
        tail = TailPolicy(slow_tool_seconds=slow_seconds, task_quantile=0.5,
                          online_real_calls=2 if kind == "Full" else None)
        spec = Speculator(depth=spec_depth, min_probability=0.5, tail=tail,
                          placement=placement if kind == "Spec" and placement else DEFAULT_PLACEMENT)  # type: ignore[arg-type]
    server = Server(model)
    agent = StochasticAgent(agent_cfg, server, cands)
    memory = "copy" if name == "CRIU" else share
    # CRIU: processes stay out of KSM, so restored copies are really private.
    own = [t.with_spec(ksm=False) for t in tasks] if name == "CRIU" else tasks
    engine = RolloutEngine(agent, cache=cache, speculator=spec, guard=guard, memory=memory,
                           keep_initial=True, overlap_fork=True)
    return ConfigRun(name, engine, server, own, cache)


PHASES = ("setup", "reason", "tool", "cache_hit", "audit", "materialize", "post_wait", "spec_hit", "spec_miss")


def phases(r: EpochResult, epoch_seconds: float) -> dict[str, Any]:
    """Where an epoch's time went: per event kind, the seconds of the rollout that finished last
    (the critical path) and the sum over all rollouts, and the time after the last rollout
    (teardown, the cache's persistence) that the epoch still paid."""
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
    seconds = time.monotonic() - t0
    if run.engine.speculator is not None:
        run.engine.fit_selector()
    run.results.append(r)
    reason = [s for (e, _t, _s), s in run.server.reasoning_seconds.items() if e == epoch]
    rewards = {f"{s.task_id}/{s.sample}": s.reward for s in r.samples}
    calls = r.tool_calls
    row = {
        "epoch_seconds": round(seconds, 3),
        "last_rollout_seconds": round(r.seconds, 3),
        "oracle_seconds": round(max(reason, default=0.0), 3),
        "cache_hit_rate": round(r.cache_hits / calls, 4) if calls else 0.0,
        "spec_hit_rate": round(r.spec_hits / calls, 4) if calls else 0.0,
        "hit_rate": round(r.hit_rate, 4),
        "tool_calls": calls,
        "peak_memory_bytes": max((b for _, b in memory), default=0),
        "memory": [(round(t, 2), b) for t, b in memory],
        "running": r.running_over_time(100),
        "reward": round(statistics.mean(v for v in rewards.values() if v is not None), 4)
        if any(v is not None for v in rewards.values()) else None,
        "rewards": rewards,
        "errors": [e for s in r.samples for e in s.errors],
        "wasted_speculation_seconds": round(r.wasted_seconds, 3),
        "phases": phases(r, seconds),
    }
    run.epochs.append(row)
    print(f"  {run.name:4s} epoch {epoch}: {seconds:6.1f} s (oracle {row['oracle_seconds']:5.1f} s)  hit rate "
          f"{row['hit_rate']:5.1%} (cache {r.cache_hits}, spec {r.spec_hits} of {calls})  peak "
          f"{row['peak_memory_bytes'] / MiB:7.1f} MiB  reward {row['reward']}  errors {len(row['errors'])}",
          flush=True)
    if row["phases"]:
        path = row["phases"]["critical_path"]
        print("        last rollout: " + "  ".join(f"{k} {v:.1f}" for k, v in path.items() if v)
              + f"  | after it {row['phases']['after_last_rollout']:.1f} s", flush=True)
    return row


def summarize(run: ConfigRun) -> dict[str, Any]:
    ep = run.epochs
    return {
        "epoch_seconds": [e["epoch_seconds"] for e in ep],
        "oracle_seconds": [e["oracle_seconds"] for e in ep],
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
        "phases_per_epoch": [e["phases"] for e in ep],
        "cache": run.results[-1].cache if run.results else None,
        "speculation": run.results[-1].speculation if run.results else None,
    }


async def run_seed(seed: int, args: argparse.Namespace, agent_cfg: AgentConfig, model: LatencyModel,
                   store: Path) -> dict[str, Any]:
    tasks, cands = build_tasks(args.families, seed, args.code_tasks)
    print(f"seed {seed}: tasks {[t.id for t in tasks]} x {args.group_size} samples x {args.epochs} epochs", flush=True)
    runs = {n: make_config(n, tasks, cands, dataclasses.replace(agent_cfg, seed=seed), model, store,
                           args.cache_mib, args.spec_depth, args.slow_seconds, args.share_engine)
            for n in args.configs}
    names = list(args.configs)
    try:
        for e in range(args.epochs):
            order = names[e % len(names):] + names[:e % len(names)]  # interleaved, rotating
            for n in order:
                await run_epoch(runs[n], args.group_size, e)
    finally:
        for r in runs.values():
            await r.engine.close()
            if r.cache is not None:
                await asyncio.to_thread(r.cache.close)
    out = {n: summarize(r) for n, r in runs.items()}
    trio = [n for n in runs if n.partition("@")[0] in ("Base", "Spec", "Full")]
    out["rewards_identical"] = all(runs[trio[0]].epochs[e]["rewards"] == runs[n].epochs[e]["rewards"]
                                   for n in trio for e in range(args.epochs))
    out["_series"] = {n: {"memory": [x["memory"] for x in r.epochs], "running": [x["running"] for x in r.epochs]}
                      for n, r in runs.items()}
    return out


# ---- targets and figures ----

def _spread(xs: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.mean(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "n": len(xs)}


def _later(epochs: int) -> list[int]:
    """The epochs compared: all but the first, whose selector is untrained and cache empty."""
    return list(range(1, epochs)) or [0]


def _epoch_ratios(seeds: dict[int, dict[str, Any]], a: str, b: str, later: list[int]) -> list[float]:
    """Per seed, configuration a's mean epoch time over `later` over b's: paired within the seed."""
    return [statistics.mean(s[a]["epoch_seconds"][e] for e in later)
            / statistics.mean(s[b]["epoch_seconds"][e] for e in later) for s in seeds.values()]


def _peak_ratios(seeds: dict[int, dict[str, Any]], a: str, b: str) -> list[float]:
    """Per seed, configuration a's peak memory over b's."""
    return [s[a]["peak_memory_bytes"] / s[b]["peak_memory_bytes"] for s in seeds.values()]


def summary(seeds: dict[int, dict[str, Any]], epochs: int) -> dict[str, Any]:
    """Per configuration, the mean and spread over seeds (epoch figures: the mean of the later epochs)."""
    later = _later(epochs)
    vals = list(seeds.values())
    names = [n for n in vals[0] if isinstance(vals[0][n], dict) and "epoch_seconds" in vals[0][n]]
    e3 = min(2, epochs - 1)
    return {n: {"epoch_seconds": _spread([statistics.mean(s[n]["epoch_seconds"][e] for e in later) for s in vals]),
                "oracle_seconds": _spread([statistics.mean(s[n]["oracle_seconds"][e] for e in later) for s in vals]),
                "peak_memory_mib": _spread([s[n]["peak_memory_bytes"] / MiB for s in vals]),
                "hit_rate_epoch3": _spread([s[n]["hit_rate_per_epoch"]["total"][e3] for s in vals]),
                "reward": _spread([statistics.mean(r for r in s[n]["reward_per_epoch"] if r is not None)
                                   for s in vals]),
                "errors": sum(len(s[n]["errors"]) for s in vals), "epochs": later}
            for n in names}


def placements(seeds: dict[int, dict[str, Any]], summ: dict[str, Any], epochs: int) -> dict[str, Any]:
    """Epoch time and peak memory per speculation placement ("Spec" is the default's), and each
    other placement's ratios to the default's, paired within every seed."""
    out: dict[str, Any] = {}
    for n, v in summ.items():
        kind, _, p = n.partition("@")
        if kind == "Spec":
            stats = [s[n].get("speculation") or {} for s in seeds.values()]
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
            caches = [s[n].get("cache") or {} for s in seeds.values()]
            out[p or DEFAULT_SNAPSHOT_POLICY] = {
                "config": n, "epoch_seconds": v["epoch_seconds"], "peak_memory_mib": v["peak_memory_mib"],
                "hit_rate_epoch3": v["hit_rate_epoch3"],
                # states captured, replayed calls and states persisted, over all epochs and seeds
                "cache": {k: sum(c.get(k, 0) for c in caches) for k in ("captured", "replayed_calls", "persisted")}}
    if _paired_to_default(seeds, out, DEFAULT_SNAPSHOT_POLICY, epochs):
        out["default"] = DEFAULT_SNAPSHOT_POLICY
    return out


def targets(seeds: dict[int, dict[str, Any]], epochs: int, share: str = "ksm") -> dict[str, Any]:
    later = _later(epochs)
    out: dict[str, Any] = {}
    vals = list(seeds.values())
    if all(k in vals[0] for k in ("Base", "Full")):
        out["full_speedup_vs_base"] = {**_spread([1 / x for x in _epoch_ratios(seeds, "Full", "Base", later)]),
                                       "target": 1.2, "paper": 1.22, "epochs": later}
        full_over_oracle = [statistics.mean(s["Full"]["epoch_seconds"][e] / max(s["Full"]["oracle_seconds"][e], 1e-9)
                                            for e in later) for s in vals]
        out["full_vs_oracle"] = {**_spread(full_over_oracle), "target_at_most": 1.25}
        out["full_peak_memory_vs_base"] = {**_spread(_peak_ratios(seeds, "Full", "Base")), "target_at_most": 1.1,
                                           "paper": 1.014}
        e3 = min(2, epochs - 1)
        out["full_hit_rate_epoch3"] = {**_spread([s["Full"]["hit_rate_per_epoch"]["total"][e3] for s in vals]),
                                       "target": 0.65, "aim": 0.70, "epoch": e3 + 1}
    if all(k in vals[0] for k in ("Base", "CRIU")):
        per_epoch = [[s["Base"]["peak_memory_bytes_per_epoch"][e] / max(s["CRIU"]["peak_memory_bytes_per_epoch"][e], 1)
                      for s in vals] for e in range(epochs)]
        out["base_peak_memory_vs_criu"] = {
            **_spread(_peak_ratios(seeds, "Base", "CRIU")), "target_at_most": 0.6, "engine": share,
            "per_epoch": [_spread(r) for r in per_epoch],
            **({"note": "the target is for cow in a guest; ksm merges the clones only as ksmd scans, "
                        "after the fork"} if share == "ksm" else {})}
    if all(k in vals[0] for k in ("Base", "Spec")):
        out["spec_speedup_vs_base"] = _spread([1 / x for x in _epoch_ratios(seeds, "Spec", "Base", later)])
    out["rewards_identical"] = all(s["rewards_identical"] for s in vals)
    return out


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
            pts = series[n]["running"][e]
            ax.step([t for t, _ in pts], [k for _, k in pts], where="post", color=colors[n],
                    label=f"{n} ({first[n]['epoch_seconds'][e]:.0f} s)")
        ax.set_title(f"epoch {e + 1}")
        ax.set_xlabel("time (s)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("rollouts still running")
    save(fig, "fig8_rollouts_running.png")
    trio = [n for n in names if n.partition("@")[0] in ("Base", "Spec", "Full")]
    memory_chart(trio, epochs - 1, f"Fig. 9: memory over epoch {epochs}", "fig9_memory_base_spec_full.png")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    xs = list(range(1, epochs + 1))
    for n in names:
        if n.partition("@")[0] not in ("Spec", "Full"):
            continue
        for kind, style in (("cache", "-"), ("speculation", "--"), ("total", ":")):
            if kind == "cache" and n != "Full":
                continue
            ys = [100 * statistics.mean(s[n]["hit_rate_per_epoch"][kind][e] for s in seeds.values())
                  for e in range(epochs)]
            ax.plot(xs, ys, style, marker="o", color=colors[n], label=f"{n} {kind}")
    ax.axhline(65, color="k", linewidth=0.5)
    ax.set_xticks(xs)
    ax.set_xlabel("epoch")
    ax.set_ylabel("hit rate (%), mean over seeds")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=7)
    save(fig, "fig10_hit_rate.png")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for i, n in enumerate(names):
        ys = [statistics.mean(s[n]["reward_per_epoch"][e] or 0.0 for s in seeds.values()) for e in range(epochs)]
        ax.plot([x + 0.03 * i for x in xs], ys, marker="o", color=colors[n], label=n)
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
    ap.add_argument("--quick", action="store_true", help="1 seed, code + shop, 3 samples x 3 epochs (CI)")
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
    ap.add_argument("--drift", type=float, default=AgentConfig.drift, help="added exploration per epoch")
    ap.add_argument("--explore", type=float, default=AgentConfig.explore0, help="exploration at epoch 0")
    ap.add_argument("--cache-mib", type=int, default=1024, help="resident budget of Full's prefix cache")
    ap.add_argument("--spec-depth", type=int, default=2)
    ap.add_argument("--share-engine", default="ksm", help="fork engine of Base, Spec and Full (cow in a guest)")
    ap.add_argument("--slow-seconds", type=float, default=1.0, help="a call this slow is a 'slow tool'")
    a = ap.parse_args()
    quick = {"seeds": 1, "families": "code,shop", "code_tasks": 1, "group_size": 3, "epochs": 3}
    full = {"seeds": 3, "families": "code,shop,gui", "code_tasks": 2, "group_size": 4, "epochs": 3}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.families = [f for f in a.families.split(",") if f]
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
    print("targets (reached vs target):")
    print(json.dumps(tg, indent=1))
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
    agent_cfg = AgentConfig(explore0=args.explore, drift=args.drift)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "prefix-store"
    shutil.rmtree(store, ignore_errors=True)
    print(f"latency model: {model.describe()}")
    print(f"agent: explore {agent_cfg.explore0} + drift {agent_cfg.drift} x epoch; output tokens median "
          f"{agent_cfg.output_median} (sigma {agent_cfg.output_sigma}, max {agent_cfg.output_max}); seeds "
          f"{args.seed_list}; families {args.families}; configs {args.configs} (interleaved)", flush=True)
    t0 = time.monotonic()
    seeds: dict[int, dict[str, Any]] = {}
    for seed in args.seed_list:
        seeds[seed] = await run_seed(seed, args, agent_cfg, model, store)
    shutil.rmtree(store, ignore_errors=True)
    meta = {
        "latency_model": {**dataclasses.asdict(model), "formula": model.describe()},
        "agent": dataclasses.asdict(agent_cfg),
        "share_engine": args.share_engine,
        "size": {"seeds": args.seed_list, "families": args.families, "code_tasks": args.code_tasks,
                 "group_size": args.group_size, "epochs": args.epochs, "quick": args.quick,
                 "configs": args.configs},
        "host": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "wall_seconds": round(time.monotonic() - t0, 1),
    }
    result = finish(args.out, seeds, meta)
    print(f"wrote {args.out / 'agent_rollouts.json'} and {', '.join(result['figures'])} in {meta['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
