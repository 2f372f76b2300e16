"""Training runs side by side: Random (baseline), Base, Spec, Full. Used by the demo and by
benchmarks/grpo_train.py; writes one JSON report and the reward plot."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .rollout import HarnessPolicy, RandomPolicy, episodes, make_engine, trajectory_digest
from .tasks import VerifiableTask

MiB = 1 << 20
ALL = ("Random", "Base", "Spec", "Full")


def _epoch_row(epoch: int, reward_mean: float, by_family: Mapping[str, float], seconds: float, hit_rate: float,
               cache_hits: int, spec_hits: int, tool_calls: int, peak: int, digest: str, params: str | None,
               errors: int) -> dict[str, Any]:
    return {"epoch": epoch, "reward": reward_mean, "reward_by_family": dict(by_family), "rollout_seconds": seconds,
            "hit_rate": hit_rate, "cache_hits": cache_hits, "spec_hits": spec_hits, "tool_calls": tool_calls,
            "peak_memory_bytes": peak, "trajectory_digest": digest, "params_digest": params, "errors": errors}


async def random_baseline(tasks: Sequence[VerifiableTask], epochs: int, group_size: int, *, seed: int = 0,
                          think_seconds: float = 0.0,
                          log: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """The uniform-random policy through the Base engine: what reward chance alone gets."""
    tmap = {t.id: t for t in tasks}
    bundle = make_engine("Base", HarnessPolicy(RandomPolicy(tmap, seed), tmap, think_seconds), tasks)
    rows = []
    try:
        for e in range(epochs):
            r = await bundle.engine.run_epoch([t.task() for t in tasks], group_size, e)
            eps = episodes(r, tmap)
            fam: dict[str, list[float]] = defaultdict(list)
            for ep in eps:
                fam[tmap[ep.task_id].family].append(ep.reward)
            row = _epoch_row(e, statistics.fmean(ep.reward for ep in eps),
                             {k: statistics.fmean(v) for k, v in sorted(fam.items())}, r.seconds, r.hit_rate,
                             r.cache_hits, r.spec_hits, r.tool_calls, r.peak_memory_bytes, trajectory_digest(eps),
                             None, sum(not ep.ok for ep in eps))
            rows.append(row)
            if log is not None:
                log(row)
    finally:
        await bundle.aclose()
    return rows


async def train(config: str, tasks: Sequence[VerifiableTask], epochs: int, *, grpo: Any, seed: int = 0,
                think_seconds: float = 0.0, checkpoint_dir: Path | None = None,
                log: Callable[[dict[str, Any]], None] | None = None, **engine_kwargs: Any) -> list[dict[str, Any]]:
    """One GRPO run with the Base, Spec or Full engine; one row per epoch."""
    from .torch_policy import TorchPolicy
    from .trainer import GRPOTrainer

    policy = TorchPolicy.for_tasks(tasks, seed=seed)
    with tempfile.TemporaryDirectory(prefix="bunshin-grpo-store-") as store:
        trainer = GRPOTrainer(policy, tasks, config=grpo, engine=config, think_seconds=think_seconds,  # type: ignore[arg-type]
                              checkpoint_dir=checkpoint_dir, store_dir=Path(store) if config == "Full" else None,
                              **engine_kwargs)
        rows = []
        try:
            while trainer.epoch < epochs:
                m = await trainer.step()
                row = _epoch_row(m.epoch, m.reward_mean, m.reward_by_family, m.rollout_seconds, m.hit_rate,
                                 m.cache_hits, m.spec_hits, m.tool_calls, m.peak_memory_bytes, m.trajectory_digest,
                                 m.params_digest, m.errors)
                row.update(loss=m.loss, clip_fraction=m.clip_fraction, update_seconds=m.update_seconds,
                           logprob_drift=m.logprob_drift)
                rows.append(row)
                if log is not None:
                    log(row)
        finally:
            await trainer.aclose()
    return rows


def summarize(runs: Mapping[str, Sequence[Mapping[str, Any]]], wall: Mapping[str, float]) -> dict[str, Any]:
    """Per configuration the series the report asks for, and whether each equals Base's run."""
    base = runs.get("Base")
    out: dict[str, Any] = {}
    for name, rows in runs.items():
        identical = None
        if name != "Random" and base is not None:
            identical = len(rows) == len(base) and all(
                r["trajectory_digest"] == b["trajectory_digest"] and r["params_digest"] == b["params_digest"]
                and r["reward"] == b["reward"] for r, b in zip(rows, base, strict=False))
        out[name] = {
            "reward_per_epoch": [r["reward"] for r in rows],
            "reward_by_family_per_epoch": [r["reward_by_family"] for r in rows],
            "rollout_seconds_per_epoch": [r["rollout_seconds"] for r in rows],
            "hit_rate_per_epoch": [r["hit_rate"] for r in rows],
            "cache_hits_per_epoch": [r["cache_hits"] for r in rows],
            "spec_hits_per_epoch": [r["spec_hits"] for r in rows],
            "tool_calls_per_epoch": [r["tool_calls"] for r in rows],
            "peak_memory_bytes_per_epoch": [r["peak_memory_bytes"] for r in rows],
            "peak_memory_bytes": max((r["peak_memory_bytes"] for r in rows), default=0),
            "errors_per_epoch": [r["errors"] for r in rows],
            "trajectory_digests": [r["trajectory_digest"] for r in rows],
            "identical_to_base": identical,
            "wall_seconds": wall.get(name),
        }
    return out


def learning_verdict(summary: Mapping[str, Any], trained: str = "Base", tail: int = 2) -> dict[str, Any]:
    """Did training beat chance? Mean reward of the last `tail` epochs against the random policy's
    mean over all its epochs, overall and per task family."""
    if trained not in summary or "Random" not in summary:
        return {}
    t, r = summary[trained], summary["Random"]
    fam_t = t["reward_by_family_per_epoch"][-tail:]
    fam_r = r["reward_by_family_per_epoch"]
    fams = sorted(fam_t[-1]) if fam_t else []
    per_family = {f: {"trained": statistics.fmean(x[f] for x in fam_t),
                      "random": statistics.fmean(x[f] for x in fam_r)} for f in fams}
    return {
        "trained_config": trained,
        "trained_final_reward": statistics.fmean(t["reward_per_epoch"][-tail:]),
        "trained_first_reward": t["reward_per_epoch"][0],
        "random_mean_reward": statistics.fmean(r["reward_per_epoch"]),
        "per_family": per_family,
        "families_beating_random": [f for f, v in per_family.items() if v["trained"] > v["random"]],
    }


def plot(summary: Mapping[str, Any], path: Path, title: str = "GRPO on bunshinrl") -> Path:
    """Reward per epoch for every configuration, hit rate (Spec, Full) and rollout time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"Random": ("tab:gray", ":", "x"), "Base": ("tab:blue", "-", "o"), "Spec": ("tab:orange", "--", "s"),
              "Full": ("tab:green", "-.", "^")}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, s in summary.items():
        color, ls, marker = styles.get(name, ("black", "-", "."))
        xs = list(range(1, len(s["reward_per_epoch"]) + 1))
        label = name + (" (= Base)" if s.get("identical_to_base") and name != "Base" else "")
        # Identical curves would hide each other; shrinking markers keeps every one visible.
        size = {"Base": 9, "Spec": 6, "Full": 3}.get(name, 6)
        axes[0].plot(xs, s["reward_per_epoch"], ls=ls, marker=marker, ms=size, color=color, label=label)
        if name in ("Spec", "Full"):
            axes[1].plot(xs, [h * 100 for h in s["hit_rate_per_epoch"]], ls=ls, marker=marker, color=color,
                         label=name)
        axes[2].plot(xs, s["rollout_seconds_per_epoch"], ls=ls, marker=marker, color=color, label=name)
    axes[0].set(title="Training reward (paper Fig. 11)", xlabel="Epoch", ylabel="Mean rollout reward", ylim=(0, 1.05))
    axes[1].set(title="Hit rate (paper Fig. 10)", xlabel="Epoch", ylabel="Tool calls served (%)", ylim=(0, 100))
    axes[2].set(title="Rollout time per epoch", xlabel="Epoch", ylabel="Seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_all(tasks: Sequence[VerifiableTask], configs: Sequence[str], epochs: int, grpo: Any, *, seed: int = 0,
            think_seconds: float = 0.0, log: Callable[[str, dict[str, Any]], None] | None = None,
            **engine_kwargs: Any) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Every configuration in turn, one after another (they would fight for the cores)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    wall: dict[str, float] = {}
    for name in configs:
        t0 = time.monotonic()
        row_log = (lambda row, n=name: log(n, row)) if log is not None else None
        if name == "Random":
            runs[name] = asyncio.run(random_baseline(tasks, epochs, grpo.group_size, seed=seed,
                                                     think_seconds=think_seconds, log=row_log))
        else:
            runs[name] = asyncio.run(train(name, tasks, epochs, grpo=grpo, seed=seed, think_seconds=think_seconds,
                                           log=row_log, **engine_kwargs))
        wall[name] = time.monotonic() - t0
    return summarize(runs, wall), runs


def write_report(out: Path, name: str, report: Mapping[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return path


def format_row(config: str, row: Mapping[str, Any]) -> str:
    fam = " ".join(f"{k}={v:.2f}" for k, v in row["reward_by_family"].items())
    return (f"  {config:6s} epoch {row['epoch']:2d}  reward {row['reward']:.3f} ({fam})  rollout "
            f"{row['rollout_seconds']:5.1f}s  hit rate {row['hit_rate']:5.1%} (cache {row['cache_hits']}, spec "
            f"{row['spec_hits']} of {row['tool_calls']})  peak {row['peak_memory_bytes'] / MiB:6.1f} MiB"
            + (f"  errors {row['errors']}" if row["errors"] else ""))
