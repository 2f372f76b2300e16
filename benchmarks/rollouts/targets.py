"""The issue's targets with what was reached (printed, never asserted in a test), why a target
was missed, and the headline's wall time estimated from a run."""

from __future__ import annotations

import statistics
from typing import Any

from .driver import PHASES
from .regimes import HEADLINE
from .stats import common_epochs, epoch_ratios, later_epochs, peak_ratios, seeds_with, spread


def _met(value: float, target: float, at_most: bool = False) -> bool:
    return value <= target if at_most else value >= target


def targets(seeds: dict[int, dict[str, Any]], epochs: int, share: str = "ksm") -> dict[str, Any]:
    """The issue's targets with what was reached (printed, never asserted in a test). Speedups
    are per seed: summed epoch times over epochs 2-5, Base's over Full's; the oracle is the
    replay of each epoch's decisions with every tool at 0 s (rollouts/oracle.py), formerly the
    longest rollout's reasoning alone (the same decisions in every configuration)."""
    later = later_epochs(epochs)
    out: dict[str, Any] = {}
    bf = seeds_with(seeds, "Base", "Full")
    if bf:
        def tot(s: dict[str, Any], n: str, key: str) -> float:
            return sum(s[n][key][e] for e in common_epochs(s, later, "Base", "Full"))

        speed = [tot(s, "Base", "epoch_seconds") / tot(s, "Full", "epoch_seconds") for s in bf]
        ceiling = [tot(s, "Base", "epoch_seconds") / tot(s, "Base", "oracle_seconds") for s in bf]
        over_oracle = [tot(s, "Full", "epoch_seconds") / tot(s, "Full", "oracle_seconds") for s in bf]
        removable = [(tot(s, "Base", "epoch_seconds") - tot(s, "Full", "epoch_seconds"))
                     / max(tot(s, "Base", "epoch_seconds") - tot(s, "Base", "oracle_seconds"), 1e-9) for s in bf]
        median = [tot(s, "Base", "median_rollout_seconds") / tot(s, "Full", "median_rollout_seconds") for s in bf]
        per_epoch = [[round(s["Base"]["epoch_seconds"][e] / s["Full"]["epoch_seconds"][e], 3)
                      for e in common_epochs(s, later, "Base", "Full")] for s in bf]
        sp = spread(speed)
        out["full_speedup_vs_base"] = {**sp, "target_mean": 1.2, "target_min_seed": 1.1, "paper": 1.22,
                                       "met": sp["mean"] >= 1.2 and sp["min"] >= 1.1,
                                       "epochs": [e + 1 for e in later], "per_epoch_per_seed": per_epoch,
                                       "ceiling_base_over_oracle": spread(ceiling),
                                       "removable_share_removed": spread(removable),
                                       "median_rollout_speedup": spread(median),
                                       **oracle_checks(bf, later)}
        fo = spread(over_oracle)
        out["full_vs_oracle"] = {**fo, "target_at_most": 1.25, "met": _met(fo["mean"], 1.25, True)}
        rs = spread(removable)
        out["removable_share"] = {**rs, "target": 0.5, "met": _met(rs["mean"], 0.5)}
        e3 = min(2, epochs - 1)
        h3 = spread([s["Full"]["hit_rate_per_epoch"]["total"][e3] for s in bf])
        through = spread([min(s["Full"]["hit_rate_per_epoch"]["total"][e3:]) for s in bf])
        out["full_hit_rate_epoch3"] = {**h3, "target": 0.65, "epoch": e3 + 1, "met": _met(h3["min"], 0.65)}
        out["full_hit_rate_through_epoch5"] = {**through, "target": 0.60, "epochs": [e3 + 1, epochs],
                                               "met": _met(through["min"], 0.60)}
        pm = spread(peak_ratios(seeds, "Full", "Base"))
        out["full_peak_memory_vs_base"] = {**pm, "target_at_most": 1.1, "paper": 1.014,
                                           "met": _met(pm["max"], 1.1, True)}
    bc = seeds_with(seeds, "Base", "CRIU")
    if bc:
        per_epoch = [[s["Base"]["peak_memory_bytes_per_epoch"][e] / max(s["CRIU"]["peak_memory_bytes_per_epoch"][e], 1)
                      for s in bc if e < len(s["CRIU"]["epoch_seconds"])] for e in range(epochs)]
        ratio = spread(peak_ratios(seeds, "Base", "CRIU"))
        out["base_peak_memory_vs_criu"] = {
            **ratio, "target_at_most": 0.6, "engine": share,
            "per_epoch": [spread(r) for r in per_epoch if r],
            "met": _met(ratio["max"], 0.6, True) if "max" in ratio else None,
            **({"note": "the target is for cow in a guest; ksm merges the clones only as ksmd scans, "
                        "after the fork"} if share == "ksm" else {})}
    base = [s for s in seeds.values() if "Base" in s and s["Base"].get("contention_per_epoch")]
    factors = [c["factor"] for s in base for e, c in enumerate(s["Base"]["contention_per_epoch"])
               if e in later and c and c.get("factor") is not None]
    if factors:
        # Base's real calls over their times alone in the compared epochs (contention.py): above
        # 1.5, oversubscribing the host's cores inflated the ceiling (issue 38).
        cf = spread(factors)
        out["contention_factor"] = {**cf, "target_at_most": 1.5, "met": _met(cf["max"], 1.5, True)}
    if seeds_with(seeds, "Base", "Spec"):
        out["spec_speedup_vs_base"] = spread([1 / x for x in epoch_ratios(seeds, "Spec", "Base", later)])
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

