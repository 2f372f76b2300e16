"""GRPOTrainer's configuration, its per-epoch metrics, and the checkpoint's file name."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .objective import LOSS_AGG_MODES

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 8
    lr: float = 2e-3
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # DAPO's clip-higher; None: symmetric
    dual_clip: float | None = 3.0
    kl_coef: float = 0.0  # beta; 0 trains without a reference model
    updates_per_epoch: int = 4  # optimisation passes over each epoch's batch (GRPO's mu)
    max_grad_norm: float = 1.0
    adv_eps: float = 1e-6
    loss_agg_mode: str = "token-mean"
    micro_batch_tokens: int = 8192  # padded tokens per forward pass; gradients accumulate
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r}; one of {', '.join(LOSS_AGG_MODES)}")


@dataclass
class StepMetrics:
    epoch: int
    reward_mean: float
    reward_std: float
    reward_by_task: dict[str, float]
    reward_by_family: dict[str, float]
    rollout_seconds: float  # the engine's epoch: first setup to last rollout finished
    update_seconds: float
    sync_seconds: float
    weight_version: str  # what the backend served for this epoch's rollouts
    hit_rate: float
    cache_hits: int
    spec_hits: int
    tool_calls: int
    peak_memory_bytes: int
    memory_byte_seconds: float
    loss: float
    kl: float
    clip_fraction: float
    errors: int
    tokens_trained: int  # generated tokens in the loss
    sequences: int
    logprob_drift: float | None  # mean |backend log-prob - learner log-prob| per generated token
    trajectory_digest: str
    params_digest: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
