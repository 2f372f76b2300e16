"""GRPOTrainer: synchronous GRPO on bunshinrl rollouts (paper section 5: "a simple synchronous
GRPO loop").

One step = one epoch: roll out every task `group_size` times with RolloutEngine (Base, Spec or
Full), score each rollout by its final workspace state, turn rewards into group-relative
advantages, and take a few clipped policy-gradient steps (optionally with a KL penalty to the
initial policy). Nothing in the update depends on how the rollout was scheduled: episodes are
ordered by (task, sample) and every sampling decision is seeded by what it is, so the three
engine configurations train bit-identical models (paper Fig. 11).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..policy import Policy
from ..timeline import EpochResult
from .rollout import (
    Config,
    EngineBundle,
    Episode,
    HarnessPolicy,
    episodes,
    make_engine,
    trajectory_digest,
)
from .tasks import VerifiableTask
from .torch_policy import TorchPolicy

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 8
    lr: float = 3e-3
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # beta; 0 trains without a reference policy
    updates_per_epoch: int = 4  # optimisation passes over each epoch's batch (GRPO's mu)
    max_grad_norm: float = 1.0
    adv_eps: float = 1e-4
    seed: int = 0


@dataclass
class StepMetrics:
    epoch: int
    reward_mean: float
    reward_std: float
    reward_by_task: dict[str, float]
    reward_by_family: dict[str, float]
    rollout_seconds: float  # the engine's epoch: first setup to last rollout finished
    update_seconds: float
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
    logprob_drift: float | None  # |rollout backend's log-prob - learner's| per action, mean
    trajectory_digest: str
    params_digest: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_advantages(eps: Sequence[Episode], eps_: float = 1e-4) -> list[float]:
    """GRPO's advantage: each reward standardised within its group (same task, same epoch).
    A group whose samples all scored the same carries no signal and gets 0."""
    groups: dict[str, list[float]] = defaultdict(list)
    for e in eps:
        groups[e.task_id].append(e.reward)
    stats = {k: (statistics.fmean(v), statistics.pstdev(v)) for k, v in groups.items()}
    out = []
    for e in eps:
        mean, std = stats[e.task_id]
        out.append(0.0 if std == 0 else (e.reward - mean) / (std + eps_))
    return out


def grpo_loss(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, owner: torch.Tensor, n_seq: int,
              clip_eps: float, ref: torch.Tensor | None = None,
              kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate per action, plus beta * KL(pi || ref) with the k3 estimator,
    averaged within each sequence and then over sequences (GRPO's normalisation)."""
    ratio = torch.exp(new - old)
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_action = -surr
    kl = torch.zeros_like(new)
    if ref is not None and kl_coef > 0:
        d = ref - new
        kl = torch.exp(d) - d - 1
        per_action = per_action + kl_coef * kl
    counts = torch.zeros(n_seq).index_add_(0, owner, torch.ones_like(new))
    per_seq = torch.zeros(n_seq).index_add_(0, owner, per_action) / counts.clamp(min=1)
    loss = per_seq[counts > 0].mean()
    clipped = ((ratio - 1).abs() > clip_eps).float().mean()
    return loss, {"kl": float(kl.detach().mean()), "clip_fraction": float(clipped)}


class GRPOTrainer:
    """Trains `policy` (the learner) on `tasks`.

    rollout_policy: what samples the rollouts when it is not the learner itself, e.g. an
    OpenAIPolicy talking to a server that serves the learner's weights; after each update
    `on_update(policy)` is called so such a server can load them (a no-op when the server
    serves this very object). Its recorded log-probs are compared with the learner's
    (logprob_drift), the inference/training mismatch every vLLM-based trainer has to watch.
    """

    def __init__(self, policy: TorchPolicy, tasks: Sequence[VerifiableTask], *, config: GRPOConfig | None = None,
                 engine: Config = "Base", rollout_policy: Policy | None = None,
                 engine_factory: Callable[[Policy], EngineBundle] | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None, store_dir: str | os.PathLike[str] | None = None,
                 think_seconds: float = 0.0, on_update: Callable[[TorchPolicy], None] | None = None,
                 keep_episodes: bool = False, torch_threads: int | None = 1, **engine_kwargs: Any) -> None:
        if torch_threads is not None:
            # See torch_policy: a tiny model gains nothing from intra-op threads, and their
            # spinning takes the cores from the workspaces the rollout runs in.
            torch.set_num_threads(torch_threads)
        self.config = config or GRPOConfig()
        self.policy = policy
        self.tasks = list(tasks)
        self.task_map = {t.id: t for t in self.tasks}
        self.rollout_policy = rollout_policy if rollout_policy is not None else policy
        self.harness = HarnessPolicy(self.rollout_policy, self.task_map, think_seconds)
        if engine_factory is not None:
            self.bundle = engine_factory(self.harness)
        else:
            store = Path(store_dir) if store_dir is not None else None
            self.bundle = make_engine(engine, self.harness, self.tasks, store=store, **engine_kwargs)
        need = max(t.budget for t in self.tasks) + 2
        if self.bundle.engine.max_steps < need:
            raise ValueError(f"the engine's max_steps={self.bundle.engine.max_steps} cannot fit a budget of "
                             f"{need - 2} calls plus the reward call and the final answer ({need})")
        self.engine_name = engine
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.on_update = on_update
        self.keep_episodes = keep_episodes
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.config.lr)
        self.reference: TorchPolicy | None = None
        if self.config.kl_coef > 0:
            # The policy as it starts (deepcopy cannot copy its lock, a snapshot can).
            self.reference = TorchPolicy.from_snapshot(self.policy.snapshot()).requires_grad_(False)
        self.epoch = 0
        self.history: list[StepMetrics] = []
        self.episodes: list[list[Episode]] = []

    # ---- the loop ----

    async def step(self) -> StepMetrics:
        """Roll out one epoch, then update the policy on it."""
        epoch = self.epoch
        t0 = time.monotonic()
        result = await self.bundle.engine.run_epoch([t.task() for t in self.tasks], self.config.group_size, epoch)
        rollout_wall = time.monotonic() - t0
        eps = episodes(result, self.task_map)
        behaviour = self._behaviour(epoch)
        t1 = time.monotonic()
        stats = self._update(eps, behaviour)
        update_seconds = time.monotonic() - t1
        if self.bundle.engine.speculator is not None:
            # The selector learns from every trajectory so far; it only ever changes what is
            # speculated, never what is sampled.
            self.bundle.engine.fit_selector(held_out_epochs=())
        if self.on_update is not None:
            self.on_update(self.policy)
        m = self._metrics(epoch, result, eps, stats, update_seconds)
        m.extra["rollout_wall_seconds"] = rollout_wall
        m.extra["speculation"] = dict(result.speculation) if result.speculation else None
        m.extra["cache"] = dict(result.cache) if result.cache else None
        # Failed rollouts first: those are what StepMetrics.errors counts.
        noted = sorted(eps, key=lambda e: e.ok)
        m.extra["sample_errors"] = [f"{e.task_id}/{e.sample}{'' if e.ok else ' (failed)'}: {err}"
                                    for e in noted for err in e.errors][:20]
        m.extra["engine_notes"] = sum(bool(e.errors) and e.ok for e in eps)
        self.history.append(m)
        if self.keep_episodes:
            self.episodes.append(eps)
        self.epoch += 1
        if self.checkpoint_dir is not None:
            self.save(self.checkpoint_dir / CHECKPOINT)
        return m

    async def train(self, epochs: int, log: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """Train until `epochs` epochs are done in total (a resumed trainer continues)."""
        while self.epoch < epochs:
            m = await self.step()
            if log is not None:
                log(m)
        return self.history

    async def aclose(self) -> None:
        await self.bundle.aclose()

    def run(self, epochs: int, log: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """train() and close the engine, from synchronous code."""

        async def main() -> list[StepMetrics]:
            try:
                return await self.train(epochs, log)
            finally:
                await self.aclose()

        return asyncio.run(main())

    # ---- the update ----

    def _behaviour(self, epoch: int) -> Mapping[tuple[str, int, int], float]:
        get = getattr(self.rollout_policy, "behaviour_logprobs", None)
        return get(epoch) if callable(get) else {}

    def _update(self, eps: Sequence[Episode], behaviour: Mapping[tuple[str, int, int], float]) -> dict[str, Any]:
        cfg = self.config
        # Errored rollouts (a tool that crashed the harness, a lost workspace) are reported but
        # not learned from: their reward says nothing about the actions.
        train = [e for e in eps if e.ok and e.actions]
        adv_seq = group_advantages(train, cfg.adv_eps)
        out: dict[str, Any] = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "logprob_drift": None}
        if not train:
            return out
        self.policy.train()
        with torch.no_grad():
            old, owner = self.policy.logprobs(train)
            ref = self.reference.logprobs(train)[0] if self.reference is not None else None
        if behaviour:
            diffs = [abs(behaviour[(e.task_id, e.sample, i)] - float(old[j]))
                     for j, (e, i) in enumerate((e, i) for e in train for i in range(len(e.actions)))
                     if (e.task_id, e.sample, i) in behaviour]
            out["logprob_drift"] = statistics.fmean(diffs) if diffs else None
        adv = torch.tensor(adv_seq)[owner]
        if not any(adv_seq) and ref is None:
            self.policy.eval()
            return out  # no group had any spread: nothing to learn this epoch
        for _ in range(cfg.updates_per_epoch):
            new, _ = self.policy.logprobs(train)
            loss, info = grpo_loss(new, old, adv, owner, len(train), cfg.clip_eps, ref, cfg.kl_coef)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            out.update(loss=float(loss.detach()), **info)
        self.policy.eval()
        return out

    def _metrics(self, epoch: int, r: EpochResult, eps: Sequence[Episode], stats: Mapping[str, Any],
                 update_seconds: float) -> StepMetrics:
        rewards = [e.reward for e in eps]
        by_task: dict[str, list[float]] = defaultdict(list)
        by_family: dict[str, list[float]] = defaultdict(list)
        for e in eps:
            by_task[e.task_id].append(e.reward)
            by_family[self.task_map[e.task_id].family].append(e.reward)
        return StepMetrics(
            epoch=epoch, reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
            reward_by_task={k: statistics.fmean(v) for k, v in sorted(by_task.items())},
            reward_by_family={k: statistics.fmean(v) for k, v in sorted(by_family.items())},
            rollout_seconds=r.seconds, update_seconds=update_seconds, hit_rate=r.hit_rate,
            cache_hits=r.cache_hits, spec_hits=r.spec_hits, tool_calls=r.tool_calls,
            peak_memory_bytes=r.peak_memory_bytes, memory_byte_seconds=r.memory_byte_seconds,
            loss=stats["loss"], kl=stats["kl"], clip_fraction=stats["clip_fraction"],
            errors=sum(not e.ok for e in eps), logprob_drift=stats["logprob_drift"],
            trajectory_digest=trajectory_digest(eps), params_digest=self.policy.parameters_digest(),
        )

    # ---- checkpoints ----

    def state(self) -> dict[str, Any]:
        return {
            "format": 1,
            "epoch": self.epoch,
            "config": asdict(self.config),
            "policy": self.policy.snapshot(),
            "reference": self.reference.state_dict() if self.reference is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "history": [m.to_dict() for m in self.history],
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint atomically (a crash mid-write leaves the previous one intact)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, path)
        return path

    def load(self, path: str | os.PathLike[str]) -> None:
        """Continue from a checkpoint: weights, optimizer moments, reference policy, epoch.

        The prefix cache and the speculator's selector are not restored: they only change how
        fast rollouts run, never what they sample.
        """
        state = torch.load(Path(path), weights_only=True)
        if state.get("format") != 1:
            raise ValueError(f"{path}: unknown checkpoint format {state.get('format')!r}")
        saved = GRPOConfig(**state["config"])
        if saved != self.config:
            raise ValueError(f"{path} was trained with {saved}, this trainer has {self.config}")
        self.policy.load_state_dict(state["policy"]["state"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None and state["reference"] is not None:
            self.reference.load_state_dict(state["reference"])
        self.epoch = int(state["epoch"])
        self.history = [StepMetrics(**m) for m in state["history"]]

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], tasks: Sequence[VerifiableTask],
                        **kwargs: Any) -> GRPOTrainer:
        """A trainer whose policy is rebuilt from the checkpoint's own configuration."""
        state = torch.load(Path(path), weights_only=True)
        policy = TorchPolicy.from_snapshot(state["policy"])
        trainer = cls(policy, tasks, config=GRPOConfig(**state["config"]), **kwargs)
        trainer.load(path)
        return trainer
