"""Token-level GRPO of the test model, rolled out in process with transformers' generate, on real
workspaces: seeded sampling whose log-probs the learner reproduces, learning against the
untrained model, bit-identical training under Base, Spec and Full (paper Fig. 11), exact resume."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from bunshinrl import SampleContext
from bunshinrl.grpo import suite
from bunshinrl.policies.chat import candidate_replies

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bunshinrl.grpo import testmodel  # noqa: E402
from bunshinrl.policies.hf_policy import HFPolicy  # noqa: E402
from bunshinrl.training.trainer import CHECKPOINT, GRPOConfig, GRPOTrainer  # noqa: E402

TASKS = [t for t in suite() if t.id in ("files-ab", "service-pong", "fix-both")]
LR = 5e-3  # for a 0.5M-parameter model trained from scratch; real checkpoints want ~1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testmodel.make(tmp_path_factory.mktemp("tiny"))


def test_sampling_is_seeded_constrained_and_reproduced_by_the_learner(model_dir: Path) -> None:
    policy = HFPolicy.from_pretrained(model_dir, TASKS)
    assert policy.constrain  # on by default for the test model only
    task = TASKS[2]
    replies = set()
    for sample in range(12):
        ctx = SampleContext(task.id, sample, 0, task.prompt)
        turn, text = policy.decide(ctx, [])
        assert policy.decide(ctx, [])[0] == turn  # the decision's own seed: the same reply
        assert text in candidate_replies(task) and turn.choices == candidate_replies(task)
        assert turn.response_ids[-1] == policy.tokenizer.eos_token_id and turn.finish_reason == "stop"
        replies.add(text)
        # The learner's log-probs of the sampled tokens, under the same mask, are the sampler's.
        assert policy.turn_logprobs(turn) == pytest.approx(turn.logprobs, abs=1e-5)
        allowed = policy.constraint(turn.choices).allowed_each(list(turn.response_ids))
        assert all(x == 0.0 for x, a in zip(turn.logprobs, allowed, strict=True) if len(a) == 1)  # forced tokens
    assert len(replies) > 2  # an untrained policy explores
    free = HFPolicy.from_pretrained(model_dir, TASKS, constrain=False, max_new_tokens=12)
    turn, _ = free.decide(SampleContext(task.id, 0, 0, task.prompt), [])
    assert turn.choices is None and len(turn.response_ids) <= 12


def test_training_beats_the_untrained_model(model_dir: Path, tmp_path: Path) -> None:
    """A short CPU run: the trained model's reward rises above what the untrained model scores
    under the same constraints, in the same run. Every epoch's weights are synced (in process)."""
    # The demo's size (bunshinrl.demo): its seeded rewards are 0.058 0.137 0.175 trained against
    # 0.058 0.050 untrained; two more epochs (0.196, 0.429) cost CI a minute and show nothing new.
    epochs, cfg = 3, GRPOConfig(group_size=8, lr=2 * LR)
    untrained = GRPOTrainer(HFPolicy.from_pretrained(model_dir, TASKS), TASKS, config=cfg, learn=False).run(2)
    trainer = GRPOTrainer(HFPolicy.from_pretrained(model_dir, TASKS), TASKS, config=cfg, checkpoint_dir=tmp_path)
    history = trainer.run(epochs)
    assert (tmp_path / CHECKPOINT).exists()
    assert all(m.errors == 0 for m in history + untrained), [m.extra["sample_errors"] for m in history]
    random_mean = statistics.fmean(m.reward_mean for m in untrained)
    last = statistics.fmean(m.reward_mean for m in history[-2:])
    print(f"untrained {random_mean:.3f}; trained {[round(m.reward_mean, 3) for m in history]}")
    assert last > random_mean + 0.08
    assert [s["served_version"] for s in trainer.weight_syncs] == [str(i) for i in range(1, epochs + 1)]
    assert [m.weight_version for m in history] == [str(i) for i in range(epochs)]
    assert all(m.weight_version == "0" for m in untrained) and untrained[0].params_digest == untrained[-1].params_digest
    m = history[-1]
    assert m.tokens_trained > 0 and m.sequences >= len(TASKS) and m.logprob_drift is not None
    assert m.logprob_drift < 1e-5  # in process, the learner recomputes what generate sampled
    assert m.rollout_seconds > 0 and m.peak_memory_bytes > 0 and m.tool_calls > 0 and 0 <= m.hit_rate <= 1


def test_base_spec_and_full_train_identically(model_dir: Path) -> None:
    """Paper Fig. 11: with the same seeds, caching and speculation change nothing about what is
    sampled or learned, epoch by epoch, while they do serve calls."""
    tasks = TASKS[1:]
    cfg = GRPOConfig(group_size=4, lr=LR)
    # Two epochs: the second is where the cache serves earlier epochs' calls and the selector,
    # fitted after the first, launches speculation.
    runs = {name: GRPOTrainer(HFPolicy.from_pretrained(model_dir, tasks), tasks, config=cfg,
                              engine=name).run(2)  # type: ignore[arg-type]
            for name in ("Base", "Spec", "Full")}
    for name, history in runs.items():
        for m in history:
            assert m.errors == 0, (name, m.epoch, m.extra["sample_errors"])
    for name in ("Spec", "Full"):
        for b, r in zip(runs["Base"], runs[name], strict=True):
            assert r.trajectory_digest == b.trajectory_digest, (name, r.epoch)
            assert r.reward_by_task == b.reward_by_task and r.tokens_trained == b.tokens_trained
            assert r.params_digest == b.params_digest
    assert runs["Base"][0].params_digest != runs["Base"][-1].params_digest  # it did train
    assert sum(m.extra["speculation"]["launched"] for m in runs["Spec"]) > 0
    assert sum(m.cache_hits for m in runs["Full"]) > 0
    assert all(m.cache_hits == m.spec_hits == 0 for m in runs["Base"])


def test_checkpoint_resume_continues_exactly(model_dir: Path, tmp_path: Path) -> None:
    tasks = TASKS[1:]
    cfg = GRPOConfig(group_size=4, lr=LR, kl_coef=0.05)  # the KL path checkpoints its reference too
    straight = GRPOTrainer(HFPolicy.from_pretrained(model_dir, tasks), tasks, config=cfg).run(2)

    first = GRPOTrainer(HFPolicy.from_pretrained(model_dir, tasks), tasks, config=cfg, checkpoint_dir=tmp_path)
    first.run(1)
    resumed = GRPOTrainer(HFPolicy.from_pretrained(model_dir, tasks), tasks, config=cfg, checkpoint_dir=tmp_path)
    resumed.load(tmp_path / CHECKPOINT)
    assert resumed.epoch == 1 and resumed.version == 1 and resumed.reference is not None
    history = resumed.run(2)
    assert [m.trajectory_digest for m in history] == [m.trajectory_digest for m in straight]
    assert history[-1].params_digest == straight[-1].params_digest
    assert max(m.kl for m in straight) > 0

    with pytest.raises(ValueError, match="was trained with"):
        GRPOTrainer(HFPolicy.from_pretrained(model_dir, tasks), tasks,
                    config=GRPOConfig(group_size=4, lr=1.0)).load(tmp_path / CHECKPOINT)


def test_a_rollout_policy_without_turns_or_sync_is_refused(model_dir: Path) -> None:
    from bunshinrl.grpo import RandomPolicy

    policy = HFPolicy.from_pretrained(model_dir, TASKS)
    with pytest.raises(ValueError, match="weight_sync"):
        GRPOTrainer(policy, TASKS, rollout_policy=RandomPolicy({t.id: t for t in TASKS}))
