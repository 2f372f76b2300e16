"""A settle sweep (issue 38): runs at different --settle are its points. Each point's runs (its
seeds) merge as one result of their own; the sweep then sets the points side by side: the
ceiling C = Base / oracle, Full's and Spec's speedups over Base, the removed share, the
settle's share of Base - oracle beside settle 0, and the figure speedup against ceiling with
the lines S = C (every removable second removed) and S = 1 (none)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .stats import compared_sum, later_epochs


def removable_seconds(result: dict[str, Any]) -> dict[str, float]:
    """Per seed, Base - oracle summed over the compared epochs that Base and Full both ran."""
    later = later_epochs(result["size"]["epochs"])
    return {k: compared_sum(s, "Base", "epoch_seconds", later) - compared_sum(s, "Base", "oracle_seconds", later)
            for k, s in result["seeds"].items() if "Base" in s and "Full" in s}


def point(settle: float, result: dict[str, Any]) -> dict[str, Any]:
    """One sweep point from its merged result."""
    tg = result["targets"]
    full = tg.get("full_speedup_vs_base", {})
    spec = tg.get("spec_speedup_vs_base", {})

    def kept(d: dict[str, Any], keys: tuple[str, ...] = ("mean", "min", "max", "n")) -> dict[str, Any] | None:
        return {k: d[k] for k in keys if k in d} or None

    return {"settle_seconds": settle, "seeds": result["size"]["seeds"],
            "ceiling": full.get("ceiling_base_over_oracle"), "full_speedup": kept(full), "spec_speedup": kept(spec),
            "removed_share": kept(tg.get("removed_share", {}), ("mean", "min", "max", "n", "met")),
            "base_minus_oracle_seconds": {k: round(v, 2) for k, v in removable_seconds(result).items()}}


def settle_shares(points: list[dict[str, Any]]) -> None:
    """Beside each settled point, settle 0's: its S, and the settle's share of Base - oracle,
    (B-O(s) - B-O(0)) / B-O(s), paired by seed over the seeds both points ran (None without a
    settle-0 point or a shared seed)."""
    zero = next((p for p in points if p["settle_seconds"] == 0), None)
    for p in points:
        p["full_speedup_at_settle_0"] = zero["full_speedup"] if zero is not None and p is not zero else None
        shared = sorted(set(p["base_minus_oracle_seconds"]) & set(zero["base_minus_oracle_seconds"])) \
            if zero is not None and p is not zero else []
        shares = [(p["base_minus_oracle_seconds"][k] - zero["base_minus_oracle_seconds"][k])
                  / p["base_minus_oracle_seconds"][k] for k in shared if p["base_minus_oracle_seconds"][k] > 0]
        p["settle_share_of_removable"] = ({"mean": round(statistics.mean(shares), 4), "seeds": [int(k) for k in shared]}
                                          if shares else None)


def figure(out: Path, points: list[dict[str, Any]]) -> str | None:
    """Speedup against ceiling: a point per settle for Full (and Spec where it ran), with S = C
    and S = 1."""
    drawn = [p for p in points if p["ceiling"] and p["full_speedup"]]
    if not drawn:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    top = max(max(p["ceiling"]["max"], p["full_speedup"]["max"]) for p in drawn) * 1.05
    ax.plot([1, top], [1, top], color="tab:gray", ls="--", lw=1, label="S = C (all removable time removed)")
    ax.axhline(1.0, color="black", lw=0.8, label="S = 1")
    # The removed-share target as a curve: Full = Base - R (Base - oracle), so S = 1 / (1 - R (1 - 1/C)).
    cs = [1 + (top - 1) * i / 50 for i in range(51)]
    ax.plot(cs, [1 / (1 - 0.6 * (1 - 1 / c)) for c in cs], color="tab:green", ls=":", lw=1, label="R = 60% (target)")
    for key, color, label in (("full_speedup", "tab:blue", "Full"), ("spec_speedup", "tab:orange", "Spec")):
        pts = [p for p in drawn if p[key]]
        if not pts:
            continue
        xs, ys = [p["ceiling"]["mean"] for p in pts], [p[key]["mean"] for p in pts]
        yerr = [[y - p[key]["min"] for y, p in zip(ys, pts, strict=True)],
                [p[key]["max"] - y for y, p in zip(ys, pts, strict=True)]]
        xerr = [[x - p["ceiling"]["min"] for x, p in zip(xs, pts, strict=True)],
                [p["ceiling"]["max"] - x for x, p in zip(xs, pts, strict=True)]]
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o", color=color, label=label, capsize=3)
        for x, y, p in zip(xs, ys, pts, strict=True):
            ax.annotate(f"settle {p['settle_seconds']:g} s", (x, y), textcoords="offset points", xytext=(4, -10),
                        fontsize=7, color=color)
    ax.set_xlabel("ceiling C = Base / oracle")
    ax.set_ylabel("speedup S over Base")
    ax.set_title("Speedup against ceiling, per settle (epochs 2+, summed)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    name = "speedup_vs_ceiling.png"
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def sweep(groups: dict[float, list[tuple[Path, dict[str, Any]]]], out: Path,
          merge_one: Callable[[list[tuple[Path, dict[str, Any]]], Path], dict[str, Any]]) -> int:
    """Merge each settle's runs into out/settle-S/, then write out/sweep.json and the figure."""
    out.mkdir(parents=True, exist_ok=True)
    points = [point(s, merge_one(runs, out / f"settle-{s:g}")) for s, runs in sorted(groups.items())]
    settle_shares(points)
    fig = figure(out, points)
    (out / "sweep.json").write_text(json.dumps({"points": points, "figure": fig}, indent=1))
    print("settle sweep (epochs 2+ summed per seed; mean [min, max] over the point's seeds):")

    def show(d: dict[str, Any] | None, fmt: str = ".3f") -> str:
        return f"{d['mean']:{fmt}} [{d['min']:{fmt}}, {d['max']:{fmt}}]" if d and "mean" in d else "-"

    for p in points:
        share = p["settle_share_of_removable"]
        print(f"  settle {p['settle_seconds']:g} s, seeds {p['seeds']}: C {show(p['ceiling'])}, S Full "
              f"{show(p['full_speedup'])}, Spec {show(p['spec_speedup'])}, R {show(p['removed_share'], '.0%')}"
              + (f"; settle's share of Base - oracle {share['mean']:.0%} (seeds {share['seeds']})" if share else ""))
    print(f"merged {sum(len(d) for d in groups.values())} runs at {len(groups)} settles into {out / 'sweep.json'}")
    return 0
