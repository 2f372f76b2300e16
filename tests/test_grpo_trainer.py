"""GRPOTrainer on real workspaces: the objective, learning against a random baseline in the same
run, bit-identical training under Base, Spec and Full (paper Fig. 11), exact resume."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from bunshinrl.grpo import suite
from bunshinrl.grpo.experiment import random_baseline
from bunshinrl.grpo.rollout import Episode

torch = pytest.importorskip("torch")

from bunshinrl.grpo.torch_policy import TorchPolicy  # noqa: E402
from bunshinrl.grpo.trainer import CHECKPOINT, GRPOConfig, GRPOTrainer, group_advantages, grpo_loss  # noqa: E402

# One task per family.
TASKS = [t for t in suite() if t.id in ("files-ab", "service-pong", "fix-both")]


def _ep(task: str, sample: int, reward: float) -> Episode:
    return Episode(task, sample, 0, "p", ("a",), (), reward)


def test_group_relative_advantages_and_clipped_objective() -> None:
    eps = [_ep("t", 0, 1.0), _ep("t", 1, 0.0), _ep("u", 0, 0.5), _ep("u", 1, 0.5)]
    adv = group_advantages(eps, 0.0)
    assert adv[:2] == pytest.approx([1.0, -1.0]) and adv[2:] == [0.0, 0.0]  # no spread, no signal

    owner = torch.tensor([0, 0, 1])
    old = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    a = torch.tensor([1.0, 1.0, -1.0])
    # On-policy (ratio 1) the loss is minus the mean advantage, per sequence then over sequences.
    loss, info = grpo_loss(old.clone(), old, a, owner, 2, 0.2)
    assert float(loss) == pytest.approx(-(1.0 + -1.0) / 2) and info["clip_fraction"] == 0.0
    # A ratio far above 1+eps with a positive advantage is clipped: no gradient pushes it further.
    new = torch.log(torch.tensor([0.9, 0.5, 0.5])).requires_grad_(True)
    loss, info = grpo_loss(new, old, a, owner, 2, 0.2)
    loss.backward()
    assert new.grad is not None and new.grad[0] == 0.0 and new.grad[1] != 0.0
    assert info["clip_fraction"] == pytest.approx(1 / 3)
    # The KL penalty is zero at the reference and positive away from it.
    _, info = grpo_loss(old.clone(), old, a, owner, 2, 0.2, ref=old.clone(), kl_coef=0.1)
    assert info["kl"] == 0.0
    _, info = grpo_loss(new.detach(), old, a, owner, 2, 0.2, ref=old, kl_coef=0.1)
    assert info["kl"] > 0.0


def test_training_beats_the_random_policy(tmp_path: Path) -> None:
    """A short CPU run: reward rises above what random actions score in the same run."""
    epochs, group = 6, 8
    random_rows = asyncio.run(random_baseline(TASKS, epochs, group, seed=0))
    trainer = GRPOTrainer(TorchPolicy.for_tasks(TASKS, seed=0), TASKS, config=GRPOConfig(group_size=group, seed=0),
                          checkpoint_dir=tmp_path)
    history = trainer.run(epochs)
    assert (tmp_path / CHECKPOINT).exists()
    assert all(m.errors == 0 for m in history) and all(r["errors"] == 0 for r in random_rows)
    random_mean = statistics.fmean(r["reward"] for r in random_rows)
    first, last = history[0].reward_mean, statistics.fmean(m.reward_mean for m in history[-2:])
    print(f"random {random_mean:.3f}; trained {[round(m.reward_mean, 3) for m in history]}")
    assert last > first + 0.15 and last > random_mean + 0.15
    families = ("files", "fix", "service")
    fam_random = {f: statistics.fmean(r["reward_by_family"][f] for r in random_rows) for f in families}
    fam_last = {f: statistics.fmean(m.reward_by_family[f] for m in history[-2:]) for f in fam_random}
    assert sum(fam_last[f] > fam_random[f] + 0.15 for f in fam_random) >= 1, (fam_last, fam_random)
    # Metrics a training dashboard needs are all there.
    m = history[-1]
    assert m.rollout_seconds > 0 and m.peak_memory_bytes > 0 and m.tool_calls > 0 and 0 <= m.hit_rate <= 1
    assert m.reward_std >= 0 and m.logprob_drift is not None and m.logprob_drift < 1e-4


def test_base_spec_and_full_train_identically() -> None:
    """Paper Fig. 11: with the same seeds, caching and speculation change nothing about what is
    sampled or learned, epoch by epoch, while they do serve calls."""
    cfg = GRPOConfig(group_size=4, seed=1)
    runs = {}
    for name in ("Base", "Spec", "Full"):
        # A model's decoding time (emulated): speculation needs something to overlap with.
        trainer = GRPOTrainer(TorchPolicy.for_tasks(TASKS, seed=1), TASKS, config=cfg, engine=name,  # type: ignore[arg-type]
                              think_seconds=0.25)
        runs[name] = trainer.run(3)
    for name, history in runs.items():
        # A rollout that failed (the infrastructure, not the policy) is a different failure
        # from a divergence: say which.
        for m in history:
            assert m.errors == 0, (name, m.epoch, m.extra["sample_errors"])
    for name in ("Spec", "Full"):
        for b, r in zip(runs["Base"], runs[name], strict=True):
            assert r.trajectory_digest == b.trajectory_digest, (name, r.epoch)
            assert r.reward_mean == b.reward_mean and r.reward_by_task == b.reward_by_task
            assert r.params_digest == b.params_digest
    # Speculation ran (how many of its guesses it adopts is the speculator's own policy).
    assert sum(m.extra["speculation"]["launched"] for m in runs["Spec"]) > 0
    print("spec hits", [m.spec_hits for m in runs["Spec"]], "cache hits", [m.cache_hits for m in runs["Full"]])
    assert sum(m.cache_hits for m in runs["Full"]) > 0 and runs["Full"][-1].hit_rate > 0
    assert all(m.cache_hits == m.spec_hits == 0 for m in runs["Base"])


def test_checkpoint_resume_continues_exactly(tmp_path: Path) -> None:
    tasks = [t for t in TASKS if t.id != "service-pong"]
    cfg = GRPOConfig(group_size=4, seed=2, kl_coef=0.05)  # the KL path checkpoints its reference too
    straight = GRPOTrainer(TorchPolicy.for_tasks(tasks, seed=2), tasks, config=cfg).run(3)

    first = GRPOTrainer(TorchPolicy.for_tasks(tasks, seed=2), tasks, config=cfg, checkpoint_dir=tmp_path)
    first.run(2)
    resumed = GRPOTrainer.from_checkpoint(tmp_path / CHECKPOINT, tasks, checkpoint_dir=tmp_path)
    assert resumed.epoch == 2 and len(resumed.history) == 2 and resumed.reference is not None
    history = resumed.run(3)
    assert [m.trajectory_digest for m in history] == [m.trajectory_digest for m in straight]
    assert history[-1].params_digest == straight[-1].params_digest
    assert straight[-1].kl > 0

    with pytest.raises(ValueError, match="was trained with"):
        GRPOTrainer(TorchPolicy.for_tasks(tasks, seed=2), tasks, config=GRPOConfig(group_size=4, seed=9)).load(
            tmp_path / CHECKPOINT)
