"""BunshinRL's rollout configurations on real agent workspaces (paper sections 5.2-5.3, Figs. 6-11).

python benchmarks/agent_rollouts.py [--quick] --out DIR [--seeds 3 | --seed S] [--families code,shop]
                                    [--regime paper|local|batch] [--exploration decaying|constant]
                                    [--placements live,fork_first] [--snapshot-policies cost,depth]
                                    [--audit all|sample|off] [--check-families] [--settle SECONDS]
python benchmarks/agent_rollouts.py --merge DIR0 DIR1 DIR2 --out DIR   (per-seed runs -> one result;
                                                                       runs at several settles -> a sweep)

The headline (docs/rl_rollouts_method.md), fixed before any run: --regime paper (every step
priced with the paper's 128 requests in flight on one H100: the model's table stops at 64, so
tpot is its linear extrapolation, ~95 ms per output token, ~11 s per step), code + shop + gui x
G=8 (24 rollouts per epoch), 5 epochs, seeds 0-2 (one --seed each, then --merge), exploration
0.16, 0.12, 0.08, 0.06, 0.04; Base and Full every seed and epoch, Spec and CRIU at seed 0 in
epochs 1-2 only (--short-configs, --short-epochs). Beside it: --exploration constant (0.08) at
seed 0 and --regime local (this configuration's own requests in flight, ~0.9 s steps) at seed 0.

Tasks (each with a verifier that reads the final workspace):
  code   bunshinrl.envs.coding: a C project with a bug; `build` and `run_tests` are real gcc/make
         runs (seconds each), the reward reads build/test.log
  shop   bunshinrl.envs.webshop: PostgreSQL + the shop + headless Chromium; search, add to cart,
         check out; the reward reads the orders in SQL
  gui    bunshinrl.envs.gui: the X11 desktop (Xvfb + openbox + Mousepad); find and focus the
         editor, replace the text, save, check the title; the reward reads the saved file
  swe    bunshinrl.envs.swe: mpmath 1.3.0 from its PyPI sdist with a bug injected; `run_tests` runs
         the project's own pytest suite (a named subset, ~6 s; or one file); the reward reads the
         last run of the subset
The agent (benchmarks/agent_policy.py) is closed-loop: its candidates come from what it observed;
its reasoning time comes from the documented GPU-server latency model, printed before the run.

Configurations, interleaved within every seed (each epoch runs every configuration in turn,
the order rotating per epoch), each with its own engine kept across epochs:
  CRIU  every fork a private copy (memory="copy", processes not opted into KSM)
  Base  memory sharing only (--share-engine: ksm on this host, cow in a guest with the module)
  Spec  Base + speculative tool execution (selector retrained after every epoch)
  Full  Base + the tool-prefix cache + speculation
  Spec@P  with --placements: Spec with the speculator's chain placed by P (live: in the sample's
        workspace, forking on a mismatch; fork_first: in a fork, the sample's workspace kept for
        the real call); "Spec" and "Full" use the speculator's default placement
  Full@S  with --snapshot-policies: Full whose cache captures states by policy S (depth: every
        other depth and every slow call; cost: when the replay a capture saves takes as long as
        a capture, measured); "Full" uses cost
  Full@eager  Full with a warm workspace kept behind every cache hit (the skipped call replayed
        in the background); "Full" keeps one only where the next call is predicted to miss
Parity: every configuration keeps its initialized task snapshots across epochs (Full in its
cache's root, the others through keep_initial) and forks while the first step is reasoned
(overlap_fork; Full's prefetch of its root). epoch_seconds ends when the last rollout finishes
(the paper's epoch); the teardown after it and the cache's persistence (deferred to the gap
between epochs, the trainer's update phase) are reported beside it, and persistence is waited
for before the next epoch starts, so it is shown done before the next epoch needs it.
The trajectory audit (--audit; all in the headline, sample in --quick and CI): after every epoch of a
Full configuration, each sample's history (all, or one per task) is re-executed from the task's
root in a fresh fork (bunshinrl.rollout.audit), every observation it was shown and its reward
compared; it runs in the gap between epochs, outside epoch_seconds. Its result per epoch is the
row's `audit` (audited, passed, mismatches, not_auditable, errors, seconds, the failing samples).
--check-families runs check_family (bunshinrl.calls.determinism) on each task first: the agent's
first candidate calls, each in two forks of the initial state (per seed: check_family).
Hit rates count the agents' tool calls only (the hidden verifier call is none); a call served by
waiting for a sibling's running call is counted apart (sibling_waits) and is no hit.

--settle SECONDS (issue 38): OSWorld's protocol for the desktop families, gui and office. Its
DesktopEnv.step(action, pause=2) runs an action, waits `pause` seconds (2 by default) for the GUI
to settle, then observes; here each action tool of those families (click, type_text, key,
launch_app, open_page, goto_cell, save, export_pdf, ...; not list_windows, screenshot,
clipboard_get or read_cells) waits SECONDS after acting, inside the tool, so every execution pays
it: the real call, a cache replay behind a hit, a speculative run, an audit re-execution. Default
2.0, OSWorld's own; the other families never pause. It is recorded (`settle`), it is part of the
gui and office tasks' fingerprints (a cache recorded at one settle is never served at another),
and --merge of runs at different settles makes a sweep: each settle's runs (its seeds) merge apart
under OUT/settle-S/, and OUT/sweep.json with OUT/speedup_vs_ceiling.png sets the points side by
side (C, S of Full and Spec, R, the settle's share of Base - oracle beside settle 0). --quick runs
office and swe at G=2 with settle 0.5 s.

--regime batch (issue 38, docs/rl_rollouts_method.md): a step that starts with k of the
configuration's N rollouts reasoning is priced with k x 128 / N requests in flight, the paper's
batch draining as its rollouts finish (Fig. 8). The oracle, in every regime, replays each epoch's
recorded tokens per step through the same server model with every tool at 0 s
(benchmarks/rollouts/oracle.py).

DIR/agent_rollouts.json: per configuration and seed epoch_seconds, oracle_seconds (the replay),
reasoning_bound_seconds (the longest rollout's reasoning alone), oracle_exceeds_epoch (an epoch
that ended before its replay: possible where the load prices a step), hit_rate_per_epoch (cache
and speculation split), peak_memory_bytes (host-cost accounting of the configuration's
workspaces and snapshots, sampled over the epoch), reward_per_epoch, phases_per_epoch (where
each epoch's time went: the seconds per event kind of the rollout that finished last and of all
rollouts, and the time after the last rollout); rewards_identical across Base, Spec and Full;
summary: per configuration the mean and spread over seeds; placements: epoch time and peak
memory per speculation placement; snapshot_policies: the same (and captures) per prefix-cache
snapshot policy; the targets with what was reached. --seed S runs one seed (a run short enough
to hold the host lock for); --merge combines such runs' JSONs into one, figures included.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

from agent_policy import DEFAULT_LATENCY, EXPLORATION, EXPLORATION_SOURCE, PAPER_IN_FLIGHT, AgentConfig

from bunshinrl.calls import cpu_slots
from bunshinrl.rollout.audit import AUDIT_MODES
from bunshinrl.speculation.speculator import PLACEMENTS

from .configs import CONFIGS, DEFAULT_PLACEMENT, DEFAULT_SNAPSHOT_POLICY, EAGER, SNAPSHOT_POLICIES
from .driver import run_seed
from .regimes import HEADLINE, QUICK, REGIMES, fixed_in_flight, preamble
from .results import finish, merge, settle_record


def _number_or_off(ap: argparse.ArgumentParser, flag: str, value: str | float | None, cast: type[int] | type[float],
                   minimum: float, what: str) -> Any:
    """A flag that takes a number of at least `minimum` or off (None: not given, as off); bad
    input is a usage error, not a crash later in the run (NaN too)."""
    if value is None or value == "off":
        return None
    try:
        x = cast(value)
    except ValueError:
        ap.error(f"{flag} is {what} or off, not {value!r}")
    if not x >= minimum:
        ap.error(f"{flag} must be at least {minimum:g}, not {value}")
    return x


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1 seed, code + shop, 3 samples x 3 epochs (CRIU and Spec 2), the local regime (CI)")
    ap.add_argument("--regime", choices=sorted(REGIMES),
                    help=f"paper: steps priced with {PAPER_IN_FLIGHT} requests in flight (the earlier headline, the "
                         f"pessimistic bound); local: with this configuration's own; batch: k of its N rollouts "
                         f"reasoning priced as k x {PAPER_IN_FLIGHT} / N in flight (the paper's batch draining)")
    ap.add_argument("--exploration", choices=sorted(EXPLORATION),
                    help="the exploration schedule over epochs (decaying: the headline's; constant: 0.08)")
    ap.add_argument("--short-configs", help="configurations run only at --short-seeds and in the first "
                                            "--short-epochs epochs (default CRIU,Spec in the headline)")
    ap.add_argument("--short-epochs", type=int)
    ap.add_argument("--short-seeds", help="comma-separated seeds the short configurations run at")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seeds", type=int, help="run seeds 0..N-1")
    ap.add_argument("--seed", type=int, help="run this one seed only (merge such runs with --merge)")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                    help="combine the agent_rollouts.json of per-seed runs in these folders into --out")
    ap.add_argument("--placements", default=DEFAULT_PLACEMENT,
                    help=f"speculation placements to compare, of {','.join(PLACEMENTS)}: each one but the "
                         f"default ({DEFAULT_PLACEMENT}, Spec's) adds a configuration Spec@PLACEMENT")
    ap.add_argument("--snapshot-policies", default=DEFAULT_SNAPSHOT_POLICY,
                    help=f"prefix-cache snapshot policies to compare, of {','.join(SNAPSHOT_POLICIES)}: each one "
                         f"but the default ({DEFAULT_SNAPSHOT_POLICY}, Full's) adds a configuration Full@POLICY")
    ap.add_argument("--families", help="comma-separated: code, shop, gui, swe, office")
    ap.add_argument("--code-tasks", type=int)
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--configs", help=f"default: the headline's (--quick: {','.join(CONFIGS)})")
    ap.add_argument("--cache-mib", type=int, default=1024, help="resident budget of Full's prefix cache")
    ap.add_argument("--cache-share", metavar="SHARE|off",
                    help="Full's resident budget follows its rollouts' own workspaces: at every memory sample, what "
                         "they leave under SHARE x their highest level so far (PSS; never above --cache-mib), so "
                         "that the host's peak stays within SHARE of the workspaces' own; off: --cache-mib "
                         "throughout (default: the headline's 1.05; --quick: off)")
    ap.add_argument("--spec-depth", type=int, default=2)
    ap.add_argument("--share-engine", default="ksm", help="fork engine of Base, Spec and Full (cow in a guest)")
    ap.add_argument("--slow-seconds", default="measured",
                    help="speculation's gate: 'measured' (the default: a chain runs when its expected saving, from "
                         "measured call, snapshot and rollback times and the selector's calibrated probability, "
                         "exceeds its expected cost) or SECONDS (the fixed rule before issue 38: a call this slow "
                         "is a 'slow tool'); the cache's depth policy captures calls at least SECONDS slow (1.0 "
                         "when measured)")
    ap.add_argument("--check-families", action="store_true",
                    help="before the epochs, run check_family on each task (its agent's first candidate calls, "
                         "each in two forks of the initial state) and record check_family per seed")
    ap.add_argument("--audit", choices=AUDIT_MODES,
                    help="re-execute Full's trajectories after each epoch from a fresh fork of the root and compare "
                         "every observation and the reward: all samples (the headline's default), one per task "
                         "(sample: --quick's and CI's) or off")
    ap.add_argument("--inject-faults", type=float, default=0.0, metavar="RATE",
                    help="fault injection (issue 37's proof): each agent tool observes a token specific to the "
                         "sample running it with this probability per (sample, call), keyed by the seed "
                         "(bunshinrl.envs.faults)")
    ap.add_argument("--settle", type=float, metavar="SECONDS",
                    help="OSWorld's protocol for the desktop families, gui and office (DesktopEnv.step(action, "
                         "pause=2)): each of their action tools waits SECONDS after acting for the GUI to settle, "
                         "paid by every execution (real, replayed, speculative, audited); default 2.0, OSWorld's "
                         "own (--quick: 0.5); 0 pauses nothing. Other "
                         "families never pause; --merge of runs at different settles makes a settle sweep")
    ap.add_argument("--cpu-slots", default="cores", metavar="N|cores|off",
                    help="CPU-heavy tool executions at once (a test suite, a compiler, an office program starting, "
                         "saving or exporting: bunshinrl.calls.cpu_slots); the others wait for a slot, inside the "
                         "call, and the waits are counted per epoch (cpu_slots). cores (default): the host's "
                         "hardware threads; off: no limit (the runs before issue 38's contention note)")
    ap.add_argument("--guard-auto-disable", choices=("on", "off"), default="on",
                    help="off: a tool found non-deterministic stays reusable (its cached subtrees are still "
                         "dropped at each mismatch), so injected faults keep meeting the cache")
    a = ap.parse_args()
    for k, v in (QUICK if a.quick else HEADLINE).items():
        if hasattr(a, k) and getattr(a, k) is None:
            setattr(a, k, v)
    if a.slow_seconds != "measured":
        try:
            a.slow_seconds = float(a.slow_seconds)
        except ValueError:
            ap.error(f"--slow-seconds takes 'measured' or seconds, not {a.slow_seconds!r}")
    a.families = [f for f in a.families.split(",") if f]
    a.short_configs = [c for c in a.short_configs.split(",") if c]
    a.short_seeds = [int(x) for x in a.short_seeds.split(",") if x]
    a.configs = [c for c in (a.configs or ",".join(CONFIGS)).split(",") if c]
    a.cache_share = _number_or_off(ap, "--cache-share", a.cache_share, float, 0.0, "a share")
    extra = [p for p in a.placements.split(",") if p]
    if set(extra) - set(PLACEMENTS):
        ap.error(f"unknown placements {sorted(set(extra) - set(PLACEMENTS))}; use {', '.join(PLACEMENTS)}")
    a.configs += [f"Spec@{p}" for p in extra if p != DEFAULT_PLACEMENT and f"Spec@{p}" not in a.configs]
    pols = [p for p in a.snapshot_policies.split(",") if p]
    if set(pols) - set(SNAPSHOT_POLICIES):
        ap.error(f"unknown snapshot policies {sorted(set(pols) - set(SNAPSHOT_POLICIES))}; use "
                 f"{', '.join(SNAPSHOT_POLICIES)}")
    a.configs += [f"Full@{p}" for p in pols if p != DEFAULT_SNAPSHOT_POLICY and f"Full@{p}" not in a.configs]
    known = {*CONFIGS, *(f"Spec@{p}" for p in PLACEMENTS), *(f"Full@{p}" for p in (*SNAPSHOT_POLICIES, EAGER))}
    if bad := [c for c in a.configs if c not in known]:
        ap.error(f"unknown configurations {bad}")
    a.cpu_slots = (os.cpu_count() or 1) if a.cpu_slots == "cores" else \
        _number_or_off(ap, "--cpu-slots", a.cpu_slots, int, 1, "a number, cores")
    if not a.settle >= 0:  # NaN too
        ap.error(f"--settle is a pause in seconds >= 0, not {a.settle}")
    a.seed_list = [a.seed] if a.seed is not None else list(range(a.seeds))
    if not a.seed_list:
        ap.error(f"--seeds {a.seeds} runs no seed (it counts them: --seeds 1 runs seed 0; --seed N runs seed N)")
    return a


async def main() -> int:
    args = parse()
    if args.merge:
        return merge(args.merge, args.out)
    model = DEFAULT_LATENCY
    agent_cfg = AgentConfig(schedule=EXPLORATION[args.exploration])
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "prefix-store"
    shutil.rmtree(store, ignore_errors=True)
    cpu_slots.configure(args.cpu_slots)
    for line in preamble(args, model, agent_cfg):
        print(line, flush=True)
    t0 = time.monotonic()
    seeds: dict[int, dict[str, Any]] = {}
    for seed in args.seed_list:
        seeds[seed] = await run_seed(seed, args, agent_cfg, model, store)
    shutil.rmtree(store, ignore_errors=True)
    meta = {
        "latency_model": {**dataclasses.asdict(model), "formula": model.describe(), "regime": args.regime,
                          "in_flight": fixed_in_flight(args.regime),
                          "pricing": "k of N rollouts reasoning = k x 128 / N in flight" if args.regime == "batch"
                          else "128 in flight" if args.regime == "paper" else "k of N reasoning = k in flight",
                          "oracle": "replay of each epoch's tokens per step, every tool at 0 s",
                          "paper_tpot_seconds": round(model.tpot(PAPER_IN_FLIGHT), 5),
                          "paper_step_seconds": round(model.seconds(200, agent_cfg.output_median, PAPER_IN_FLIGHT), 3),
                          "extrapolated_beyond": model.tpot_table[-1][0]},
        "agent": {**dataclasses.asdict(agent_cfg), "exploration": args.exploration,
                  "exploration_source": EXPLORATION_SOURCE},
        "share_engine": args.share_engine,
        "speculation_gate": args.slow_seconds if isinstance(args.slow_seconds, str) else f"fixed {args.slow_seconds} s",
        "settle": settle_record(args.settle),
        "cpu_slots": args.cpu_slots,
        "cache": {"mib": args.cache_mib, "share": args.cache_share},
        "size": {"seeds": args.seed_list, "families": args.families, "code_tasks": args.code_tasks,
                 "group_size": args.group_size, "epochs": args.epochs, "quick": args.quick,
                 "configs": args.configs, "short_configs": args.short_configs, "short_epochs": args.short_epochs,
                 "short_seeds": args.short_seeds, "audit": args.audit, "inject_faults": args.inject_faults,
                 "guard_auto_disable": args.guard_auto_disable},
        "host": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "wall_seconds": round(time.monotonic() - t0, 1),
    }
    result = finish(args.out, seeds, meta)
    print(f"wrote {args.out / 'agent_rollouts.json'} and {', '.join(result['figures'])} in {meta['wall_seconds']} s")
    return 0

