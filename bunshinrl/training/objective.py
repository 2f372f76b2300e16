"""GRPO's math, token level: group-relative advantages, the clipped surrogate per token, k3 KL.

Written to agree with verl's `verl.trainer.ppo.core_algos` (tested against it on random
inputs): `compute_grpo_outcome_advantage` (a group's rewards standardised with the unbiased
std, eps 1e-6; a group of one keeps its raw reward), `compute_policy_loss_vanilla` (PPO's clip
plus dual-clip for negative advantages, log-ratio clamped to [-20, 20]), `kl_penalty(...,
"low_var_kl")` (k3) and `agg_loss` ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum").
All tensors are [rows, tokens] with a 0/1 mask of the tokens that count (those the policy
generated); the aggregations accept global token / sequence counts, so micro-batches summed
give the loss of the whole batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def group_advantages(rewards: Sequence[float], groups: Sequence[Hashable], eps: float = 1e-6) -> list[float]:
    """Each reward standardised within its group: (r - mean) / (std + eps), std unbiased.
    A group with a single member has nothing to be relative to; like verl, it keeps r."""
    by: dict[Hashable, list[float]] = defaultdict(list)
    for r, g in zip(rewards, groups, strict=True):
        by[g].append(float(r))
    stats = {}
    for g, rs in by.items():
        if len(rs) == 1:
            stats[g] = (0.0, 1.0)
        else:
            t = torch.tensor(rs)
            stats[g] = (float(t.mean()), float(t.std()))
    return [(float(r) - stats[g][0]) / (stats[g][1] + eps) for r, g in zip(rewards, groups, strict=True)]


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, total_tokens: float | None = None,
             total_rows: float | None = None) -> torch.Tensor:
    """A [rows, tokens] loss reduced to a scalar. total_tokens / total_rows: the whole batch's
    counts when `loss` is one micro-batch of it (None: this tensor is the batch)."""
    if mode == "token-mean":
        denom = mask.sum() if total_tokens is None else total_tokens
        return (loss * mask).sum() / denom
    rows_present = (mask.sum(-1) > 0).float()
    denom = rows_present.sum() if total_rows is None else total_rows
    if mode == "seq-mean-token-mean":
        per_row = (loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    elif mode == "seq-mean-token-sum":
        per_row = (loss * mask).sum(-1)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; one of {', '.join(LOSS_AGG_MODES)}")
    return (per_row * rows_present).sum() / denom


def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token (non-negative, low variance)."""
    d = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)


@dataclass(frozen=True)
class LossInfo:
    clip_fraction: float
    ppo_kl: float
    kl: float


def grpo_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              clip_eps: float = 0.2, clip_eps_high: float | None = None, dual_clip: float | None = 3.0,
              ref_logprob: torch.Tensor | None = None, kl_coef: float = 0.0, mode: str = "token-mean",
              total_tokens: float | None = None, total_rows: float | None = None) -> tuple[torch.Tensor, LossInfo]:
    """The clipped surrogate per generated token (plus kl_coef * k3 KL to the reference),
    aggregated by `mode`. Prompt, tool-output and template tokens have mask 0 and contribute
    nothing, not even through the denominators."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = torch.clamp(logprob - old_logprob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + high)
    clipped = torch.maximum(loss1, loss2)
    per_token = clipped
    if dual_clip is not None:
        # Dual clip (Ye et al. 2020): a very unlikely token with a negative advantage cannot
        # push the loss beyond -A * c.
        per_token = torch.where(advantages < 0, torch.minimum(-advantages * dual_clip, clipped), clipped)
    loss = agg_loss(per_token, mask, mode, total_tokens=total_tokens, total_rows=total_rows)
    kl_value = 0.0
    if ref_logprob is not None and kl_coef > 0:
        kl = kl_k3(logprob, ref_logprob)
        kl_loss = agg_loss(kl, mask, mode, total_tokens=total_tokens, total_rows=total_rows)
        loss = loss + kl_coef * kl_loss
        kl_value = float(kl_loss.detach())
    n = mask.sum().clamp(min=1)
    info = LossInfo(clip_fraction=float(((loss2 > loss1).float() * mask).sum() / n),
                    ppo_kl=float((-log_ratio * mask).sum().detach() / n), kl=kl_value)
    return loss, info


__all__ = ["LOSS_AGG_MODES", "LossInfo", "agg_loss", "group_advantages", "grpo_loss", "kl_k3"]
