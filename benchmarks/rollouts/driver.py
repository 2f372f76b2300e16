"""The run driver: a configuration's epoch (the row written per epoch), its summary over the
epochs, and a seed (every configuration interleaved, epoch by epoch)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from agent_policy import AgentConfig, LatencyModel

from bunshinrl import EpochResult
from bunshinrl.calls import cpu_slots
from bunshinrl.envs.faults import inject_faults
from bunshinrl.rollout.configs import CONFIGS as ENGINE_CONFIGS
from bunshinrl.rollout.timeline import DIVERGENCE_KINDS, DIVERGENCE_OUTCOMES

from .configs import ConfigRun, MiB, make_config
from .contention import CpuPressure, calibrate, distinct_prefixes, factor, reasoning_busy_share
from .oracle import replay
from .sampler import HostSampler
from .stats import gate_profile
from .tasks import build_tasks, check_tools
from .trajectories import compare, digests, report

PHASES = ("setup", "reason", "tool", "cache_hit", "sibling_wait", "audit", "materialize", "post_wait", "spec_hit",
          "spec_miss")


def _short(kind: str, detail: str) -> str:
    """A timeline event's detail, its calls' arguments cut short (a rebuild's plan whole)."""
    if kind == "materialize":
        return detail
    call, _, predicted = detail.partition(" (predicted ")
    return call[:48] + (f" / predicted {predicted.rstrip(')')[:48]}" if predicted else "")


def phases(r: EpochResult, epoch_seconds: float) -> dict[str, Any]:
    """Where an epoch's time went: per event kind, the seconds of the rollout that finished last
    (the critical path) and the sum over all rollouts, and the time after the last rollout
    (teardown; the cache's persistence is reported apart)."""
    if not r.samples:
        return {}
    last = max(r.samples, key=lambda t: t.finished)
    return {
        "critical_path": {k: round(last.seconds(k), 3) for k in PHASES},
        "critical_path_calls": {"real": last.count("tool"), "cache_hits": last.count("cache_hit"),
                                "spec_hits": last.count("spec_hit")},
        # Who it was and what its path held, event by event (kind, seconds, the call's name).
        "critical_path_sample": f"{last.task_id}/{last.sample}",
        "critical_path_events": [(e.kind, round(e.seconds, 3), _short(e.kind, e.detail))
                                 for e in last.events if e.kind != "reason"],
        "all_rollouts": {k: round(sum(t.seconds(k) for t in r.samples), 3) for k in PHASES},
        "after_last_rollout": round(epoch_seconds - r.seconds, 3),
    }


async def run_epoch(run: ConfigRun, group: int, epoch: int) -> dict[str, Any]:
    sampler = HostSampler(run.engine)
    sampler.start()
    pressure = CpuPressure()
    pressure.start()
    slots0 = cpu_slots.current().stats()
    t0 = time.monotonic()
    try:
        r = await run.engine.run_epoch(run.tasks, group, epoch)
    finally:
        memory = sampler.stop()
    cpu_pressure = pressure.share()
    slots1 = cpu_slots.current().stats()
    slots = {"slots": slots1["slots"], **{k: round(slots1[k] - slots0[k], 3)
                                          for k in ("held", "waited", "wait_seconds", "held_seconds")}}
    wall = time.monotonic() - t0
    # The gap between epochs (the trainer's update phase): the cache's persistence runs there,
    # and is done before the next epoch starts.
    tp = time.monotonic()
    persist = await run.engine.persistence()
    persist_wait = time.monotonic() - tp
    if run.engine.speculator is not None:
        run.engine.fit_selector()
    audit = (await run.auditor.audit(r)).summary() if run.auditor is not None else None
    gate = run.engine.speculator.gate if run.engine.speculator is not None else None
    run.results.append(r)
    reason = [s for (e, _t, _s), s in run.server.reasoning_seconds.items() if e == epoch]
    # The oracle: this epoch's decisions replayed through the same server with every tool at 0 s.
    oracle = replay(run.server.recorded(epoch), run.server.price)
    rewards = {f"{s.task_id}/{s.sample}": s.reward for s in r.samples}
    calls = r.tool_calls
    row = {
        "epoch_seconds": round(r.seconds, 3),
        "wall_seconds": round(wall, 3),
        "teardown_seconds": round(r.teardown_seconds, 3),
        "persist_seconds": round(persist, 3),
        "persist_wait_after_epoch": round(persist_wait, 3),
        "persist_running_at_start": run.engine.persist_running_at_start,
        "oracle_seconds": round(oracle, 3),
        # The longest rollout's own reasoning (the oracle before issue 38): no run ends before it.
        "reasoning_bound_seconds": round(max(reason, default=0.0), 3),
        # Where the load prices a step, a sibling's tool pause can cheapen the straggler's next
        # step, and the run then ends before the replay (docs/rl_rollouts_method.md).
        "oracle_exceeds_epoch": oracle > r.seconds,
        "median_rollout_seconds": round(statistics.median(s.finished for s in r.samples), 3) if r.samples else 0.0,
        "cache_hit_rate": round(r.cache_hits / calls, 4) if calls else 0.0,
        "spec_hit_rate": round(r.spec_hits / calls, 4) if calls else 0.0,
        "hit_rate": round(r.hit_rate, 4),
        "sibling_waits": r.sibling_waits,
        "tool_calls": calls,
        "peak_memory_bytes": max((b for _, b in memory), default=0),
        "memory": [(round(t, 2), b) for t, b in memory],
        "running": r.running_over_time(100),
        "reward": round(statistics.mean(v for v in rewards.values() if v is not None), 4)
        if any(v is not None for v in rewards.values()) else None,
        "rewards": rewards,
        "errors": [e for s in r.samples for e in s.errors],
        "wasted_speculation_seconds": round(r.wasted_seconds, 3),
        # The speculator's counts so far (cumulative): launched, hits, mismatches, the gate's.
        "speculation": r.speculation,
        # What the gate weighed this epoch, per tool (docs/rl_rollouts_method.md, the gate's note).
        "speculation_gate": gate_profile(gate.take_decisions()) if gate is not None else None,
        **r.invariant(),  # divergences, rewound, rerolled and the seconds they cost
        "phases": phases(r, r.seconds + r.teardown_seconds),
        "audit": audit,
        # Contention (benchmarks/rollouts/contention.py); the factor against calls alone is added
        # once the seed's calibration has run (contention).
        "cpu_pressure": cpu_pressure,
        # CPU-heavy executions during the epoch that held a CPU slot, how many waited and how long
        # in all (bunshinrl.calls.cpu_slots; slots None: no limit).
        "cpu_slots": slots,
        "reasoning_busy_share": reasoning_busy_share(r),
        "distinct_prefixes": distinct_prefixes(r),
        "contention": None,
        # Each sample's calls, what served them and its observations' digests (trajectories.py).
        "trajectories": digests(r),
    }
    run.epochs.append(row)
    print(f"  {run.name:4s} epoch {epoch}: {r.seconds:6.1f} s (oracle {row['oracle_seconds']:5.1f} s, median "
          f"rollout {row['median_rollout_seconds']:5.1f} s)  hit rate {row['hit_rate']:5.1%} (cache "
          f"{r.cache_hits}, spec {r.spec_hits}, sibling waits {r.sibling_waits} of {calls})  peak "
          f"{row['peak_memory_bytes'] / MiB:7.1f} MiB  reward {row['reward']}  errors {len(row['errors'])}",
          flush=True)
    print(f"        beside it: teardown {r.teardown_seconds:.1f} s, persistence {persist:.1f} s (done before the "
          f"next epoch: yes); cpu pressure {cpu_pressure}, reasoning busy {row['reasoning_busy_share']:.1%}, "
          f"cpu slots: {slots['held']} held, {slots['waited']} waited {slots['wait_seconds']:.1f} s", flush=True)
    if r.cache is not None:  # the state at the epoch's end, its budget following the workspaces (--cache-share)
        c, b = r.cache, r.cache.get("budget")
        budget = (f" (budget {b['share']:g} x the workspaces' peak so far, {b['workspace_peak_bytes'] / MiB:.0f} "
                  f"MiB, less what they hold; lowest {b['lowest_budget_bytes'] / MiB:.0f} MiB)" if b else "")
        print(f"        cache: {c['resident_bytes'] / MiB:.0f} MiB resident of {c['capacity_bytes'] / MiB:.0f} MiB"
              f"{budget}, loads {c['loads']}, evicted {c['evicted']}, forks {c['forks']}", flush=True)
    for tool, g in (row["speculation_gate"] or {}).items():
        print(f"        gate {tool}: admitted {g['admitted']}, declined {g['declined']} (medians: p "
              f"{g['median_p_calibrated']}, call {g['median_call']} s, reasoning {g['median_reasoning']} s, "
              f"snapshot {g['median_snapshot']} s, rollback {g['median_miss']} s, slot load {g['median_slot_load']}, "
              f"slot cost {g['median_slot_cost']} s)", flush=True)
    if row["oracle_exceeds_epoch"]:
        print(f"        the epoch ended {oracle - r.seconds:.1f} s before its oracle (a replay, not a bound here: "
              f"steps met smaller batches than with free tools); its own reasoning {row['reasoning_bound_seconds']:.1f}"
              " s", flush=True)
    if audit is not None:
        print(f"        audit ({audit['mode']}): {audit['audited']} samples, {audit['steps']} steps re-executed in "
              f"{audit['seconds']:.1f} s: {audit['mismatches']} mismatches, {audit['not_auditable']} not auditable, "
              f"{audit['errors']} errors", flush=True)
    if r.divergences or row["sibling_checks"] or row["speculation_checks"]:
        print("        invariant: " + "  ".join(f"{k} {v}" for k, v in r.invariant().items()), flush=True)
    if row["phases"]:
        path = row["phases"]["critical_path"]
        print("        last rollout: " + "  ".join(f"{k} {v:.1f}" for k, v in path.items() if v), flush=True)
    return row


def summarize(run: ConfigRun) -> dict[str, Any]:
    ep = run.epochs
    return {
        "epoch_seconds": [e["epoch_seconds"] for e in ep],
        "oracle_seconds": [e["oracle_seconds"] for e in ep],
        "reasoning_bound_seconds": [e["reasoning_bound_seconds"] for e in ep],
        "oracle_exceeds_epoch": [e["oracle_exceeds_epoch"] for e in ep],
        "median_rollout_seconds": [e["median_rollout_seconds"] for e in ep],
        "teardown_seconds": [e["teardown_seconds"] for e in ep],
        "persist_seconds": [e["persist_seconds"] for e in ep],
        "sibling_waits_per_epoch": [e["sibling_waits"] for e in ep],
        "hit_rate_per_epoch": {"cache": [e["cache_hit_rate"] for e in ep],
                               "speculation": [e["spec_hit_rate"] for e in ep],
                               "total": [e["hit_rate"] for e in ep]},
        "peak_memory_bytes": max(e["peak_memory_bytes"] for e in ep),
        "peak_memory_bytes_per_epoch": [e["peak_memory_bytes"] for e in ep],
        "reward_per_epoch": [e["reward"] for e in ep],
        "rewards_per_sample_per_epoch": [e["rewards"] for e in ep],
        "tool_calls_per_epoch": [e["tool_calls"] for e in ep],
        "wasted_speculation_seconds_per_epoch": [e["wasted_speculation_seconds"] for e in ep],
        "errors": [x for e in ep for x in e["errors"]],
        # The invariant at work: replays that diverged, samples rewound, trajectories re-rolled,
        # the divergences by kind (divergences_mid_plan, _removed_node, _speculation, _sibling_race)
        # and by outcome (outcome_rewound, ..., divergences_unaccounted: 0 when each has one), and
        # the chances to meet the rarer kinds (sibling_checks, speculation_checks).
        "invariant_per_epoch": [{k: e[k] for k in ("divergences", "divergence_seconds", "rewound", "rewound_steps",
                                                   "rewound_seconds", "rerolled",
                                                   *(f"divergences_{d}" for d in DIVERGENCE_KINDS),
                                                   *(f"outcome_{o}" for o in DIVERGENCE_OUTCOMES),
                                                   "divergences_unaccounted", "sibling_checks",
                                                   "speculation_checks")} for e in ep],
        "phases_per_epoch": [e["phases"] for e in ep],
        "cpu_pressure_per_epoch": [e["cpu_pressure"] for e in ep],
        "cpu_slots_per_epoch": [e["cpu_slots"] for e in ep],
        "reasoning_busy_share_per_epoch": [e["reasoning_busy_share"] for e in ep],
        "distinct_prefixes_per_epoch": [e["distinct_prefixes"] for e in ep],
        "contention_per_epoch": [e["contention"] for e in ep],
        # The trajectory audit per epoch (Full's; None where it did not run).
        "audit_per_epoch": [e["audit"] for e in ep],
        "cache": run.results[-1].cache if run.results else None,
        "speculation": run.results[-1].speculation if run.results else None,
        "trajectories_per_epoch": [e["trajectories"] for e in ep],
    }



async def add_contention(runs: dict[str, ConfigRun]) -> None:
    """Each epoch's calls against their times alone, calibrated on Base's last epoch (or the
    first configuration's), after every epoch has run (contention.calibrate)."""
    ref = runs.get("Base") or next(iter(runs.values()), None)
    if ref is None or not ref.results:
        return
    t = time.monotonic()
    alone = await calibrate(ref.tasks, ref.results[-1])
    print(f"  contention, calibrated on {ref.name}'s last epoch ({len(alone)} calls alone in "
          f"{time.monotonic() - t:.1f} s): each epoch's real calls over their times alone", flush=True)
    for n, run in runs.items():
        for row, r in zip(run.epochs, run.results, strict=True):
            row["contention"] = factor(r, alone)
        print(f"    {n:10s} " + "  ".join(f"epoch {i}: {row['contention']['factor']} (straggler "
                                          f"{row['contention']['straggler']})" for i, row in enumerate(run.epochs)),
              flush=True)


async def run_seed(seed: int, args: argparse.Namespace, agent_cfg: AgentConfig, model: LatencyModel,
                   store: Path) -> dict[str, Any]:
    tasks, cands = build_tasks(args.families, seed, args.code_tasks, args.settle)
    if args.inject_faults:
        tasks = [inject_faults(t, args.inject_faults, seed) for t in tasks]
    checks = [await check_tools(t, cands[t.id]) for t in tasks] if args.check_families else []
    print(f"seed {seed}: tasks {[t.id for t in tasks]} x {args.group_size} samples x {args.epochs} epochs", flush=True)
    # Spec and CRIU (--short-configs) run at the first seed and in the first --short-epochs only:
    # Spec for its memory figure, CRIU for Base's memory against it.
    short = [n for n in args.configs if n in args.short_configs]
    names = [n for n in args.configs if n not in short or seed in args.short_seeds]
    runs = {n: make_config(n, tasks, cands, dataclasses.replace(agent_cfg, seed=seed), model, store,
                           args.cache_mib, args.spec_depth, args.slow_seconds, args.share_engine,
                           args.regime, len(tasks) * args.group_size, args.audit, seed, args.inject_faults > 0,
                           args.guard_auto_disable == "on", args.cache_share)
            for n in names}
    try:
        for e in range(args.epochs):
            order = names[e % len(names):] + names[:e % len(names)]  # interleaved, rotating
            for n in order:
                if n in short and e >= args.short_epochs:
                    continue
                await run_epoch(runs[n], args.group_size, e)
    finally:
        for r in runs.values():
            if r.auditor is not None:
                await r.auditor.close()
            await r.engine.close()
            if r.cache is not None:
                await asyncio.to_thread(r.cache.close)
    await add_contention(runs)
    out = {n: summarize(r) for n, r in runs.items()}
    trio = [n for n in runs if n.partition("@")[0] in ENGINE_CONFIGS]
    out["rewards_identical"] = all(runs[trio[0]].epochs[e]["rewards"] == runs[n].epochs[e]["rewards"]
                                   for n in trio for e in range(min(len(runs[n].epochs), len(runs[trio[0]].epochs))))
    if trio:  # where each configuration's samples part from the first's (trajectories.py)
        ref = [e["trajectories"] for e in runs[trio[0]].epochs]
        out["trajectories_parted"] = {"reference": trio[0], **{
            n: compare(ref, [e["trajectories"] for e in runs[n].epochs]) for n in trio[1:]}}
        report(out["trajectories_parted"])
    audits = [e["audit"] for r in runs.values() for e in r.epochs if e["audit"] is not None]
    out["audit"] = {"mode": args.audit, **{k: sum(a[k] for a in audits)
                                           for k in ("audited", "mismatches", "not_auditable", "errors")},
                    "seconds": round(sum(a["seconds"] for a in audits), 3)}
    if checks:
        out["check_family"] = checks
    out["_series"] = {n: {"memory": [x["memory"] for x in r.epochs], "running": [x["running"] for x in r.epochs]}
                      for n, r in runs.items()}
    return out

