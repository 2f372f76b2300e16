"""GRPOTrainer: synchronous, token-level GRPO of a Hugging Face causal LM on bunshinrl rollouts
(paper section 5: "a simple synchronous GRPO loop").

One step = one epoch:
1. check that the rollout backend serves the learner's current weight version;
2. roll out every task `group_size` times with RolloutEngine (Base, Spec or Full); the reward is
   read from each rollout's final workspace state;
3. rebuild each episode's token sequences from the backend's recorded turns (policies/turns.py): the loss
   mask is 1 on the tokens the policy generated only;
4. group-relative advantages per episode; the learner recomputes every generated token's
   log-prob (their distance to the backend's is `logprob_drift`); `updates_per_epoch` clipped
   policy-gradient steps (objective.py), with k3 KL to the frozen initial model if kl_coef > 0;
5. push the new weights to the backend (sync.py) and record how long that took.
Nothing in the update depends on scheduling: episodes are ordered by (task, sample) and every
decision is seeded by what it is, so the three engine configurations train bit-identical models
(paper Fig. 11) wherever the backend samples deterministically.
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..calls.policy import Policy
from ..calls.task import Task
from ..policies.hf_policy import HFPolicy
from ..policies.turns import Turn, TurnKey
from ..rollout.audit import TrajectoryAuditor, cache_roots
from ..rollout.timeline import EpochResult
from .batch import Batch, batch_tensors, build_batch, micro_batches
from .config import CHECKPOINT, GRPOConfig, StepMetrics
from .episodes import Config, EngineBundle, Episode, episodes, make_engine, trajectory_digest
from .objective import grpo_loss
from .sync import InProcessSync, WeightSync, WeightSyncError


class GRPOTrainer:
    """Trains `policy` (the learner) on `tasks`.

    rollout_policy: what samples the rollouts when it is not the learner itself (an
    OpenAIPolicy on a vLLM server); weight_sync makes it serve the learner's weights
    (VLLMServerSync) and is checked before every rollout. By default the learner rolls out
    itself, in process. learn=False rolls out without updating (the untrained baseline).
    audit: "all", "sample" (one sample per task) or "off": after every epoch the trajectory
    audit re-executes those samples' histories from a fresh fork of the root and compares every
    observation and the reward (StepMetrics.extra["audit"]; bunshinrl.rollout.audit).
    """

    def __init__(self, policy: HFPolicy, tasks: Sequence[Task], *, config: GRPOConfig | None = None,
                 engine: Config = "Base", rollout_policy: Policy | None = None,
                 weight_sync: WeightSync | None = None, engine_factory: Callable[[Policy], EngineBundle] | None = None,
                 checkpoint_dir: str | os.PathLike[str] | None = None, store_dir: str | os.PathLike[str] | None = None,
                 learn: bool = True, keep_episodes: bool = False, audit: str = "off",
                 torch_threads: int | None = 1, update_threads: int | None = None, **engine_kwargs: Any) -> None:
        if torch_threads is not None:
            # Intra-op threads spinning next to the workspaces take the cores the rollout runs on.
            torch.set_num_threads(torch_threads)
        # The update runs while no rollout does (the loop is synchronous): all cores are free.
        self.update_threads = update_threads or os.cpu_count() or 1
        self.config = config or GRPOConfig()
        self.policy = policy
        self.tasks = list(tasks)
        self.task_map = {t.id: t for t in self.tasks}
        self.rollout_policy = rollout_policy if rollout_policy is not None else policy
        if weight_sync is None:
            if self.rollout_policy is not policy:
                raise ValueError("a separate rollout_policy needs a weight_sync that puts the learner's weights "
                                 "into it (VLLMServerSync for a vLLM server)")
            weight_sync = InProcessSync(policy)
        self.weight_sync = weight_sync
        if engine_factory is not None:
            self.bundle = engine_factory(self.rollout_policy)
        else:
            store = Path(store_dir) if store_dir is not None else None
            self.bundle = make_engine(engine, self.rollout_policy, self.tasks, store=store, **engine_kwargs)
        need = max(t.budget for t in self.tasks) + 1
        if self.bundle.engine.max_steps < need:
            raise ValueError(f"the engine's max_steps={self.bundle.engine.max_steps} cannot fit a budget of "
                             f"{need - 1} calls plus the final answer ({need})")
        missing = [t.id for t in self.tasks if t.verify is None]
        if missing:
            raise ValueError(f"tasks {missing} have no verifier: GRPO needs a reward")
        self.engine_name = engine
        # The trajectory audit (rollout/audit.py): each epoch's histories (all, or one sample
        # per task) re-executed from a fresh fork of the root, every observation and the reward
        # compared; its summary is the step's extra["audit"].
        self.auditor = TrajectoryAuditor(self.tasks, mode=audit, root=cache_roots(self.bundle.engine.core),
                                         seed=self.config.seed) if audit != "off" else None
        self.learn = learn
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.keep_episodes = keep_episodes
        self.optimizer = torch.optim.AdamW(list(self.policy.parameters()), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay)
        self.reference: Any = None
        if self.config.kl_coef > 0:
            self.reference = copy.deepcopy(self.policy.model).requires_grad_(False).eval()
        self.epoch = 0
        self.version = 0
        self._synced = False
        self.history: list[StepMetrics] = []
        self.episodes: list[list[Episode]] = []
        self.weight_syncs: list[dict[str, Any]] = []

    # ---- the loop ----

    async def sync(self) -> float:
        """Push the learner's weights as the current version; seconds it took."""
        t = time.monotonic()
        await self.weight_sync.push(self.policy, str(self.version))
        self._synced = True
        return time.monotonic() - t

    async def _check_served(self) -> str:
        served = await self.weight_sync.served_version()
        if served != str(self.version):
            raise WeightSyncError(f"the rollout backend serves weight version {served!r}, the learner is at "
                                  f"{self.version}: refusing to roll out from stale weights")
        return served

    async def step(self) -> StepMetrics:
        """Roll out one epoch, update the policy on it, sync the new weights."""
        epoch = self.epoch
        if not self._synced:
            await self.sync()  # the backend starts from the learner's weights, whatever it loaded
        served = await self._check_served()
        t0 = time.monotonic()
        result = await self.bundle.engine.run_epoch(self.tasks, self.config.group_size, epoch)
        rollout_wall = time.monotonic() - t0
        eps = episodes(result, self.task_map)
        turns = self._take_turns(epoch)
        t1 = time.monotonic()
        if self.learn:
            threads = torch.get_num_threads()
            torch.set_num_threads(self.update_threads)
            try:
                stats = self._update(eps, turns)
            finally:
                torch.set_num_threads(threads)
        else:
            stats = self._measure(eps, turns)
        update_seconds = time.monotonic() - t1
        sync_seconds = 0.0
        if self.learn:
            self.version += 1
            sync_seconds = await self.sync()
            self.weight_syncs.append({"epoch": epoch, "version": str(self.version), "seconds": sync_seconds,
                                      "served_version": await self._check_served()})
        if self.bundle.engine.speculator is not None:
            # The selector learns from every trajectory so far; it only ever changes what is
            # speculated, never what is sampled.
            self.bundle.engine.fit_selector(held_out_epochs=())
        m = self._metrics(epoch, result, eps, stats, update_seconds, sync_seconds, served)
        if self.auditor is not None:
            m.extra["audit"] = (await self.auditor.audit(result)).summary()
        m.extra["rollout_wall_seconds"] = rollout_wall
        m.extra["teardown_seconds"] = result.teardown_seconds
        # The cache's persistence ran beside the update (the gap between epochs): its seconds, and
        # whether it was done when the update and sync were.
        m.extra["persist_done_by_update_end"] = not self.bundle.engine.persisting
        m.extra["persist_seconds"] = await self.bundle.engine.persistence()
        m.extra["speculation"] = dict(result.speculation) if result.speculation else None
        m.extra["cache"] = dict(result.cache) if result.cache else None
        noted = sorted(eps, key=lambda e: e.ok)  # failed rollouts first: those are what errors counts
        m.extra["sample_errors"] = [f"{e.task_id}/{e.sample}{'' if e.ok else ' (failed)'}: {err}"
                                    for e in noted for err in e.errors][:20]
        m.extra["engine_notes"] = sum(bool(e.errors) and e.ok for e in eps)
        self.history.append(m)
        if self.keep_episodes:
            self.episodes.append(eps)
        self.epoch += 1
        if self.checkpoint_dir is not None and self.learn:
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
        if self.auditor is not None:
            await self.auditor.close()
        await self.bundle.aclose()
        close = getattr(self.rollout_policy, "aclose", None)
        if callable(close):
            await close()

    def run(self, epochs: int, log: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
        """train() and close the engine, from synchronous code."""

        async def main() -> list[StepMetrics]:
            try:
                return await self.train(epochs, log)
            finally:
                await self.aclose()

        return asyncio.run(main())

    # ---- batches ----

    def _take_turns(self, epoch: int) -> Mapping[TurnKey, Turn]:
        take = getattr(self.rollout_policy, "take_turns", None)
        if not callable(take):
            raise TypeError(f"{type(self.rollout_policy).__name__} records no turns (prompt and reply token ids); "
                            "token-level training needs them")
        return take(epoch)

    def batch(self, eps: Sequence[Episode], turns: Mapping[TurnKey, Turn]) -> Batch:
        """Training rows of the verified episodes that took at least one decision."""
        return build_batch(eps, turns, self.policy, self.config.adv_eps)


    def _logprobs(self, model: Any, t: Mapping[str, Any]) -> torch.Tensor:
        return self.policy.token_logprobs(t["ids"], t["attention"], t["constrained"], model=model)

    # ---- the update ----

    def _measure(self, eps: Sequence[Episode], turns: Mapping[TurnKey, Turn]) -> dict[str, Any]:
        """What an update would train on, without updating (the untrained baseline)."""
        b = self.batch(eps, turns)
        return {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "logprob_drift": None,
                "tokens": sum(r.n_generated for r in b.rows), "sequences": len(b.rows)}

    def _update(self, eps: Sequence[Episode], turns: Mapping[TurnKey, Turn]) -> dict[str, Any]:
        cfg = self.config
        b = self.batch(eps, turns)
        out: dict[str, Any] = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "logprob_drift": None, "tokens": 0,
                               "sequences": len(b.rows)}
        if not b.rows:
            return out
        groups = micro_batches(b, self.config.micro_batch_tokens)
        tensors = [batch_tensors(b, idx, self.policy) for idx in groups]
        total_tokens = float(sum(t["mask"].sum() for t in tensors))
        total_rows = float(sum(int((t["mask"].sum(-1) > 0).sum()) for t in tensors))
        # Old log-probs: the learner's, before any step (not the backend's, which are only compared).
        self.policy.model.eval()
        with torch.no_grad():
            for t in tensors:
                t["old"] = self._logprobs(self.policy.model, t)
                t["ref"] = self._logprobs(self.reference, t) if self.reference is not None else None
        drift = sum(float(((t["old"] - t["rollout"]).abs() * t["mask"]).sum()) for t in tensors)
        out.update(tokens=int(total_tokens), logprob_drift=drift / max(total_tokens, 1.0))
        if not any(b.advantages) and self.reference is None:
            return out  # no group had any spread: nothing to learn this epoch
        self.policy.model.train()
        for _ in range(cfg.updates_per_epoch):
            self.optimizer.zero_grad(set_to_none=True)
            loss_sum, clip, kl = 0.0, 0.0, 0.0
            for t in tensors:
                new = self._logprobs(self.policy.model, t)
                loss, info = grpo_loss(new, t["old"], t["adv"], t["mask"], clip_eps=cfg.clip_eps,
                                       clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip, ref_logprob=t["ref"],
                                       kl_coef=cfg.kl_coef, mode=cfg.loss_agg_mode, total_tokens=total_tokens,
                                       total_rows=total_rows)
                loss.backward()
                share = float(t["mask"].sum()) / total_tokens
                loss_sum += float(loss.detach())
                clip += info.clip_fraction * share
                kl += info.kl
            torch.nn.utils.clip_grad_norm_(list(self.policy.parameters()), cfg.max_grad_norm)
            self.optimizer.step()
            out.update(loss=loss_sum, clip_fraction=clip, kl=kl)
        self.policy.model.eval()
        return out

    def _metrics(self, epoch: int, r: EpochResult, eps: Sequence[Episode], stats: Mapping[str, Any],
                 update_seconds: float, sync_seconds: float, served: str) -> StepMetrics:
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
            rollout_seconds=r.seconds, update_seconds=update_seconds, sync_seconds=sync_seconds,
            weight_version=served, hit_rate=r.hit_rate, cache_hits=r.cache_hits, spec_hits=r.spec_hits,
            tool_calls=r.tool_calls, peak_memory_bytes=r.peak_memory_bytes, memory_byte_seconds=r.memory_byte_seconds,
            loss=stats["loss"], kl=stats["kl"], clip_fraction=stats["clip_fraction"],
            errors=sum(not e.ok for e in eps), tokens_trained=stats["tokens"] if self.learn else 0,
            sequences=stats["sequences"], logprob_drift=stats["logprob_drift"],
            trajectory_digest=trajectory_digest(eps), params_digest=self.policy.parameters_digest(),
        )

    # ---- checkpoints ----

    def state(self) -> dict[str, Any]:
        return {
            "format": 2,
            "epoch": self.epoch,
            "version": self.version,
            "config": asdict(self.config),
            "model": self.policy.model.state_dict(),
            "reference": self.reference.state_dict() if self.reference is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "history": [m.to_dict() for m in self.history],
            "weight_syncs": self.weight_syncs,
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
        """Continue from a checkpoint: weights, optimizer moments, reference model, epoch. The
        next step first pushes the restored weights to the rollout backend.

        The prefix cache and the speculator's selector are not restored: they only change how
        fast rollouts run, never what they sample.
        """
        state = torch.load(Path(path), weights_only=True)
        if state.get("format") != 2:
            raise ValueError(f"{path}: unknown checkpoint format {state.get('format')!r}")
        saved = GRPOConfig(**state["config"])
        if saved != self.config:
            raise ValueError(f"{path} was trained with {saved}, this trainer has {self.config}")
        self.policy.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None and state["reference"] is not None:
            self.reference.load_state_dict(state["reference"])
        self.epoch = int(state["epoch"])
        self.version = int(state["version"])
        self.history = [StepMetrics(**m) for m in state["history"]]
        self.weight_syncs = list(state["weight_syncs"])
        self._synced = False


__all__ = ["CHECKPOINT", "GRPOConfig", "GRPOTrainer", "StepMetrics"]
