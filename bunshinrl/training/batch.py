"""The training batch: each verified episode's token sequences stitched from the backend's
recorded turns, with their advantages and constrained columns, cut into micro-batches of
padded tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..policies.hf_policy import HFPolicy
from ..policies.turns import TokenSequence, Turn, TurnKey, stitch
from .episodes import Episode
from .objective import group_advantages


@dataclass
class Batch:
    rows: list[TokenSequence]
    advantages: list[float]  # per row (its episode's)
    constrained: list[list[tuple[int, Sequence[int]]]]  # per row: (column, allowed ids)


def build_batch(eps: Sequence[Episode], turns: Mapping[TurnKey, Turn], policy: HFPolicy, adv_eps: float) -> Batch:
    """Training rows of the verified episodes that took at least one decision."""
    train = [e for e in eps if e.ok and e.actions]
    adv = group_advantages([e.reward for e in train], [e.task_id for e in train], adv_eps)
    rows: list[TokenSequence] = []
    row_adv: list[float] = []
    for i, e in enumerate(train):
        missing = [s for s in e.decisions if (e.task_id, e.sample, s) not in turns]
        if missing:
            raise RuntimeError(f"{e.task_id}/{e.sample}: no turn recorded for decision(s) {missing}")
        for row in stitch((turns[(e.task_id, e.sample, s)] for s in e.decisions), owner=i):
            rows.append(row)
            row_adv.append(adv[i])
    constrained = []
    for row in rows:
        cols = []
        for seg in row.segments:
            if seg.choices is None:
                continue
            gen = row.ids[seg.start:seg.start + seg.length]
            for j, allowed in enumerate(policy.constraint(seg.choices).allowed_each(gen)):
                cols.append((seg.start + j, allowed))
        constrained.append(cols)
    return Batch(rows, row_adv, constrained)


def micro_batches(b: Batch, micro_batch_tokens: int) -> list[list[int]]:
    groups: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for i, row in enumerate(b.rows):
        w = max(width, len(row.ids))
        if cur and w * (len(cur) + 1) > micro_batch_tokens:
            groups.append(cur)
            cur, w = [], len(row.ids)
        cur.append(i)
        width = w
    if cur:
        groups.append(cur)
    return groups

def batch_tensors(b: Batch, idx: Sequence[int], policy: HFPolicy) -> dict[str, Any]:
    pad = policy.tokenizer.pad_token_id or 0
    width = max(len(b.rows[i].ids) for i in idx)
    n = len(idx)
    ids = torch.full((n, width), pad, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width))
    rollout = torch.zeros((n, width))
    adv = torch.zeros((n, width))
    constrained = []
    for r, i in enumerate(idx):
        row = b.rows[i]
        L = len(row.ids)
        ids[r, :L] = torch.tensor(row.ids)
        attention[r, :L] = 1
        mask[r, :L] = torch.tensor(row.generated, dtype=torch.float)
        rollout[r, :L] = torch.tensor(row.rollout_logprobs)
        adv[r, :L] = b.advantages[i]
        constrained += [(r, c, allowed) for c, allowed in b.constrained[i]]
    dev = policy.device
    return {"ids": ids.to(dev), "attention": attention.to(dev), "mask": mask.to(dev), "rollout": rollout.to(dev),
            "adv": adv.to(dev), "constrained": constrained}
