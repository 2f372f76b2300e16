"""GRPO training benchmark on bunshinrl (paper section 5.3, Figs. 10 and 11).

python benchmarks/grpo_train.py [--quick] --out DIR

Trains the same TorchPolicy (same seed) on the verifiable task suite with each rollout
configuration, plus a random-policy baseline through the Base engine:

  Random  uniformly random actions, no training: what chance scores
  Base    memory sharing only: each group forks one initialized workspace
  Spec    + speculative tool execution (selector refitted after every epoch)
  Full    + tool-prefix caching

DIR/grpo_train.json holds per configuration reward_per_epoch, rollout_seconds_per_epoch,
hit_rate_per_epoch, peak_memory_bytes and identical_to_base (trajectories, rewards and weights
bit-identical to Base's in every epoch), plus a learning verdict against the random baseline;
DIR/grpo_train.png plots reward, hit rate and rollout time per epoch.

--think emulates a real model's decoding latency per decision (the tiny policy answers in
about a millisecond, which would leave speculation nothing to hide); it is reported in the
JSON settings.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bunshinrl.grpo import experiment
from bunshinrl.grpo.tasks import suite

QUICK_TASKS = ("files-ab", "service-pong", "fix-both")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="one task per family, fewer epochs (fits CI)")
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--group", type=int, help="GRPO group size (samples per task)")
    ap.add_argument("--tasks", help="comma-separated task ids (default: the whole suite; --quick: one per family)")
    ap.add_argument("--configs", default=",".join(experiment.ALL))
    ap.add_argument("--think", type=float, default=0.05, help="emulated decoding seconds per decision")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    try:
        from bunshinrl.grpo.trainer import GRPOConfig
    except ImportError as e:
        print(f"grpo_train needs torch (bash scripts/setup.sh installs the CPU build): {e}", file=sys.stderr)
        return 2
    epochs = args.epochs or (6 if args.quick else 10)
    group = args.group or (6 if args.quick else 8)
    wanted = args.tasks.split(",") if args.tasks else (list(QUICK_TASKS) if args.quick else None)
    tasks = [t for t in suite() if wanted is None or t.id in wanted]
    if wanted is not None and len(tasks) != len(wanted):
        known = ", ".join(t.id for t in suite())
        print(f"unknown task in {args.tasks!r}; known: {known}", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in experiment.ALL:
            print(f"unknown configuration {c!r}; one of {', '.join(experiment.ALL)}", file=sys.stderr)
            return 2
    grpo = GRPOConfig(group_size=group, lr=args.lr, seed=args.seed)
    print(f"GRPO on {len(tasks)} tasks ({', '.join(t.id for t in tasks)}) x {group} samples, {epochs} epochs, "
          f"configurations {', '.join(configs)}, emulated decode {args.think}s/decision")
    t0 = time.monotonic()
    summary, _runs = experiment.run_all(tasks, configs, epochs, grpo, seed=args.seed, think_seconds=args.think,
                                        log=lambda name, row: print(experiment.format_row(name, row), flush=True))
    report = {
        "settings": {"tasks": [t.id for t in tasks], "group_size": group, "epochs": epochs, "lr": args.lr,
                     "seed": args.seed, "think_seconds": args.think, "quick": args.quick,
                     "wall_seconds": time.monotonic() - t0},
        "configs": summary,
        "learning": experiment.learning_verdict(summary),
    }
    path = experiment.write_report(args.out, "grpo_train.json", report)
    png = experiment.plot(summary, args.out / "grpo_train.png",
                          title=f"GRPO on bunshinrl: {len(tasks)} tasks x {group} samples")
    for name, s in summary.items():
        same = "" if s["identical_to_base"] is None else f"  identical to Base: {s['identical_to_base']}"
        print(f"{name:6s} reward {' '.join(f'{r:.2f}' for r in s['reward_per_epoch'])}  "
              f"peak {s['peak_memory_bytes'] / experiment.MiB:.1f} MiB{same}")
    v = report["learning"]
    if v:
        print(f"trained ({v['trained_config']}) last epochs {v['trained_final_reward']:.3f} vs random "
              f"{v['random_mean_reward']:.3f}; families above random: {', '.join(v['families_beating_random'])}")
    print(f"wrote {path} and {png}")
    mismatched = [n for n, s in summary.items() if s["identical_to_base"] is False]
    if mismatched:
        print(f"ERROR: {', '.join(mismatched)} diverged from Base", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
