"""Mean and spread over seeds, ratios paired within a seed, and the comparisons of speculation
placements and prefix-cache snapshot policies."""

from __future__ import annotations

import statistics
from typing import Any

from .configs import DEFAULT_PLACEMENT, DEFAULT_SNAPSHOT_POLICY, MiB


def spread(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"mean": round(statistics.mean(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "n": len(xs)}


def later_epochs(epochs: int) -> list[int]:
    """The epochs compared: all but the first, whose selector is untrained and cache empty."""
    return list(range(1, epochs)) or [0]


def seeds_with(seeds: dict[int, dict[str, Any]], *names: str) -> list[dict[str, Any]]:
    """The seeds that ran every configuration named."""
    return [s for s in seeds.values() if all(n in s for n in names)]


def common_epochs(s: dict[str, Any], later: list[int], *names: str) -> list[int]:
    """The epochs of `later` every configuration named ran in this seed."""
    return [e for e in later if all(e < len(s[n]["epoch_seconds"]) for n in names)] or \
        list(range(min(len(s[n]["epoch_seconds"]) for n in names)))


def compared_sum(s: dict[str, Any], name: str, key: str, later: list[int]) -> float:
    """A configuration's `key` summed over the compared epochs that Base and Full both ran."""
    return sum(s[name][key][e] for e in common_epochs(s, later, "Base", "Full"))


def epoch_ratios(seeds: dict[int, dict[str, Any]], a: str, b: str, later: list[int]) -> list[float]:
    """Per seed, configuration a's summed epoch time over `later` over b's: paired within the seed."""
    out = []
    for s in seeds_with(seeds, a, b):
        es = common_epochs(s, later, a, b)
        out.append(sum(s[a]["epoch_seconds"][e] for e in es) / sum(s[b]["epoch_seconds"][e] for e in es))
    return out


def peak_ratios(seeds: dict[int, dict[str, Any]], a: str, b: str) -> list[float]:
    """Per seed, configuration a's peak memory over b's, over the epochs both ran."""
    out = []
    for s in seeds_with(seeds, a, b):
        es = common_epochs(s, list(range(max(len(s[a]["epoch_seconds"]), len(s[b]["epoch_seconds"])))), a, b)
        out.append(max(s[a]["peak_memory_bytes_per_epoch"][e] for e in es)
                   / max(max(s[b]["peak_memory_bytes_per_epoch"][e] for e in es), 1))
    return out


def summary(seeds: dict[int, dict[str, Any]], epochs: int) -> dict[str, Any]:
    """Per configuration, the mean and spread over the seeds it ran (epoch figures: the mean of
    the later epochs it ran)."""
    later = later_epochs(epochs)
    names: list[str] = []
    for v in seeds.values():
        names += [n for n in v if isinstance(v[n], dict) and "epoch_seconds" in v[n] and n not in names]
    out = {}
    for n in names:
        vals = seeds_with(seeds, n)
        ran = lambda s, n=n: common_epochs(s, later, n)  # noqa: E731
        e3 = lambda s, n=n: min(2, len(s[n]["epoch_seconds"]) - 1)  # noqa: E731
        out[n] = {
            "epoch_seconds": spread([statistics.mean(s[n]["epoch_seconds"][e] for e in ran(s)) for s in vals]),
            "oracle_seconds": spread([statistics.mean(s[n]["oracle_seconds"][e] for e in ran(s)) for s in vals]),
            "median_rollout_seconds": spread([statistics.mean(s[n]["median_rollout_seconds"][e] for e in ran(s))
                                               for s in vals]),
            "peak_memory_mib": spread([s[n]["peak_memory_bytes"] / MiB for s in vals]),
            "hit_rate_epoch3": spread([s[n]["hit_rate_per_epoch"]["total"][e3(s)] for s in vals]),
            "reward": spread([statistics.mean(r for r in s[n]["reward_per_epoch"] if r is not None) for s in vals]),
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
    later = later_epochs(epochs)
    for p, v in out.items():
        if p != default:
            a, b = v["config"], out[default]["config"]
            v["epoch_ratio_to_default"] = spread(epoch_ratios(seeds, a, b, later))
            v["peak_memory_ratio_to_default"] = spread(peak_ratios(seeds, a, b))
    return True


def snapshot_policies(seeds: dict[int, dict[str, Any]], summ: dict[str, Any], epochs: int) -> dict[str, Any]:
    """Epoch time, peak memory and captures per prefix-cache snapshot policy ("Full" is the
    default's; Full@eager, the warm workspace behind every hit, is one more), and each other's
    ratios to the default's, paired within every seed."""
    out: dict[str, Any] = {}
    for n, v in summ.items():
        kind, _, p = n.partition("@")
        if kind == "Full":
            caches = [s[n].get("cache") or {} for s in seeds.values() if n in s]
            out[p or DEFAULT_SNAPSHOT_POLICY] = {
                "config": n, "epoch_seconds": v["epoch_seconds"], "peak_memory_mib": v["peak_memory_mib"],
                "hit_rate_epoch3": v["hit_rate_epoch3"],
                # states captured, replayed calls and states persisted, over all epochs and seeds
                "cache": {k: sum(c.get(k, 0) for c in caches) for k in ("captured", "replayed_calls", "persisted")},
                # hits behind which a warm workspace was kept or not, per seed
                "warm": [c.get("warm") for c in caches]}
    if _paired_to_default(seeds, out, DEFAULT_SNAPSHOT_POLICY, epochs):
        out["default"] = DEFAULT_SNAPSHOT_POLICY
    return out


def gate_profile(decisions: list[dict[str, Any]]) -> dict[str, Any]:
    """The speculation gate's decisions of an epoch, per tool: how many it admitted and declined,
    and the medians of what it weighed (the selector's calibrated probability, the call's measured
    seconds, the predicted reasoning, snapshot and rollback, the CPU slots' load and what a wrong
    guess's slot time was weighed at)."""
    out: dict[str, Any] = {}
    for tool in sorted({str(d["tool"]) for d in decisions}):
        rows = [d for d in decisions if d["tool"] == tool]

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
            xs = [float(r[key]) for r in rows if r.get(key) is not None]
            return round(statistics.median(xs), 3) if xs else None

        out[tool] = {"admitted": sum(bool(r["admitted"]) for r in rows),
                     "declined": sum(not r["admitted"] for r in rows),
                     **{f"median_{k}": med(k) for k in ("p_calibrated", "call", "reasoning", "snapshot", "miss",
                                                        "saving", "cost", "slot_load", "slot_cost")}}
    return out
