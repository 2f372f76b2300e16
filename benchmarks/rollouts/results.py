"""The JSON of a run (targets, summary, figures) and --merge of per-seed runs into one result (runs
at different settles: a sweep, rollouts/sweep.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .figures import plots
from .stats import placements, snapshot_policies, summary
from .sweep import sweep
from .targets import explain_misses, headline_estimate, targets


def finish(out: Path, seeds: dict[int, dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """Targets, summary, figures and the JSON of `seeds` (each with its "_series")."""
    epochs = meta["size"]["epochs"]
    tg = targets(seeds, epochs, meta["share_engine"], meta["size"].get("families"))
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
        print(f"one headline seed's wall time, estimated from this run ({est['from']}): {est['seed_seconds_estimate']} "
              f"s; within 90 minutes: {est['fits_90_minutes']}")
    return result


def settle_record(seconds: float) -> dict[str, Any]:
    """The run's settle pause as its JSON records it (--settle)."""
    return {"seconds": seconds, "families": ["gui", "office"],
            "protocol": "OSWorld's DesktopEnv.step(action, pause=2): after each gui or office action tool, a pause of "
                        "`seconds` for the GUI to settle, paid by every execution (real, replayed, speculative, "
                        "audited)"}


def _settle_seconds(part: dict[str, Any]) -> float:
    # A run from before --settle existed paused nothing: settle 0.
    return float(part.get("settle", {}).get("seconds", 0.0))


def merge(dirs: list[Path], out: Path) -> int:
    """One result from per-seed runs of one size (each dir holds an agent_rollouts.json). Runs at
    different settles (--settle) are points of a sweep: each point's runs merge apart, under
    out/settle-S/, and out/sweep.json sets the points side by side (rollouts/sweep.py)."""
    groups: dict[float, list[tuple[Path, dict[str, Any]]]] = {}
    for d in dirs:
        part = json.loads((d / "agent_rollouts.json").read_text())
        groups.setdefault(_settle_seconds(part), []).append((d, part))
    if len(groups) > 1:
        return sweep(groups, out, _merge_point)
    _merge_point(next(iter(groups.values())), out)
    return 0


def _size(part: dict[str, Any]) -> dict[str, Any]:
    """A run's size as merging compares it: without its seeds, and its configurations those that
    every seed runs (a short configuration runs at its short seeds only, so a run at another seed
    that names only the others, --configs Base,Full at seed 2, ran the same)."""
    size = {k: v for k, v in part["size"].items() if k != "seeds"}
    short = set(size.get("short_configs") or ())
    if "configs" in size:
        size["configs"] = [c for c in size["configs"] if c not in short]
    return size


def _merge_point(runs: list[tuple[Path, dict[str, Any]]], out: Path) -> dict[str, Any]:
    dirs, parts = [d for d, _ in runs], [p for _, p in runs]
    keys = ("latency_model", "agent", "share_engine")
    size = _size(parts[0])
    for p in parts[1:]:
        if {k: p[k] for k in keys} != {k: parts[0][k] for k in keys} or _size(p) != size:
            raise SystemExit("--merge: the runs differ in size, model, agent or engine")
    seeds: dict[int, dict[str, Any]] = {}
    for p in parts:
        for k, s in p["seeds"].items():
            if int(k) in seeds:
                raise SystemExit(f"--merge: seed {k} appears twice")
            seeds[int(k)] = {**s, "_series": p["series"][k]}
    out.mkdir(parents=True, exist_ok=True)
    meta = {**{k: parts[0][k] for k in keys}, "settle": settle_record(_settle_seconds(parts[0])),
            "size": {**size, "configs": list(dict.fromkeys(c for p in parts for c in p["size"].get("configs", ()))),
                     "seeds": sorted(seeds)},
            "runs": [{"dir": str(d), "host": p["host"], "wall_seconds": p["wall_seconds"]}
                     for d, p in zip(dirs, parts, strict=True)]}
    result = finish(out, seeds, meta)
    print(f"merged {len(parts)} runs into {out / 'agent_rollouts.json'}")
    return result
