"""The paper's figures (Figs. 6-11) drawn from a run's results."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bunshinrl.rollout.configs import CONFIGS as ENGINE_CONFIGS
from bunshinrl.rollout.configs import speculates

from .configs import MiB


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

