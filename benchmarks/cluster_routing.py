"""Prefix-affinity routing against random placement on a real local Ray cluster of bunshin hosts.

python benchmarks/cluster_routing.py [--quick] --out DIR

A local Ray cluster of --nodes nodes (each its own bunshin host: state root, cgroup parent,
bridge, layer store; loopback only, no dashboard, a small object store) serves one
RayWorkspacePool. Each of --tasks tasks is a real workspace holding a small data set; its GRPO
group of --group samples runs real shell tools there (generating, sorting and hashing files:
CPU and file-system work, nothing slept). The samples of a group share their first three calls
and differ after them, and every epoch repeats the same trajectories, so the prefix cache can
serve a call wherever the host that ran it before receives the group again.

Two ClusterEngines run on the same cluster: `affinity` (the deepest cached prefix's host, then
the group's snapshot's, then the least loaded) and `random` (a seeded uniform host). Each has
task ids of its own, so neither ever reads the other's cache entries; their epochs alternate
(the order rotated every epoch) over --seeds. The policy is scripted and answers at once: there
is no reasoning time, so the epoch time is the tools', the forks' and the routing's alone.

Reported per routing: the cache hit rate per epoch (and from the second epoch on, where reuse
is possible), epoch seconds, snapshot bytes moved between hosts (replication; none unless
--replicate-above is given), the placements by reason, and whether the observations and
rewards equal those of the other routing (they must: routing changes where, not what).
Writes DIR/cluster_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bunshinfork import Workspace
from bunshinrl import FinalAnswer, SampleContext, Step, Task, ToolCall
from bunshinrl.calls.policy import Action
from bunshinrl.calls.tools import shell_tool

# The local cluster is the tests' (tests/cluster_support.py), loaded by its path: one definition
# of what a loopback-only, leak-checked local cluster of bunshin hosts is.
_spec = importlib.util.spec_from_file_location(
    "cluster_support", Path(__file__).resolve().parent.parent / "tests" / "cluster_support.py")
assert _spec is not None and _spec.loader is not None
cluster_support = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cluster_support)

WORK = "/root/work"


def _gen(args: dict[str, Any]) -> str:
    # A deterministic data file of `lines` numbers from `seed`: the same bytes on every host.
    name, seed, lines = str(args["name"]), int(args["seed"]), int(args.get("lines", 120000))
    return (f"mkdir -p {WORK} && python3 -c 'import random; r = random.Random({seed}); "
            f"print(\"\\n\".join(str(r.randrange(10**9)) for _ in range({lines})))' > {WORK}/{name} "
            f"&& wc -l < {WORK}/{name}")


def _sort(args: dict[str, Any]) -> str:
    name = str(args["name"])
    return f"sort -n {WORK}/{name} -o {WORK}/{name}.sorted && head -c 40 {WORK}/{name}.sorted | head -2"


def _digest(_args: dict[str, Any]) -> str:
    return f"cd {WORK} && sha256sum $(ls | sort) | sha256sum | cut -c1-16"


TOOLS = [shell_tool("gen", _gen), shell_tool("sort", _sort), shell_tool("digest", _digest)]


def _setup(ws: Workspace) -> None:
    ws.commands.run(f"mkdir -p {WORK} && seq 1 50000 > {WORK}/base", timeout=60)


def _verify(ws: Workspace) -> float:
    r = ws.commands.run(f"test -s {WORK}/a.sorted && test -s {WORK}/b", timeout=30)
    return 1.0 if r.exit_code == 0 else 0.0


def make_task(task_id: str) -> Task:
    return Task(task_id, "Prepare the data set and hash it.", TOOLS, _setup, verify=_verify,
                fingerprint="cluster-routing-v1")


def script(k: int, sample: int) -> list[ToolCall]:
    """Task k's sample `sample`: a prefix the group shares, then calls of its own."""
    return [ToolCall("gen", {"name": "a", "seed": k}), ToolCall("sort", {"name": "a"}),
            ToolCall("gen", {"name": "b", "seed": 1000 + k}),
            ToolCall("gen", {"name": f"s{sample}", "seed": 100 * k + sample, "lines": 60000}),
            ToolCall("sort", {"name": f"s{sample}"}), ToolCall("digest", {})]


class Scripted:
    """Every sample of task k follows script(k, sample), each epoch the same; no think time."""

    def __init__(self, index: dict[str, int]) -> None:
        self.index = index

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        calls = script(self.index[ctx.task_id], ctx.sample)
        return calls[len(history)] if len(history) < len(calls) else FinalAnswer("done")


def _local_key(task_id: str) -> str:
    return task_id.split("/", 1)[1]  # "affinity/s0-t3" -> "s0-t3": the same task under both routings


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from bunshinrl.cluster import ClusterEngine, RayWorkspacePool

    hosts = [f"cr{i}" for i in range(args.nodes)]
    routings = ("affinity", "random")
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in routings}
    with cluster_support.local_cluster(hosts):
        if __name__ != "__main__":  # __main__ travels by value anyway; an imported copy must too
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        pool = RayWorkspacePool(cache_bytes=args.cache_mib << 20)
        try:
            for seed in range(args.seeds):
                tasks = {r: [make_task(f"{r}/s{seed}-t{k}") for k in range(args.tasks)] for r in routings}
                index = {t.id: k for r in routings for k, t in enumerate(tasks[r])}
                engines = {r: ClusterEngine(Scripted(index), pool, routing=r, seed=seed,
                                            replicate_above=args.replicate_above) for r in routings}
                runs: dict[str, dict[str, Any]] = {r: {"seed": seed, "epochs": []} for r in routings}
                for epoch in range(args.epochs):
                    order = routings if (epoch + seed) % 2 == 0 else routings[::-1]
                    for r in order:
                        res = asyncio.run(engines[r].run_epoch(tasks[r], args.group, epoch))
                        obs = {f"{_local_key(s.task_id)}/{s.sample}": [st.observation for st in s.steps]
                               for s in res.samples}
                        rewards = {f"{_local_key(s.task_id)}/{s.sample}": s.reward for s in res.samples}
                        runs[r]["epochs"].append({"epoch": epoch, "seconds": res.seconds, "hit_rate": res.hit_rate,
                                                  "tool_calls": res.tool_calls, "cache_hits": res.cache_hits,
                                                  "observations": obs, "rewards": rewards})
                        print(f"[seed {seed} epoch {epoch}] {r:8s} {res.seconds:6.2f} s  hit rate "
                              f"{res.hit_rate:.2f}  ({res.cache_hits}/{res.tool_calls} calls)", flush=True)
                for r in routings:
                    st = engines[r].stats
                    runs[r].update(bytes_moved=st.bytes_moved, replicated=st.replicated, restarts=st.restarts,
                                   placements=dict(Counter(reason for _, _, reason in st.placements)))
                    results[r].append(runs[r])
        finally:
            pool.shutdown()
    return {r: results[r] for r in routings}


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}

    out: dict[str, Any] = {}
    for r, runs in results.items():
        epochs = len(runs[0]["epochs"])
        per_epoch = [spread([run["epochs"][e]["hit_rate"] for run in runs]) for e in range(epochs)]
        later = [ep["hit_rate"] for run in runs for ep in run["epochs"][1:]]
        out[r] = {"hit_rate": statistics.mean(later) if later else 0.0, "hit_rate_per_epoch": per_epoch,
                  "epoch_seconds_per_epoch": [spread([run["epochs"][e]["seconds"] for run in runs])
                                              for e in range(epochs)],
                  "epoch_seconds": spread([ep["seconds"] for run in runs for ep in run["epochs"][1:]] or
                                          [ep["seconds"] for run in runs for ep in run["epochs"]]),
                  "bytes_moved": sum(run["bytes_moved"] for run in runs),
                  "placements": dict(sum((Counter(run["placements"]) for run in runs), Counter()))}
    a, b = results["affinity"], results["random"]
    out["identical_results"] = all(
        ea["observations"] == eb["observations"] and ea["rewards"] == eb["rewards"]
        for ra, rb in zip(a, b, strict=True) for ea, eb in zip(ra["epochs"], rb["epochs"], strict=True))
    ta, tr = out["affinity"]["epoch_seconds"]["median"], out["random"]["epoch_seconds"]["median"]
    out["epoch_speedup_affinity_vs_random"] = tr / ta if ta else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI size: 2 nodes, 3 tasks, 2 epochs, 1 seed")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--cache-mib", type=int, default=1024, help="each host's prefix-cache budget")
    ap.add_argument("--replicate-above", type=int, default=None,
                    help="replicate a group's prefixes to a colder host once its host runs this many samples")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.quick:
        args.nodes, args.tasks, args.epochs, args.seeds = 2, 3, 2, 1
    print(f"cluster_routing: {args.nodes} nodes, {args.tasks} tasks x {args.group} samples, "
          f"{args.epochs} epochs, {args.seeds} seeds; no reasoning time (scripted policy)", flush=True)
    t0 = time.monotonic()
    results = run(args)
    summary = summarize(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
           "seconds": time.monotonic() - t0, **{r: {**summary[r], "runs": results[r]} for r in results},
           "identical_results": summary["identical_results"],
           "epoch_speedup_affinity_vs_random": summary["epoch_speedup_affinity_vs_random"]}
    (out / "cluster_routing.json").write_text(json.dumps(doc, indent=1))
    for r in results:
        s = summary[r]
        print(f"{r:8s}: hit rate {s['hit_rate']:.2f} (epochs 2+), epoch {s['epoch_seconds']['median']:.2f} s "
              f"[{s['epoch_seconds']['min']:.2f}-{s['epoch_seconds']['max']:.2f}], "
              f"{s['bytes_moved'] / 2**20:.1f} MiB moved, placements {s['placements']}")
    print(f"identical observations and rewards under both routings: {summary['identical_results']}")
    print(f"target affinity_hit_rate_above_random: "
          f"{'met' if summary['affinity']['hit_rate'] > summary['random']['hit_rate'] else 'MISSED'}")
    print(f"wrote {out / 'cluster_routing.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
