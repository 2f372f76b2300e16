"""How a reasoning step is priced (the regimes), the sizes fixed before any run, and the
constants printed before a run with their citations."""

from __future__ import annotations

import argparse
import os

from agent_policy import EXPLORATION_SOURCE, PAPER_IN_FLIGHT, REGIMES, AgentConfig, LatencyModel

__all__ = ["HEADLINE", "QUICK", "REGIMES", "fixed_in_flight", "preamble"]


def fixed_in_flight(regime: str) -> int | None:
    """The requests in flight every step is priced with, in a regime that fixes them (paper)."""
    return PAPER_IN_FLIGHT if regime == "paper" else None

# The headline's size, fixed before any run (issue 38, docs/rl_rollouts_method.md's note of
# 2026-12-05 on the headline): the families whose tools take real time at G = 4 (12 rollouts on
# this host's 2 threads: at G = 8 the contention factor was 1.6-2.0, above the 1.5),
# batch regime, settle 2 s, 4 epochs compared over 2-4, seeds 0-2 each run apart and merged;
# Spec at seed 0 through every epoch; the sampled audit; Full's resident budget what the
# rollouts' own workspaces leave under 1.05 x their highest level (cache_share; 1.0 of the peak,
# applied per epoch, until the note of 2026-12-05 (2)). CRIU only where named (the guest line).
HEADLINE = {"families": "gui,swe,office", "code_tasks": 1, "group_size": 4, "epochs": 4, "seeds": 3, "rollouts": 12,
            "regime": "batch", "exploration": "decaying", "short_configs": "Spec", "short_epochs": 4,
            "short_seeds": "0", "audit": "sample", "settle": 2.0, "cache_share": 1.05, "configs": "Base,Spec,Full"}
# --quick (CI's): the families whose tools take real time, small (issue 38: office and swe at G=2,
# settle 0.5 s, the sampled audit).
QUICK = {"families": "office,swe", "code_tasks": 1, "group_size": 2, "epochs": 3, "seeds": 1, "regime": "local",
         "settle": 0.5,
         "exploration": "decaying", "short_configs": "CRIU,Spec", "short_epochs": 2, "short_seeds": "0",
         "audit": "sample"}
PAPER_ROLLOUTS_PER_THREAD = 2  # the paper's host: 128 rollouts on 64 hardware threads


def preamble(args: argparse.Namespace, model: LatencyModel, agent_cfg: AgentConfig) -> list[str]:
    """The constants, with their citations, and the run's size, printed before the run."""
    n_tasks = len(args.families) + (args.code_tasks - 1 if "code" in args.families else 0)
    rollouts = n_tasks * args.group_size
    cpus = os.cpu_count() or 1
    fixed = fixed_in_flight(args.regime)
    tpot128 = model.tpot(PAPER_IN_FLIGHT)
    median = agent_cfg.output_median
    lone = PAPER_IN_FLIGHT / rollouts  # the batch regime: one rollout reasoning alone
    share = getattr(args, "cache_share", None)
    return [
        f"latency model: {model.describe()}",
        f"regime {args.regime}: " + (
            f"every step priced with {fixed} requests in flight (the paper's 128 rollouts on one H100), whatever "
            f"this host runs. The table stops at {model.tpot_table[-1][0]} in flight: tpot({fixed}) = "
            f"{tpot128 * 1e3:.1f} ms per output token is its linear extrapolation (the 16 -> 64 slope), not a "
            f"measurement; a median step ({agent_cfg.output_median} output tokens) takes "
            f"{model.seconds(200, median, fixed):.1f} s" if fixed else
            f"a step that starts with k of the configuration's N = {rollouts} rollouts reasoning is priced with k x "
            f"{PAPER_IN_FLIGHT} / N requests in flight: each local rollout stands for {lone:.2f} of the paper's, and "
            f"the batch drains as in the paper's Fig. 8; a median step ({median} output tokens) takes "
            f"{model.seconds(200, median, PAPER_IN_FLIGHT):.1f} s with all N reasoning ({PAPER_IN_FLIGHT} in flight, "
            f"tpot extrapolated beyond {model.tpot_table[-1][0]}), {model.seconds(200, median, lone):.2f} s alone "
            f"({lone:.2f} in flight)" if args.regime == "batch" else
            f"steps priced with this configuration's own requests in flight (at most {rollouts}); a median step "
            f"takes {model.seconds(200, median, rollouts):.2f} s with all in flight"),
        "oracle: each epoch's recorded tokens per step replayed through this server model with every tool, fork "
        "and capture at 0 s (a discrete-event replay, benchmarks/rollouts/oracle.py); beside it the longest "
        "rollout's own reasoning (reasoning_bound_seconds); an epoch that ends before its oracle is flagged "
        "(oracle_exceeds_epoch: a sibling's tool pause can cheapen the straggler's step where the load prices it)",
        f"exploration ({args.exploration}, fixed before any run): "
        f"{', '.join(f'{x:g}' for x in agent_cfg.schedule)} in epochs 1-{len(agent_cfg.schedule)} (the last "
        f"beyond); direction: {EXPLORATION_SOURCE}",
        f"agent: output tokens median {agent_cfg.output_median} (sigma {agent_cfg.output_sigma}, max "
        f"{agent_cfg.output_max})",
        f"size: {n_tasks} tasks ({', '.join(args.families)}) x G={args.group_size} = {rollouts} rollouts per epoch, "
        f"{args.epochs} epochs, seeds {args.seed_list}; configs {args.configs} (interleaved)"
        + (f"; {', '.join(args.short_configs)} at seeds {args.short_seeds} in epochs 1-{args.short_epochs} only"
           if args.short_configs else ""),
        (f"settle {args.settle:g} s: OSWorld's protocol (DesktopEnv.step(action, pause=2)), each gui and office "
         "action tool waits this long after acting, in every execution (real, replayed, speculative, audited)"
         if {"gui", "office"} & set(args.families)
         else f"settle {args.settle:g} s (the gui and office families'; neither in this run)"),
        f"CPU oversubscription: {rollouts} rollouts on {cpus} hardware threads = {rollouts / cpus:.1f} per thread "
        f"(the paper: {PAPER_ROLLOUTS_PER_THREAD} per thread); "
        + (f"CPU-heavy tool executions queue for {args.cpu_slots} CPU slots (the wait is the call's time, counted "
           "per epoch: cpu_slots)" if getattr(args, "cpu_slots", None) else "no CPU slots: CPU-heavy tools share "
           "the cores"),
        f"Full's resident cache: {args.cache_mib} MiB" + (
            f", at every memory sample at most what the rollouts' own workspaces leave under {share:g} x their "
            "highest level so far (PSS; bunshinrl.prefix.budget, RolloutCore(cache_share=))" if share is not None
            else ""),
        "targets (issue 38; printed after the run, never asserted), per seed over the compared epochs (all but "
        "the first): removed share (Base - Full) / (Base - oracle) >= 60% where the ceiling C = Base / oracle >= "
        "1.10; Full's own cost on the straggler's path (post_wait + materialize + spec_miss) <= 10% of Base - "
        "oracle; Full >= 1.2x Base (mean of seeds, none below 1.1x) where C >= 1.35, else S against C with the "
        "breakdown; Spec >= 1.05x Base on office with >= 30% of the straggler's calls served by speculation; hit "
        "rate >= 65% by epoch 3; Full's peak <= 1.1x Base's; Base's <= 0.7x CRIU's (cow, the guest line); "
        "contention factor <= 1.5; rewards identical, audit 0 mismatches",
    ]

