"""Replay benchmark of BunshinRL's rollout configurations (paper section 5.3, Figs. 6-10).

python benchmarks/rollout_replay.py [--quick] [--engines copy,ksm] --out DIR

A seeded generator produces agent traces for N tasks x G samples (GRPO groups sharing prefixes)
over several epochs in which the policy drifts. Every configuration replays exactly these traces
with real tool executions in real workspaces (a repository with a bug, a test runner, a build, an
HTTP service started and queried inside the workspace), and sleeps each step's reasoning time:

  Base  memory sharing only: each group forks one initialized workspace
  Spec  + speculative tool execution (selector retrained after every epoch, tail-aware)
  Full  + tool-prefix caching (ancestor-aware LRU in memory, deduplicated deltas on disk,
          sparse snapshots rebuilt by replay)

DIR/rollout_replay.json holds per configuration epoch_seconds, hit_rate_per_epoch,
peak_memory_bytes and observations_identical (every observation equal to Base's), plus
engine_peak_memory_bytes from one Base epoch per fork engine; DIR/*.png are the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bunshinrl import (
    DeterminismGuard,
    EpochResult,
    RolloutEngine,
    SnapshotBackend,
    Speculator,
    TailPolicy,
    Task,
    ToolPrefixCache,
    train_selector,
    workload,
)
from bunshinrl import traces as T

MiB = 1 << 20


def build_tasks(cfg: T.TraceConfig, wait: float, ksm: bool = True) -> list[Task]:
    # Without KSM opt-in for the copy engine: restored clones would otherwise still be merged
    # by ksmd (their VMAs keep the mergeable flag), and "copy" would not be a private-copy baseline.
    return [Task(tid, workload.environment(T.task_seed(cfg, i), wait=wait, ksm=ksm))
            for i, tid in enumerate(T.task_ids(cfg))]


async def run_config(name: str, cfg: T.TraceConfig, traces: dict, tasks: list[Task], memory: str,
                     store: Path, cache_mib: int, epochs: int, spec_depth: int,
                     slow_seconds: float = 1.0) -> list[EpochResult]:
    guard = DeterminismGuard()
    cache = None
    spec = None
    if name == "Full":
        # Sparse snapshots: every second depth, and every call slower than 1 s (replaying those
        # would cost more than keeping them).
        cache = ToolPrefixCache(SnapshotBackend(store), cache_mib * MiB, guard=guard,
                                snapshot_every=2, snapshot_slower_than=slow_seconds)
    if name in ("Spec", "Full"):
        # Tail: samples of historically slow tasks; with the prefix cache also any sample that has
        # already run 2 calls for real (it left the cached paths and will finish last).
        tail = TailPolicy(slow_tool_seconds=slow_seconds, task_quantile=0.5,
                          online_real_calls=2 if name == "Full" else None)
        spec = Speculator(depth=spec_depth, min_probability=0.5, tail=tail)
    engine = RolloutEngine(T.ReplayPolicy(traces), cache=cache, speculator=spec, guard=guard, memory=memory)
    out = []
    try:
        for e in range(epochs):
            r = await engine.run_epoch(tasks, cfg.group_size, e)
            out.append(r)
            report = engine.fit_selector() if spec is not None else None
            print(f"  {name:4s} epoch {e}: {r.seconds:6.1f}s  hit rate {r.hit_rate:5.1%} "
                  f"(cache {r.cache_hits}, spec {r.spec_hits} of {r.tool_calls})  "
                  f"peak {r.peak_memory_bytes / MiB:6.1f} MiB  errors {sum(len(s.errors) for s in r.samples)}"
                  + (f"  selector top1 {report.top1:.2f}" if report and report.test_examples else ""),
                  flush=True)
    finally:
        if cache is not None:
            await asyncio.to_thread(cache.close)
    return out


def summarize(name: str, results: list[EpochResult], base: list[EpochResult] | None) -> dict[str, Any]:
    identical = base is not None and all(
        r.observations() == b.observations() for r, b in zip(results, base, strict=True))
    last = results[-1]
    return {
        "epoch_seconds": [round(r.seconds, 3) for r in results],
        "median_rollout_seconds_per_epoch": [round(statistics.median(s.finished for s in r.samples), 3)
                                             for r in results],
        "hit_rate_per_epoch": [round(r.hit_rate, 4) for r in results],
        "cache_hits_per_epoch": [r.cache_hits for r in results],
        "spec_hits_per_epoch": [r.spec_hits for r in results],
        "tool_calls_per_epoch": [r.tool_calls for r in results],
        "peak_memory_bytes": max(r.peak_memory_bytes for r in results),
        "peak_memory_bytes_per_epoch": [r.peak_memory_bytes for r in results],
        "peak_workspace_bytes_per_epoch": [r.peak_workspace_bytes for r in results],
        "memory_byte_seconds_per_epoch": [round(r.memory_byte_seconds) for r in results],
        "wasted_speculation_seconds_per_epoch": [round(r.wasted_seconds, 3) for r in results],
        "observations_identical": True if name == "Base" else identical,
        "errors": [e for r in results for s in r.samples for e in s.errors],
        "cache": last.cache,
        "speculation": last.speculation,
        "guard": last.guard,
        "samples_per_epoch": [[s.summary() for s in r.samples] for r in results],
    }


def plots(out: Path, runs: dict[str, list[EpochResult]], engines: dict[str, EpochResult]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    colors = {"Base": "tab:gray", "Spec": "tab:orange", "Full": "tab:blue"}
    epochs = len(next(iter(runs.values())))
    # Fig. 8: rollouts still running over time, per epoch.
    fig, axes = plt.subplots(1, epochs, figsize=(4 * epochs, 3.2), sharey=True, squeeze=False)
    for e in range(epochs):
        ax = axes[0][e]
        for name, rs in runs.items():
            pts = rs[e].running_over_time()
            ax.step([t for t, _ in pts], [n for _, n in pts], where="post", color=colors[name],
                    label=f"{name} ({rs[e].seconds:.1f} s)")
        ax.set_title(f"epoch {e + 1}")
        ax.set_xlabel("time (s)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("rollouts still running")
    fig.tight_layout()
    files.append(_save(fig, out / "fig8_rollouts_running.png"))
    # Fig. 9: memory over the last epoch (workspaces plus resident cache snapshots).
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, rs in runs.items():
        r = rs[-1]
        ax.plot([t for t, _, _ in r.memory], [(w + c) / MiB for _, w, c in r.memory], color=colors[name],
                label=f"{name} (peak {r.peak_memory_bytes / MiB:.0f} MiB)")
        if any(c for _, _, c in r.memory):
            ax.plot([t for t, _, _ in r.memory], [w / MiB for _, w, _ in r.memory], color=colors[name],
                    linestyle=":", label=f"{name}, workspaces only")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("memory (MiB)")
    ax.set_title(f"memory over epoch {epochs}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(_save(fig, out / "fig9_memory.png"))
    # Fig. 10: hit rate per epoch.
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name in ("Spec", "Full"):
        if name in runs:
            ax.plot(range(1, epochs + 1), [100 * r.hit_rate for r in runs[name]], marker="o",
                    color=colors[name], label=name)
    ax.set_xticks(range(1, epochs + 1))
    ax.set_xlabel("epoch")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.legend()
    fig.tight_layout()
    files.append(_save(fig, out / "fig10_hit_rate.png"))
    # Figs. 6/7: one Base epoch per fork engine on one chart.
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for eng, r in engines.items():
        ax.plot([t for t, _, _ in r.memory], [w / MiB for _, w, _ in r.memory],
                label=f"{eng} (peak {r.peak_memory_bytes / MiB:.0f} MiB, {r.seconds:.1f} s)")
    ax.set_xlabel("time since the epoch started (s)")
    ax.set_ylabel("workspace memory, PSS (MiB)")
    ax.set_title("Base epoch per fork engine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, out / "fig6_7_engine_memory.png"))
    return files


def _save(fig: Any, path: Path) -> str:
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 tasks x 4 samples x 3 epochs (a few minutes)")
    ap.add_argument("--engines", default="copy,ksm", help="fork engines for the engine-memory run")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory", default="auto", help="fork engine of the Base/Spec/Full runs")
    ap.add_argument("--tasks", type=int)
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--wait", type=float, default=1.5, help="I/O stand-in of slow tools, seconds")
    ap.add_argument("--cache-mib", type=int, default=192, help="resident budget of the prefix cache")
    ap.add_argument("--spec-depth", type=int, default=2)
    args = ap.parse_args()

    if args.quick:
        tasks_n, group, epochs = 3, 4, 3
    else:
        tasks_n, group, epochs = 4, 6, 5
    cfg = T.TraceConfig(tasks=args.tasks or tasks_n, group_size=args.group_size or group,
                        epochs=args.epochs or epochs, seed=args.seed)
    traces = T.generate(cfg)
    tasks = build_tasks(cfg, args.wait)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "prefix-store"
    shutil.rmtree(store, ignore_errors=True)
    print(f"traces: {cfg.tasks} tasks x {cfg.group_size} samples x {cfg.epochs} epochs; "
          f"prefix hit rate from earlier epochs alone: "
          f"{[round(x, 2) for x in T.prefix_hit_rates(traces, cfg.epochs)]}", flush=True)

    t_start = time.monotonic()
    runs: dict[str, list[EpochResult]] = {}
    for name in ("Base", "Spec", "Full"):
        print(f"{name}:", flush=True)
        runs[name] = await run_config(name, cfg, traces, tasks, args.memory, store, args.cache_mib, cfg.epochs,
                                      args.spec_depth)
    engines: dict[str, EpochResult] = {}
    for eng in [e for e in args.engines.split(",") if e]:
        if eng == args.memory and eng != "copy":
            engines[eng] = runs["Base"][0]
            continue
        print(f"Base with the {eng} fork engine:", flush=True)
        eng_tasks = build_tasks(cfg, args.wait, ksm=eng != "copy")
        engines[eng] = (await run_config("Base", cfg, traces, eng_tasks, eng, store, args.cache_mib, 1,
                                         args.spec_depth))[0]

    base = runs["Base"]
    configs = {name: summarize(name, rs, base) for name, rs in runs.items()}
    for name in ("Spec", "Full"):
        configs[name]["speedup_vs_base_per_epoch"] = [
            round(b.seconds / r.seconds, 3) for b, r in zip(base, runs[name], strict=True)]
        configs[name]["median_rollout_speedup_vs_base_per_epoch"] = [
            round(b / r, 3) for b, r in zip(configs["Base"]["median_rollout_seconds_per_epoch"],
                                            configs[name]["median_rollout_seconds_per_epoch"], strict=True)]
    sel_trajs = [t for r in base for t in r.trajectories()]
    selector = None
    if cfg.epochs > 1:
        _sel, rep = train_selector(sel_trajs, k=3)
        selector = asdict(rep)
    full = configs["Full"]
    third = min(2, cfg.epochs - 1)
    result = {
        "trace_config": asdict(cfg),
        "tool_wait_seconds": args.wait,
        "fork_engine": args.memory,
        "prefix_hit_rate_from_earlier_epochs": [round(x, 4) for x in T.prefix_hit_rates(traces, cfg.epochs)],
        "configs": configs,
        "engine_peak_memory_bytes": {eng: r.peak_memory_bytes for eng, r in engines.items()},
        "engine_epoch_seconds": {eng: round(r.seconds, 3) for eng, r in engines.items()},
        "selector_held_out": selector,
        "targets": {
            "full_speedup_per_epoch": full["speedup_vs_base_per_epoch"],
            "full_speedup_min_later_epochs": min(full["speedup_vs_base_per_epoch"][1:] or [0.0]),
            "full_speedup_target": 1.35,
            "full_median_rollout_speedup_per_epoch": full["median_rollout_speedup_vs_base_per_epoch"],
            "full_hit_rate_epoch3": full["hit_rate_per_epoch"][third],
            "full_hit_rate_target": 0.70,
            "observations_identical": all(c["observations_identical"] for c in configs.values()),
        },
        "host": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "wall_seconds": round(time.monotonic() - t_start, 1),
    }
    result["figures"] = plots(args.out, runs, engines)
    (args.out / "rollout_replay.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(store, ignore_errors=True)
    print(json.dumps(result["targets"], indent=1))
    print(f"engine peak memory: { {k: f'{v / MiB:.1f} MiB' for k, v in result['engine_peak_memory_bytes'].items()} }")
    print(f"wrote {args.out / 'rollout_replay.json'} and {', '.join(result['figures'])} "
          f"in {result['wall_seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
