"""A short real GRPO training run on bunshinrl: python -m bunshinrl.demo [--out results]

Writes the test model (a random-init Qwen2 with a tokenizer trained on the task suite; see
bunshinrl.grpo.testmodel), then trains it token by token with GRPO, rolled out in process by
transformers' generate on the built-in verifiable task suite (files, a service, a bug fix;
rewards read from the final workspace state) with Full BunshinRL (memory-sharing forks,
tool-prefix cache, speculative tool execution), next to the untrained model under the same
decoding constraints. Prints reward, hit rate, rollout time and memory per epoch and writes
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
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--config", default="Full", choices=("Base", "Spec", "Full"))
    ap.add_argument("--tasks", help="comma-separated task ids (default: the whole suite)")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        from .grpo.trainer import GRPOConfig
    except ImportError as e:
        print(f"the bunshinrl demo trains with torch and transformers, which are missing ({e}); "
              "`bash scripts/setup.sh` installs them", file=sys.stderr)
        return 2
    from .grpo import experiment
    from .grpo.tasks import suite

    tasks = [t for t in suite() if not args.tasks or t.id in args.tasks.split(",")]
    if not tasks:
        print(f"no task matches {args.tasks!r}", file=sys.stderr)
        return 2
    grpo = GRPOConfig(group_size=args.group, lr=args.lr)
    print(f"bunshinrl demo: token-level GRPO ({args.config}) of the test model on {len(tasks)} tasks x {args.group} "
          f"samples, {args.epochs} epochs; the untrained model alongside")
    for t in tasks:
        print(f"  {t.id:14s} {t.prompt}")
    t0 = time.monotonic()

    def log(name: str, row: dict) -> None:
        print(experiment.format_row(name, args.seed, row), flush=True)

    with experiment.lab("hf") as lab:
        random = experiment.run(lab, "Random", tasks, args.epochs, grpo, args.seed, log)
        trained = experiment.run(lab, args.config, tasks, args.epochs, grpo, args.seed, log)
    verdict = experiment.learning([trained], [random])
    summary = {"Random": experiment.config_summary(random, None), args.config: experiment.config_summary(trained, None)}
    report = {"settings": {"config": args.config, "tasks": [t.id for t in tasks], "group_size": args.group,
                           "epochs": args.epochs, "lr": args.lr, "seed": args.seed,
                           "wall_seconds": time.monotonic() - t0},
              "configs": summary, "learning": verdict}
    path = experiment.write_report(args.out, "grpo_demo.json", report)
    png = experiment.plot([trained], [random], {args.config: trained}, args.out / "grpo_demo.png",
                          title=f"bunshinrl demo: GRPO ({args.config}) of the test model")
    s = summary[args.config]
    print(f"\nreward per epoch ({args.config}): {' '.join(f'{r:.2f}' for r in s['reward_per_epoch'])}")
    print(f"reward per epoch (untrained): {' '.join(f'{r:.2f}' for r in summary['Random']['reward_per_epoch'])}")
    fams = trained.rows[-1]["reward_by_family"]
    for fam in fams:
        last = sum(r["reward_by_family"][fam] for r in trained.rows[-2:]) / len(trained.rows[-2:])
        base = sum(r["reward_by_family"][fam] for r in random.rows) / len(random.rows)
        print(f"  {fam:8s} trained {last:.2f} vs untrained {base:.2f}")
    print(f"hit rate per epoch: {' '.join(f'{h:.0%}' for h in s['hit_rate_per_epoch'])};  rollout seconds: "
          f"{' '.join(f'{x:.1f}' for x in s['rollout_seconds_per_epoch'])};  peak memory "
          f"{s['peak_memory_bytes'] / experiment.MiB:.0f} MiB;  tokens trained {sum(s['tokens_trained_per_epoch'])}")
    print(f"wrote {path} and {png} ({time.monotonic() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
