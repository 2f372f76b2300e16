"""What successive snapshots of one workspace cost, and where a fork's time goes, per engine.

python benchmarks/snapshot_cost.py --size-mib 1024 --dirty-mib 10 --snapshots 10 --engines copy,ksm[,cow] --out DIR

For each of --seeds rounds and each engine (engines interleaved, their order rotated each
round; the heaps' content seeded by the round) a fresh ~size-mib source (8 python heaps, a
file-backed mapping of the shared lower layer, an HTTP server: 10 processes) is snapshotted
once, then --snapshots more times, its heaps writing --dirty-mib of pages they had not written
before each one. Reported per
snapshot: how long the source was frozen (and CRIU's pages written and skipped as the
parent's), and what keeping it costs: the increase of the retained snapshots' summed
retained_bytes() (images of its own, the pages of released parents it reads, its layer, and
for cow the pages its holders keep once the source rewrites them), and the same measured as
the host pays it: blocks allocated to those files (tmpfs: shmem) plus the holders' pages. (The
host's MemAvailable is no measure on a shared machine: it swings by hundreds of MiB between
two snapshots.) A complete snapshot of the
same workspace (incremental=False) is taken before and after the chain as the reference.
Then forks of one clone (and of --forks clones at once) from the complete snapshot and from
the chain's tip, interleaved over --reps, each with its stage profile (Workspace.info().timings);
and --parallel clones of the complete snapshot forked together (snap.fork(n)) against as many
forked one after another (`parallel_fork`: the ratio of the two, and how many CRIU restores
ran at one moment, from the clones' restore windows).
The summary gives every figure as its median and range over seeds (and snapshots), and the
README's table.

Targets (printed, met or missed; none is asserted):
- retained bytes per snapshot <= 3x the bytes dirtied since the previous one, every engine;
- an incremental snapshot's frozen time <= 0.2x a complete dump's, where the kernel tracks
  dirty pages (None where it does not: then CRIU writes every page and the comparison with
  the parent happens after the thaw);
- a cow fork >= 10x faster than a copy fork (needs both engines in the run: the guest).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fork_memory import available_engines, meminfo
from workloads import dirty, populate

from bunshinfork import Snapshot, Workspace, memory
from bunshinfork.process import chain, criu
from bunshinfork.state import SnapshotMeta


def _allocated(path: Path) -> int:
    """Bytes the file system allocated under `path` (st_blocks): on tmpfs, the shmem the host pays."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def host_bytes(snaps: list[Snapshot]) -> int:
    """What the host pays for `snaps`, measured apart from retained_bytes(): the blocks allocated
    to their directories, to those of the released snapshots whose pages they read, and to their
    layers, plus the pages cow holders alone map (the module's count; no file holds them)."""
    dirs = {s.dir for s in snaps}
    for s in snaps:
        p = chain.external_parent(s.dir)
        while p is not None:
            dirs.add(p.parent)
            p = chain.external_parent(p.parent)
    paths = set(dirs)
    for d in dirs:
        meta = SnapshotMeta.load(d)
        if meta.fs and meta.fs.layer and not Path(meta.fs.layer.path).is_relative_to(d):
            paths.add(Path(meta.fs.layer.path))
    return sum(_allocated(p) for p in paths) + sum(memory.held_bytes(s._snap) for s in snaps)


def snapshot_row(snap: Snapshot, k: int, dirtied: int) -> dict[str, Any]:
    t = snap.timing
    return {"k": k, "id": snap.id, "parent": snap.parent, "depth": chain.depth(snap.images_dir),
            "dirtied_bytes": dirtied, "frozen_seconds": t.frozen_seconds, "stages": t.stages,
            "pages_written": t.criu.get("pages_written"), "pages_skipped_parent": t.criu.get("pages_skipped_parent"),
            "pages_kept": t.criu.get("pages_kept"), "retained_bytes": snap.retained_bytes(),
            # CRIU's own split of the dump (microseconds): where a freeze that writes few pages
            # still spends its time (parasite, pagemap scan of the whole address space).
            "criu_us": {k: v for k, v in t.criu.items() if k.endswith("_time")}}


def fork_once(snap: Snapshot, n: int) -> dict[str, Any]:
    t0 = time.monotonic()
    clones = snap.fork(n)
    took = time.monotonic() - t0
    ok = [c for c in clones if isinstance(c, Workspace)]
    profile = ok[0].info().timings if ok else {}
    for c in ok:
        c.destroy()
    return {"clones": n, "seconds": took, "failed": [str(c)[:300] for c in clones if not isinstance(c, Workspace)],
            "profile": profile}


def overlap(windows: list[tuple[float, float]]) -> int:
    """The most CRIU restores running at one moment."""
    edges = sorted([(a, 1) for a, _ in windows] + [(b, -1) for _, b in windows])
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def parallel_once(snap: Snapshot, n: int, concurrent: bool) -> dict[str, Any]:
    """n clones of `snap`: forked together (snap.fork(n)) or one after another."""
    t0 = time.monotonic()
    clones = snap.fork(n) if concurrent else [c for _ in range(n) for c in snap.fork(1)]
    took = time.monotonic() - t0
    ok = [c for c in clones if isinstance(c, Workspace)]
    windows = [w for c in ok if (w := c.info().restore_window) is not None]
    for c in ok:
        c.destroy()
    return {"concurrent": concurrent, "clones": n, "seconds": took, "failed": len(clones) - len(ok),
            "restores_at_once": overlap(windows)}


def run_engine(engine: str, seed: int, size_mib: int, dirty_mib: float, count: int, forks: list[int],
               reps: int, parallel: int = 0) -> dict:
    out: dict[str, Any] = {"engine": engine, "seed": seed, "snapshots": [], "forks": [], "parallel": []}
    with Workspace.create(ksm=engine == "ksm") as src:
        procs = populate(src, size_mib, seed=seed)
        print(f"[{engine}] source: {procs} processes, pss {src.memory().pss / 2**20:.0f} MiB", flush=True)
        time.sleep(0.5)
        with src.snapshot(engine, incremental=False) as full_before:
            complete = [snapshot_row(full_before, -1, 0)]
        chain_snaps: list[Snapshot] = []
        try:
            first = src.snapshot(engine)
            chain_snaps.append(first)
            kept, paid = first.retained_bytes(), host_bytes(chain_snaps)
            out["snapshots"].append({**snapshot_row(first, 0, 0), "marginal_retained_bytes": kept,
                                     "marginal_host_bytes": paid})
            for k in range(1, count + 1):
                written = dirty(src, dirty_mib)
                snap = src.snapshot(engine)
                chain_snaps.append(snap)
                # Every retained snapshot again: a cow snapshot's cost grows as its source writes.
                total, total_paid = sum(s.retained_bytes() for s in chain_snaps), host_bytes(chain_snaps)
                row = {**snapshot_row(snap, k, written), "marginal_retained_bytes": total - kept,
                       "marginal_host_bytes": total_paid - paid}
                kept, paid = total, total_paid
                out["snapshots"].append(row)
                print(f"[{engine}] snapshot {k}: frozen {row['frozen_seconds']:.3f}s, written "
                      f"{row['pages_written']} pages, kept {row['marginal_retained_bytes'] / 2**20:.1f} MiB "
                      f"(host {row['marginal_host_bytes'] / 2**20:.1f} MiB) for {written / 2**20:.1f} MiB dirtied",
                      flush=True)
            with src.snapshot(engine, incremental=False) as full:
                out["full"] = [*complete, snapshot_row(full, -1, 0)]
                print(f"[{engine}] complete snapshot: frozen {complete[0]['frozen_seconds']:.3f}s / "
                      f"{full.timing.frozen_seconds:.3f}s, {full.retained_bytes() / 2**20:.0f} MiB", flush=True)
                for rep in range(reps):
                    for n in forks:
                        for which, snap in (("complete", full), ("tip", chain_snaps[-1])):
                            if engine != "cow" and n * size_mib * 2 > meminfo()["MemAvailable"] >> 20:
                                continue  # copies of the source would not fit
                            row = {"rep": rep, "from": which, "depth": chain.depth(snap.images_dir),
                                   **fork_once(snap, n)}
                            out["forks"].append(row)
                            print(f"[{engine}] fork {n} from {which}: {row['seconds']:.2f}s", flush=True)
                    if parallel > 1 and (engine == "cow" or parallel * size_mib * 2 < meminfo()["MemAvailable"] >> 20):
                        # Together and one after another, the order alternated by rep.
                        for concurrent in ((True, False) if rep % 2 == 0 else (False, True)):
                            row = {"rep": rep, **parallel_once(full, parallel, concurrent)}
                            out["parallel"].append(row)
                            print(f"[{engine}] {parallel} clones {'together' if concurrent else 'in turn'}: "
                                  f"{row['seconds']:.2f}s, {row['restores_at_once']} restores at once", flush=True)
        finally:
            for s in chain_snaps:
                s.release()
    return out


def _spread(xs: list[float]) -> dict[str, float | None]:
    """Median and range: every figure the summary gives is over seeds (and snapshots)."""
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def summarize_engine(runs: list[dict]) -> dict:
    """One engine's runs (one per seed)."""
    inc = [s for r in runs for s in r["snapshots"] if s["k"] >= 1]
    forks1 = [f for r in runs for f in r["forks"] if f["clones"] == 1 and not f["failed"]]
    # A seed's incremental frozen time against the complete dumps of the same source.
    frozen_ratio = [statistics.median(s["frozen_seconds"] for s in r["snapshots"] if s["k"] >= 1)
                    / statistics.median(s["frozen_seconds"] for s in r["full"]) for r in runs]
    stages: dict[str, list[float]] = defaultdict(list)
    for f in forks1:
        if f["from"] == "complete":
            for k, v in f["profile"].items():
                stages[k].append(v)
    # Clones forked together against the same number forked one after another, per rep.
    par = [r.get("parallel", []) for r in runs]
    pairs = [(a, b) for rows in par for a in rows if a["concurrent"] and not a["failed"]
             for b in rows if not b["concurrent"] and b["rep"] == a["rep"] and not b["failed"]]
    many: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        for f in r["forks"]:
            if f["clones"] > 1 and not f["failed"]:
                many[f"{f['clones']} from {f['from']}"].append(f["seconds"])
    return {
        "seeds": len(runs),
        "incremental_frozen_seconds": _spread([s["frozen_seconds"] for s in inc]),
        "complete_frozen_seconds": _spread([s["frozen_seconds"] for r in runs for s in r["full"]]),
        "frozen_ratio": _spread(frozen_ratio),
        "retained_per_dirtied_byte": _spread([s["marginal_retained_bytes"] / s["dirtied_bytes"] for s in inc]),
        "host_paid_per_dirtied_byte": _spread([s["marginal_host_bytes"] / s["dirtied_bytes"] for s in inc]),
        "complete_retained_bytes": _spread([r["full"][-1]["retained_bytes"] for r in runs]),
        "fork_seconds": {w: _spread([f["seconds"] for f in forks1 if f["from"] == w]) for w in ("complete", "tip")},
        "fork_many_seconds": {k: _spread(v) for k, v in many.items()},
        "fork_profile_median": {k: statistics.median(v) for k, v in sorted(stages.items())},
        "parallel_fork": {
            "clones": pairs[0][0]["clones"] if pairs else None,
            "together_seconds": _spread([a["seconds"] for a, _ in pairs]),
            "in_turn_seconds": _spread([b["seconds"] for _, b in pairs]),
            "ratio": _spread([a["seconds"] / b["seconds"] for a, b in pairs]),
            "restores_at_once": _spread([a["restores_at_once"] for a, _ in pairs]),
        },
    }


def summarize(results: list[dict], tracking: bool) -> dict:
    by_engine: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_engine[r["engine"]].append(r)
    per = {e: summarize_engine(runs) for e, runs in by_engine.items()}
    copy, cw = per.get("copy"), per.get("cow")
    speedup = None
    if copy and cw and copy["fork_seconds"]["complete"]["median"] and cw["fork_seconds"]["complete"]["median"]:
        speedup = copy["fork_seconds"]["complete"]["median"] / cw["fork_seconds"]["complete"]["median"]
    retained_ok = [v["retained_per_dirtied_byte"]["max"] <= 3 and v["host_paid_per_dirtied_byte"]["max"] <= 3
                   for v in per.values() if v["retained_per_dirtied_byte"]["max"] is not None]
    targets = {
        "retained_per_snapshot_within_3x_dirtied": all(retained_ok) if retained_ok else None,
        "incremental_frozen_within_0.2x_complete": (all(v["frozen_ratio"]["max"] <= 0.2 for v in per.values())
                                                    if tracking else None),
        "cow_fork_10x_faster_than_copy": speedup >= 10 if speedup is not None else None,
    }
    return {"engines": per, "cow_fork_speedup": speedup, "dirty_tracking": tracking, "targets": targets}


def table(summary: dict) -> str:
    """The README's table: medians, [min-max] over seeds and snapshots."""
    def f(sp: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
        if sp["median"] is None:
            return "-"
        return f"{fmt.format(sp['median'] * scale)} [{fmt.format(sp['min'] * scale)}-{fmt.format(sp['max'] * scale)}]"

    rows = ["| engine | frozen, incremental (s) | frozen, complete (s) | ratio | retained / dirtied "
            "| host pays / dirtied | complete snapshot (MiB) | fork 1 from complete (s) | fork 1 from tip (s) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for e, v in summary["engines"].items():
        rows.append(f"| {e} | {f(v['incremental_frozen_seconds'], fmt='{:.3f}')} "
                    f"| {f(v['complete_frozen_seconds'], fmt='{:.3f}')} | {f(v['frozen_ratio'])} "
                    f"| {f(v['retained_per_dirtied_byte'])} | {f(v['host_paid_per_dirtied_byte'])} "
                    f"| {f(v['complete_retained_bytes'], 2**-20, '{:.0f}')} "
                    f"| {f(v['fork_seconds']['complete'])} | {f(v['fork_seconds']['tip'])} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--dirty-mib", type=float, default=10)
    ap.add_argument("--snapshots", type=int, default=10)
    ap.add_argument("--engines", default="copy,ksm")
    ap.add_argument("--forks", default="1,4", help="clones per fork")
    ap.add_argument("--reps", type=int, default=2, help="forks of each kind per seed")
    ap.add_argument("--parallel", type=int, default=4,
                    help="clones forked together and one after another from the complete snapshot (0: none)")
    ap.add_argument("--seeds", type=int, default=2,
                    help="fresh sources per engine (heap content seeded), engines interleaved in rotated order")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    engines = available_engines(args.engines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    forks = [int(x) for x in args.forks.split(",")]
    results = []
    for seed in range(args.seeds):
        for e in engines[seed % len(engines):] + engines[:seed % len(engines)]:
            results.append(run_engine(e, seed, args.size_mib, args.dirty_mib, args.snapshots, forks, args.reps,
                                      args.parallel))
    summary = summarize(results, criu.dirty_tracking())
    doc = {"args": vars(args), "summary": summary, "results": results,
           "machine": {"cpus": os.cpu_count(), "mem_total_bytes": meminfo()["MemTotal"], "kernel": os.uname().release}}
    (out / "snapshot_cost.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    print(table(summary))
    for name, met in summary["targets"].items():
        print(f"target {name}: {'met' if met else 'n/a' if met is None else 'MISSED'}")
    print(f"wrote {out / 'snapshot_cost.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
