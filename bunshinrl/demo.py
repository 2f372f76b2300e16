"""A short real GRPO training run on bunshinrl: python -m bunshinrl.demo [--out results]

Trains a tiny transformer policy from scratch on the built-in verifiable task suite (files,
a service, a bug fix; rewards read from the final workspace state) with Full BunshinRL
(memory-sharing forks, tool-prefix cache, speculative tool execution), next to a random-policy
baseline in the same run. Prints reward, hit rate, rollout time and memory per epoch and writes
OUT/grpo_demo.json and OUT/grpo_demo.png. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bunshinrl.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--group", type=int, default=6)
    ap.add_argument("--config", default="Full", choices=("Base", "Spec", "Full"))
    ap.add_argument("--tasks", help="comma-separated task ids (default: the whole suite)")
    ap.add_argument("--think", type=float, default=0.05, help="emulated decoding seconds per decision")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        from .grpo.trainer import GRPOConfig
    except ImportError as e:
        print(f"the bunshinrl demo trains with torch, which is missing ({e}); `bash scripts/setup.sh` "
              "installs the CPU build", file=sys.stderr)
        return 2
    from .grpo import experiment
    from .grpo.tasks import suite

    tasks = [t for t in suite() if not args.tasks or t.id in args.tasks.split(",")]
    if not tasks:
        print(f"no task matches {args.tasks!r}", file=sys.stderr)
        return 2
    grpo = GRPOConfig(group_size=args.group, seed=args.seed)
    print(f"bunshinrl demo: GRPO ({args.config}) on {len(tasks)} tasks x {args.group} samples, {args.epochs} epochs;"
          f" a random policy alongside")
    for t in tasks:
        print(f"  {t.id:14s} {t.prompt}")
    t0 = time.monotonic()
    summary, _ = experiment.run_all(tasks, ["Random", args.config], args.epochs, grpo, seed=args.seed,
                                    think_seconds=args.think,
                                    log=lambda n, row: print(experiment.format_row(n, row), flush=True))
    verdict = experiment.learning_verdict(summary, trained=args.config)
    report = {"settings": {"config": args.config, "tasks": [t.id for t in tasks], "group_size": args.group,
                           "epochs": args.epochs, "think_seconds": args.think, "seed": args.seed,
                           "wall_seconds": time.monotonic() - t0},
              "configs": summary, "learning": verdict}
    path = experiment.write_report(args.out, "grpo_demo.json", report)
    png = experiment.plot(summary, args.out / "grpo_demo.png", title=f"bunshinrl demo: GRPO ({args.config})")
    trained = summary[args.config]
    print(f"\nreward per epoch ({args.config}): {' '.join(f'{r:.2f}' for r in trained['reward_per_epoch'])}")
    print(f"reward per epoch (random): {' '.join(f'{r:.2f}' for r in summary['Random']['reward_per_epoch'])}")
    for fam, v in verdict["per_family"].items():
        print(f"  {fam:8s} trained {v['trained']:.2f} vs random {v['random']:.2f}")
    print(f"hit rate per epoch: {' '.join(f'{h:.0%}' for h in trained['hit_rate_per_epoch'])};  rollout seconds: "
          f"{' '.join(f'{s:.1f}' for s in trained['rollout_seconds_per_epoch'])};  peak memory "
          f"{trained['peak_memory_bytes'] / experiment.MiB:.0f} MiB")
    print(f"wrote {path} and {png} ({time.monotonic() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
