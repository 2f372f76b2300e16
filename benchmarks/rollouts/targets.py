"""The issue's targets with what was reached (printed, never asserted in a test), why a target
was missed, and the headline's wall time estimated from a run."""

from __future__ import annotations

import statistics
from typing import Any

from .driver import PHASES
from .regimes import HEADLINE
from .stats import common_epochs, compared_sum, epoch_ratios, later_epochs, peak_ratios, seeds_with, spread


def _met(value: float, target: float, at_most: bool = False) -> bool:
    return value <= target if at_most else value >= target


def targets(seeds: dict[int, dict[str, Any]], epochs: int, share: str = "ksm",
            families: list[str] | None = None) -> dict[str, Any]:
    """Issue 38's targets with what was reached (printed, never asserted in a test). Per seed,
    summed over the compared epochs (all but the first): the ceiling C = Base / oracle, the
    speedup S = Base / Full, the removed share R = (Base - Full) / (Base - oracle); the oracle is
    the replay of each epoch's decisions with every tool at 0 s (rollouts/oracle.py). Where the
    workload's ceiling is below what a target presumes (R: C >= 1.10; S >= 1.2: C >= 1.35), the
    target does not apply (met None) and S is reported against C with the breakdown."""
    later = later_epochs(epochs)
    out: dict[str, Any] = {}
    bf = seeds_with(seeds, "Base", "Full")
    if bf:
        def tot(s: dict[str, Any], n: str, key: str) -> float:
            return compared_sum(s, n, key, later)

        def path(s: dict[str, Any], n: str, phases: tuple[str, ...]) -> float:
            per = s[n].get("phases_per_epoch") or []  # merged runs from before the phases have none
            return sum(per[e]["critical_path"].get(p, 0.0) for p in phases
                       for e in common_epochs(s, later, "Base", "Full") if e < len(per) and per[e])

        removable_s = [max(tot(s, "Base", "epoch_seconds") - tot(s, "Base", "oracle_seconds"), 1e-9) for s in bf]
        speed = [tot(s, "Base", "epoch_seconds") / tot(s, "Full", "epoch_seconds") for s in bf]
        ceiling = [tot(s, "Base", "epoch_seconds") / tot(s, "Base", "oracle_seconds") for s in bf]
        removable = [(tot(s, "Base", "epoch_seconds") - tot(s, "Full", "epoch_seconds")) / r
                     for s, r in zip(bf, removable_s, strict=True)]
        own = [path(s, "Full", ("post_wait", "materialize", "spec_miss")) / r
               for s, r in zip(bf, removable_s, strict=True)]
        median = [tot(s, "Base", "median_rollout_seconds") / tot(s, "Full", "median_rollout_seconds") for s in bf]
        per_epoch = [[round(s["Base"]["epoch_seconds"][e] / s["Full"]["epoch_seconds"][e], 3)
                      for e in common_epochs(s, later, "Base", "Full")] for s in bf]
        sp, c = spread(speed), spread(ceiling)
        big = c["mean"] >= 1.35
        out["full_speedup_vs_base"] = {**sp, "ceiling_base_over_oracle": c, "applies_where_ceiling_at_least": 1.35,
                                       "target_mean": 1.2, "target_min_seed": 1.1, "paper": 1.22,
                                       "met": (sp["mean"] >= 1.2 and sp["min"] >= 1.1) if big else None,
                                       **({} if big else {"note": "C < 1.35: S is reported against C, with the "
                                                                  "breakdown (targets missed, below)"}),
                                       "epochs": [e + 1 for e in later], "per_epoch_per_seed": per_epoch,
                                       "median_rollout_speedup": spread(median), **oracle_checks(bf, later)}
        rs = spread(removable)
        out["removed_share"] = {**rs, "target": 0.6, "applies_where_ceiling_at_least": 1.10,
                                "met": _met(rs["min"], 0.6) if c["mean"] >= 1.10 else None}
        ow = spread(own)
        out["full_own_path_cost"] = {**ow, "of": "post_wait + materialize + spec_miss on Full's straggler path over "
                                                "Base - oracle", "target_at_most": 0.10,
                                     "met": _met(ow["max"], 0.10, True)}
        e3 = min(2, epochs - 1)
        h3 = spread([s["Full"]["hit_rate_per_epoch"]["total"][e3] for s in bf])
        out["full_hit_rate_epoch3"] = {**h3, "target": 0.65, "epoch": e3 + 1, "met": _met(h3["min"], 0.65)}
        pm = spread(peak_ratios(seeds, "Full", "Base"))
        out["full_peak_memory_vs_base"] = {**pm, "target_at_most": 1.1, "paper": 1.014,
                                           "met": _met(pm["max"], 1.1, True)}
    bc = seeds_with(seeds, "Base", "CRIU")
    if bc:
        per_epoch = [[s["Base"]["peak_memory_bytes_per_epoch"][e] / max(s["CRIU"]["peak_memory_bytes_per_epoch"][e], 1)
                      for s in bc if e < len(s["CRIU"]["epoch_seconds"])] for e in range(epochs)]
        per = [spread(r) for r in per_epoch if r]
        out["base_peak_memory_vs_criu"] = {
            "per_epoch": per, "target_at_most": 0.7, "engine": share,
            "met": all(p["max"] <= 0.7 for p in per) if share == "cow" else None,
            **({"note": "the target is for cow in a guest (make bench-guest); ksm merges the clones only as ksmd "
                        "scans, after the fork"} if share != "cow" else {})}
    base = [s for s in seeds.values() if "Base" in s and s["Base"].get("contention_per_epoch")]
    factors = [c["factor"] for s in base for e, c in enumerate(s["Base"]["contention_per_epoch"])
               if e in later and c and c.get("factor") is not None]
    if factors:
        # Base's real calls over their times alone in the compared epochs (contention.py), the CPU
        # slots' waits included (an upper bound on the factor without them): above 1.5,
        # oversubscribing the host's cores inflated the ceiling (issue 38).
        cf = spread(factors)
        out["contention_factor"] = {**cf, "target_at_most": 1.5, "met": _met(cf["max"], 1.5, True)}
    bs = seeds_with(seeds, "Base", "Spec")
    if bs:
        served = []
        for s in bs:
            phases = s["Spec"].get("phases_per_epoch") or []  # merged runs from before the phases have none
            for e in common_epochs(s, later, "Base", "Spec"):
                ph = phases[e] if e < len(phases) else None
                if ph:
                    calls = ph["critical_path_calls"]
                    served.append(calls["spec_hits"] / max(calls["real"] + calls["spec_hits"], 1))
        office = families is not None and "office" in families
        ss, sv = spread([1 / x for x in epoch_ratios(seeds, "Spec", "Base", later)]), spread(served)
        out["spec_speedup_vs_base"] = {**ss, "target": 1.05, "straggler_calls_served_by_speculation": sv,
                                       "target_served": 0.30, "applies": "runs with office",
                                       "met": (ss["min"] >= 1.05 and sv["min"] >= 0.30) if office else None}
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


def oracle_checks(bf: list[dict[str, Any]], later: list[int]) -> dict[str, Any]:
    """Beside the ceiling: the ceiling over the longest rollout's own reasoning (the oracle before
    issue 38), and the compared epochs of Base and Full that ended before their replayed oracle
    (possible where the load prices a step). Runs from before the replay have neither."""
    if not all("reasoning_bound_seconds" in s["Base"] for s in bf):
        return {}
    early, bound = [], []
    for s in bf:
        es = common_epochs(s, later, "Base", "Full")
        bound.append(sum(s["Base"]["epoch_seconds"][e] for e in es)
                     / max(sum(s["Base"]["reasoning_bound_seconds"][e] for e in es), 1e-9))
        early += [f"{n} epoch {e + 1}" for n in ("Base", "Full") for e in es if s[n]["oracle_exceeds_epoch"][e]]
    return {"ceiling_base_over_reasoning_bound": spread(bound), "epochs_ending_before_oracle": early}


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
        for e in common_epochs(s, later_epochs(epochs), "Base", "Full"):
            per_b, per_f = s["Base"].get("phases_per_epoch") or [], s["Full"].get("phases_per_epoch") or []
            b, f = (per_b[e], per_f[e]) if e < min(len(per_b), len(per_f)) else ({}, {})
            if not b or not f:  # merged runs from before the phases have none
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
    """One headline seed's wall time, estimated from this run: its wall seconds per seed and
    epoch (every configuration it ran, the audit and calibration included), times the headline's
    epochs, scaled by the headline's rollouts over this run's where it has more; compared with
    the issue's 90 minutes per seed."""
    size, wall = meta["size"], meta.get("wall_seconds")
    if not wall or not seeds:
        return {}
    sizes = [len(s["Base"]["rewards_per_sample_per_epoch"][0]) for s in seeds.values()
             if s.get("Base", {}).get("rewards_per_sample_per_epoch")]
    if not sizes:
        return {}
    measured = statistics.mean(sizes)
    per_epoch = wall / (len(seeds) * size["epochs"])
    scale = max(1.0, HEADLINE["rollouts"] / measured)
    per_seed = per_epoch * HEADLINE["epochs"] * scale
    return {"seed_seconds_estimate": round(per_seed), "fits_90_minutes": per_seed <= 5400,
            "from": {"wall_seconds": wall, "seeds": len(seeds), "epochs": size["epochs"], "rollouts": measured,
                     "configs": size.get("configs")}}
