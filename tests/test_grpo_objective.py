"""Token-level GRPO math against verl's own `core_algos`, and the loss mask: only tokens the
policy generated carry gradient."""

from __future__ import annotations

from pathlib import Path

import pytest

from bunshinrl import Step, ToolCall
from bunshinrl.training.objective import LOSS_AGG_MODES, agg_loss, group_advantages, grpo_loss, kl_k3

torch = pytest.importorskip("torch")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl (scripts/setup.sh installs it)")


def _inputs(seed: int, rows: int = 12, width: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    start = torch.randint(0, 5, (rows,), generator=g)
    mask = torch.zeros(rows, width)
    for i in range(rows):
        mask[i, start[i]:min(width, start[i] + lengths[i])] = 1.0
    mask[3] = 0.0  # a row with nothing generated (an episode that answered at once)
    old = -torch.rand(rows, width, generator=g) * 3
    return {"old": old, "new": old + torch.randn(rows, width, generator=g) * 0.4,
            "ref": old + torch.randn(rows, width, generator=g) * 0.3,
            "adv": torch.randn(rows, 1, generator=g).expand(rows, width).contiguous(), "mask": mask}


def test_group_advantages_equal_verls_grpo_outcome_advantage() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    for trial in range(5):
        n = 24
        groups = rng.integers(0, 5, n)
        groups[0] = 99  # a group of one
        rewards = rng.choice([0.0, 0.2, 0.5, 1.0], n)
        if trial == 1:
            rewards[groups == groups[1]] = 0.5  # a group without spread
        mask = torch.ones(n, 7)
        token_rewards = torch.zeros(n, 7)
        token_rewards[:, -1] = torch.tensor(rewards, dtype=torch.float32)
        ref, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, np.array([str(g) for g in groups]))
        ours = group_advantages(rewards.tolist(), [str(g) for g in groups])
        assert torch.allclose(ref[:, 0], torch.tensor(ours, dtype=torch.float32), atol=1e-5), trial


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_and_k3_kl_equal_verls(mode: str) -> None:
    from verl.workers.config import ActorConfig

    for seed, (low, high) in enumerate([(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)]):
        x = _inputs(seed)
        cfg = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, clip_ratio=low,
                          clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode)
        pg, metrics = core_algos.compute_policy_loss_vanilla(x["old"], x["new"], x["adv"], x["mask"], mode, cfg)
        kl_ref = core_algos.agg_loss(core_algos.kl_penalty(x["new"], x["ref"], "low_var_kl"), x["mask"], mode)
        beta = 0.05
        ours, info = grpo_loss(x["new"], x["old"], x["adv"], x["mask"], clip_eps=low, clip_eps_high=high,
                               ref_logprob=x["ref"], kl_coef=beta, mode=mode)
        assert float(ours) == pytest.approx(float(pg + beta * kl_ref), rel=1e-5, abs=1e-6), (mode, seed)
        assert info.clip_fraction == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
        assert info.ppo_kl == pytest.approx(metrics["actor/ppo_kl"], abs=1e-6)
        assert info.kl == pytest.approx(float(kl_ref), rel=1e-5)
        assert torch.equal(kl_k3(x["new"], x["ref"]), core_algos.kl_penalty(x["new"], x["ref"], "low_var_kl"))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_whole_batch_loss(mode: str) -> None:
    x = _inputs(7)
    whole, _ = grpo_loss(x["new"], x["old"], x["adv"], x["mask"], mode=mode)
    tokens, rows = float(x["mask"].sum()), float((x["mask"].sum(-1) > 0).sum())
    parts = sum(grpo_loss(x["new"][s], x["old"][s], x["adv"][s], x["mask"][s], mode=mode, total_tokens=tokens,
                          total_rows=rows)[0] for s in (slice(0, 5), slice(5, 12)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)
    assert float(agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode, total_tokens=1, total_rows=1)) == 0.0


def test_only_generated_tokens_get_gradient(tmp_path: Path) -> None:
    """A two-turn episode stitched into one sequence: the prompt, the tool's output and the
    template's scaffolding have mask 0 and zero gradient; the model's tokens do not."""
    from bunshinrl.grpo import suite, testmodel
    from bunshinrl.policies.chat import render_call
    from bunshinrl.policies.hf_policy import HFPolicy
    from bunshinrl.policies.turns import Turn, stitch

    task = next(t for t in suite() if t.id == "files-ab")
    policy = HFPolicy.from_pretrained(testmodel.make(tmp_path / "m"), [task])
    tok = policy.tokenizer
    call = ToolCall("write_file", {"content": "alpha\n", "path": "/root/out/a.txt"})
    p0 = policy.prompt_ids(task.id, task.prompt, [])
    # The reply tokenized as the template will re-render it, so the next prompt extends this one.
    r0 = [*tok.encode(render_call(call), add_special_tokens=False), tok.eos_token_id]
    observation = "wrote 6 bytes to /root/out/a.txt"
    p1 = policy.prompt_ids(task.id, task.prompt, [Step(call, observation)])
    r1 = [*tok.encode("Done.", add_special_tokens=False), tok.eos_token_id]
    turns = [Turn(tuple(p0), tuple(r0), (0.0,) * len(r0)), Turn(tuple(p1), tuple(r1), (0.0,) * len(r1))]
    rows = stitch(turns)
    assert len(rows) == 1, "the second prompt extends the first turn: one sequence"
    row = rows[0]
    assert row.ids == p1 + r1
    text_between = tok.decode(row.ids[len(p0) + len(r0):len(p1)])
    assert observation in text_between and "<|im_start|>user" in text_between
    assert row.generated == [0] * len(p0) + [1] * len(r0) + [0] * (len(p1) - len(p0) - len(r0)) + [1] * len(r1)

    ids = torch.tensor([row.ids])
    mask = torch.tensor([row.generated], dtype=torch.float)
    policy.model.train()
    lp = policy.token_logprobs(ids, torch.ones_like(ids))
    lp.retain_grad()
    adv = torch.full_like(mask, 1.0)
    loss, _ = grpo_loss(lp, lp.detach(), adv, mask)
    loss.backward()
    grad = lp.grad[0]
    assert torch.all(grad[mask[0] == 0] == 0)
    assert torch.all(grad[mask[0] == 1] != 0)
    # The observation's own tokens: those whose characters fall inside it.
    ends = [len(tok.decode(row.ids[:i + 1])) for i in range(len(row.ids))]
    at = tok.decode(row.ids).index(observation, ends[len(p0) + len(r0) - 1])
    tool_output = [i for i in range(len(row.ids)) if ends[i] > at and (i == 0 or ends[i - 1] < at + len(observation))]
    assert len(tool_output) >= 3 and all(mask[0, i] == 0 and grad[i] == 0 for i in tool_output)
    # And the parameters do move, through the generated tokens only.
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.model.parameters())

    # A template that re-renders history differently breaks the prefix: the episode splits.
    rerendered = list(p1)
    rerendered[len(p0) + 1] = tok.pad_token_id  # the first reply, tokenized otherwise
    parts = stitch([turns[0], Turn(tuple(rerendered), tuple(r1), (0.0,) * len(r1))])
    assert [len(p.ids) for p in parts] == [len(p0) + len(r0), len(p1) + len(r1)]
    assert [p.n_generated for p in parts] == [len(r0), len(r1)]
