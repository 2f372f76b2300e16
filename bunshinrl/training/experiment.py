"""Training runs side by side, for the demo and benchmarks/grpo_llm.py.

A run trains the test model (a fresh copy per seed) with one engine configuration, or rolls
out the untrained copy without updating ("Random": the baseline under the same decoding
constraints). The backend is "hf" (HFPolicy generating in process) or "vllm" (a real vLLM
server rolls out, HFPolicy learns, weights are synced into the server after every update).
Runs go one after another, never at once: they would fight for the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..calls.task import Task

MiB = 1 << 20
BACKENDS = ("hf", "vllm")


@dataclass
class Run:
    name: str  # Random, Base, Spec or Full
    seed: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    weight_syncs: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0

    def series(self, key: str) -> list[Any]:
        return [r[key] for r in self.rows]


def _row(m: Any) -> dict[str, Any]:
    return {"epoch": m.epoch, "reward": m.reward_mean, "reward_by_family": dict(m.reward_by_family),
            "rollout_seconds": m.rollout_seconds, "update_seconds": m.update_seconds, "sync_seconds": m.sync_seconds,
            "weight_version": m.weight_version, "hit_rate": m.hit_rate, "cache_hits": m.cache_hits,
            "spec_hits": m.spec_hits, "tool_calls": m.tool_calls, "peak_memory_bytes": m.peak_memory_bytes,
            "trajectory_digest": m.trajectory_digest, "params_digest": m.params_digest, "errors": m.errors,
            "loss": m.loss, "clip_fraction": m.clip_fraction, "kl": m.kl, "tokens_trained": m.tokens_trained,
            "sequences": m.sequences, "logprob_drift": m.logprob_drift, "audit": m.extra.get("audit")}


class Lab:
    """Test models per seed and, for the vllm backend, one server for every run."""

    def __init__(self, backend: str, root: Path, *, max_num_seqs: int = 8, log_dir: Path | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
        self.backend = backend
        self.root = root
        self.max_num_seqs = max_num_seqs
        self.log_dir = log_dir
        self.server: Any = None
        self.server_seconds = 0.0

    def model(self, seed: int) -> Path:
        from . import testmodel

        path = self.root / f"model-seed{seed}"
        if not (path / "config.json").exists():
            testmodel.make(path, seed=seed)
        return path

    def start(self) -> None:
        if self.backend != "vllm" or self.server is not None:
            return
        from ..policies.vllm_server import VLLMServer

        t = time.monotonic()
        log = (self.log_dir / "vllm-server.log") if self.log_dir is not None else None
        # Any seed's directory: config and tokenizer are the same, and every run first pushes its
        # own initial weights.
        self.server = VLLMServer(self.model(0), max_num_seqs=self.max_num_seqs, log_path=log).start()
        self.server_seconds += time.monotonic() - t

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def restart(self, max_num_seqs: int) -> None:
        """Serve with another batch size from the next run on."""
        if max_num_seqs != self.max_num_seqs:
            self.close()
            self.max_num_seqs = max_num_seqs

    def trainer(self, name: str, tasks: Sequence[Task], grpo: Any, seed: int, store: Path | None,
                policy: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        """policy: HFPolicy's options for the learner (which is also the in-process rollout),
        e.g. max_new_tokens."""
        from ..policies.hf_policy import HFPolicy
        from .trainer import GRPOTrainer

        learner = HFPolicy.from_pretrained(self.model(seed), tasks, seed=seed, **(policy or {}))
        engine = "Base" if name == "Random" else name
        common: dict[str, Any] = {"config": grpo, "engine": engine, "learn": name != "Random", "store_dir": store,
                                  **kwargs}
        if self.backend == "hf":
            return GRPOTrainer(learner, tasks, **common)
        from ..policies.openai_policy import OpenAIPolicy
        from .sync import VLLMServerSync

        self.start()
        rollout = OpenAIPolicy(self.server.base_url, self.server.model, tasks, seed=seed,
                               constrain=learner.constrain)
        sync = VLLMServerSync(self.server.root_url, rollout_policy=rollout, directory=self.root / "sync")
        return GRPOTrainer(learner, tasks, rollout_policy=rollout, weight_sync=sync, **common)


@contextlib.contextmanager
def lab(backend: str, *, max_num_seqs: int = 8, log_dir: Path | None = None) -> Iterator[Lab]:
    with tempfile.TemporaryDirectory(prefix="bunshin-grpo-lab-") as d:
        lb = Lab(backend, Path(d), max_num_seqs=max_num_seqs, log_dir=log_dir)
        try:
            yield lb
        finally:
            lb.close()


def run(lb: Lab, name: str, tasks: Sequence[Task], epochs: int, grpo: Any, seed: int,
        log: Callable[[str, dict[str, Any]], None] | None = None, policy: Mapping[str, Any] | None = None,
        **kwargs: Any) -> Run:
    """One training run (or, for "Random", the untrained model rolled out `epochs` times)."""
    out = Run(name, seed)
    t0 = time.monotonic()

    async def main() -> None:
        with tempfile.TemporaryDirectory(prefix="bunshin-grpo-store-") as store:
            trainer = lb.trainer(name, tasks, grpo, seed, Path(store) if name == "Full" else None, policy=policy,
                                 **kwargs)
            try:
                while trainer.epoch < epochs:
                    row = _row(await trainer.step())
                    out.rows.append(row)
                    if log is not None:
                        log(name, row)
            finally:
                await trainer.aclose()
                close = getattr(trainer.weight_sync, "close", None)
                if callable(close):
                    close()
            out.weight_syncs = list(trainer.weight_syncs)

    asyncio.run(main())
    out.wall_seconds = time.monotonic() - t0
    return out


def identical(a: Run, b: Run) -> bool:
    """Same trajectories, rewards and weights in every epoch `a` ran (b may have run longer)."""
    return 0 < len(a.rows) <= len(b.rows) and all(
        x["trajectory_digest"] == y["trajectory_digest"] and x["params_digest"] == y["params_digest"]
        and x["reward"] == y["reward"] for x, y in zip(a.rows, b.rows[:len(a.rows)], strict=True))


def config_summary(r: Run, base: Run | None) -> dict[str, Any]:
    drifts = [d for d in r.series("logprob_drift") if d is not None]
    return {
        "seed": r.seed,
        "reward_per_epoch": r.series("reward"),
        "reward_by_family_per_epoch": r.series("reward_by_family"),
        "rollout_seconds_per_epoch": r.series("rollout_seconds"),
        "update_seconds_per_epoch": r.series("update_seconds"),
        "hit_rate_per_epoch": r.series("hit_rate"),
        "cache_hits_per_epoch": r.series("cache_hits"),
        "spec_hits_per_epoch": r.series("spec_hits"),
        "tool_calls_per_epoch": r.series("tool_calls"),
        "tokens_trained_per_epoch": r.series("tokens_trained"),
        "logprob_drift_per_epoch": r.series("logprob_drift"),
        "logprob_drift_mean": statistics.fmean(drifts) if drifts else None,
        "peak_memory_bytes": max(r.series("peak_memory_bytes"), default=0),
        "errors_per_epoch": r.series("errors"),
        "trajectory_digests": r.series("trajectory_digest"),
        "params_digests": r.series("params_digest"),
        "weight_syncs": r.weight_syncs,
        "identical_to_base": None if base is None else identical(r, base),
        "epochs_compared": None if base is None else len(r.rows),
        "wall_seconds": r.wall_seconds,
    }


def _stats(xs: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def learning(trained: Sequence[Run], random: Sequence[Run], tail: int = 2) -> dict[str, Any]:
    """Final reward (mean of the last `tail` epochs) of each seed's trained run against its
    untrained baseline (mean over all its epochs: its policy never changes), across seeds.
    Beats random when the margin exceeds the seeds' spread (trained std + random std)."""
    final = {r.seed: statistics.fmean(r.series("reward")[-tail:]) for r in trained}
    base = {r.seed: statistics.fmean(r.series("reward")) for r in random}
    t, b = _stats(list(final.values())), _stats(list(base.values()))
    margin = t["mean"] - b["mean"]
    return {"seeds": sorted(final), "tail_epochs": tail, "trained_final_per_seed": final,
            "random_per_seed": base, "trained_final": t, "random": b, "margin": margin,
            "spread": t["std"] + b["std"], "beats_random": margin > t["std"] + b["std"]}


def mean_series(runs: Sequence[Run], key: str = "reward") -> list[float]:
    return [statistics.fmean(x) for x in zip(*(r.series(key) for r in runs), strict=True)]


def plot(trained: Sequence[Run], random: Sequence[Run], configs: Mapping[str, Run], path: Path,
         title: str) -> Path:
    """Reward per epoch (each seed, their mean, the untrained baseline), hit rate of Spec and
    Full, rollout time per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in trained:
        axes[0].plot(range(1, len(r.rows) + 1), r.series("reward"), color="tab:blue", alpha=0.3, lw=1)
    for r in random:
        axes[0].plot(range(1, len(r.rows) + 1), r.series("reward"), color="tab:gray", alpha=0.3, lw=1, ls=":")
    if trained:
        axes[0].plot(range(1, len(trained[0].rows) + 1), mean_series(trained), color="tab:blue", marker="o",
                     label=f"trained (mean of {len(trained)} seeds)")
    if random:
        axes[0].plot(range(1, len(random[0].rows) + 1), mean_series(random), color="tab:gray", ls=":", marker="x",
                     label="untrained, same constraints")
    styles = {"Base": ("tab:blue", "-", "o"), "Spec": ("tab:orange", "--", "s"), "Full": ("tab:green", "-.", "^")}
    for name, r in configs.items():
        color, ls, marker = styles.get(name, ("black", "-", "."))
        xs = range(1, len(r.rows) + 1)
        if name != "Base":
            axes[1].plot(xs, [h * 100 for h in r.series("hit_rate")], ls=ls, marker=marker, color=color, label=name)
        axes[2].plot(xs, r.series("rollout_seconds"), ls=ls, marker=marker, color=color, label=name)
    axes[0].set(title="Training reward", xlabel="Epoch", ylabel="Mean rollout reward", ylim=(0, 1.05))
    axes[1].set(title="Hit rate (paper Fig. 10)", xlabel="Epoch", ylabel="Tool calls served (%)", ylim=(0, 100))
    axes[2].set(title="Rollout time per epoch", xlabel="Epoch", ylabel="Seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, name: str, report: Mapping[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return path


def format_row(name: str, seed: int, row: Mapping[str, Any]) -> str:
    fam = " ".join(f"{k}={v:.2f}" for k, v in row["reward_by_family"].items())
    drift = row["logprob_drift"]
    return (f"  {name:6s} seed {seed} epoch {row['epoch']:2d}  reward {row['reward']:.3f} ({fam})  rollout "
            f"{row['rollout_seconds']:5.1f}s  update {row['update_seconds']:4.1f}s  sync {row['sync_seconds']:.2f}s "
            f"(v{row['weight_version']})  hit {row['hit_rate']:5.1%}  tokens {row['tokens_trained']:5d}"
            + (f"  drift {drift:.1e}" if drift is not None else "")
            + (f"  errors {row['errors']}" if row["errors"] else ""))
