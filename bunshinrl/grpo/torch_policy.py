"""TorchPolicy: a tiny decoder-only transformer that emits tool calls as text.

The model reads the prompt's words, then for each step the action it took and a two-token
digest of what it observed (a hashed bucket of the observation text and an ok/error flag), and
predicts the next action over a constrained vocabulary: the candidate action texts of the task
(complete tool calls such as `write_file{"content":"alpha\\n","path":"/root/out/a.txt"}`, and
FINAL). Constrained decoding is what vLLM's guided_choice does for a large model; here it keeps
the model small enough to train from scratch on a CPU in seconds.

Sampling is seeded per decision (see rollout.sample_seed) and always runs on a batch of one, so
the same weights and context give bit-identical choices whatever the engine's scheduling.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# One intra-op thread unless the process chose otherwise, set before torch starts its OpenMP pool
# (as bunshinrl._blas does for OpenBLAS): rollouts fork workspaces from many threads at once, and
# on a small host an OpenMP pool spin-waiting after every op takes the cores from the workspaces.
# This model is tiny: one thread decides in ~2 ms, two threads took ~60 ms under rollout load.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F
from torch import nn

from ..policy import Action, SampleContext, Step
from .actions import parse_action
from .rollout import Episode, sample_seed
from .tasks import VerifiableTask

SPECIAL = ("<pad>", "<bos>", "<sep>", "<unk>", "<ok>", "<err>")
PAD, BOS, SEP, UNK, OK, ERR = range(len(SPECIAL))
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class PolicyConfig:
    actions: tuple[str, ...]  # the action vocabulary: every candidate action text of every task
    words: tuple[str, ...]  # the prompt vocabulary
    task_actions: tuple[tuple[str, tuple[str, ...]], ...]  # (task id, its candidate actions)
    task_prompts: tuple[tuple[str, str], ...]  # (task id, prompt): how a server finds the task
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 64
    obs_buckets: int = 64
    max_prompt_words: int = 32

    @classmethod
    def for_tasks(cls, tasks: Sequence[VerifiableTask], **dims: Any) -> PolicyConfig:
        actions = sorted({a for t in tasks for a in t.actions})
        words = sorted({w for t in tasks for w in prompt_words(t.prompt, 10**6)})
        return cls(tuple(actions), tuple(words), tuple((t.id, tuple(t.actions)) for t in tasks),
                   tuple((t.id, t.prompt) for t in tasks), **dims)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PolicyConfig:
        d = dict(d)
        d["actions"] = tuple(d["actions"])
        d["words"] = tuple(d["words"])
        d["task_actions"] = tuple((k, tuple(v)) for k, v in d["task_actions"])
        d["task_prompts"] = tuple((k, v) for k, v in d["task_prompts"])
        return cls(**d)


def prompt_words(prompt: str, limit: int) -> list[str]:
    return _WORD.findall(prompt.lower())[:limit]


def observation_tokens(observation: str, buckets: int) -> tuple[int, bool]:
    """(bucket, error flag): enough for the policy to tell outcomes apart, stable across runs."""
    h = int.from_bytes(hashlib.sha256(observation.encode()).digest()[:4], "little") % buckets
    err = "[exit " in observation or "[error]" in observation or "FAIL" in observation
    return h, err


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        # Causal attention only: sequences are right-padded, so no real position ever attends to
        # padding and a batch needs no padding mask.
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class TorchPolicy(nn.Module):
    """A bunshinrl Policy whose action log-probabilities are differentiable (the learner)."""

    def __init__(self, config: PolicyConfig, *, seed: int = 0, temperature: float = 1.0) -> None:
        super().__init__()
        self.config = config
        self.seed = seed
        self.temperature = temperature
        self.action_index = {a: i for i, a in enumerate(config.actions)}
        self.word_index = {w: i for i, w in enumerate(config.words)}
        self.task_actions = {k: v for k, v in config.task_actions}
        self.prompt_task = {p: k for k, p in config.task_prompts}
        self._word0 = len(SPECIAL)
        self._obs0 = self._word0 + len(config.words)
        self._act0 = self._obs0 + config.obs_buckets
        vocab = self._act0 + len(config.actions)
        d = config.d_model
        # Initialised from `seed` without touching the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(config.max_len, d)
            self.blocks = nn.ModuleList(_Block(d, config.n_heads) for _ in range(config.n_layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, len(config.actions))
            # A near-zero head starts the policy close to uniform over each task's actions, so
            # epoch 0 explores like the random baseline instead of committing by chance.
            nn.init.normal_(self.head.weight, std=0.01)
            nn.init.zeros_(self.head.bias)
        self._masks: dict[tuple[str, ...], torch.Tensor] = {}
        self._behaviour: dict[tuple[int, str, int, int], float] = {}
        self._lock = threading.Lock()
        self.eval()

    @classmethod
    def for_tasks(cls, tasks: Sequence[VerifiableTask], *, seed: int = 0, temperature: float = 1.0,
                  **dims: Any) -> TorchPolicy:
        return cls(PolicyConfig.for_tasks(tasks, **dims), seed=seed, temperature=temperature)

    # ---- encoding ----

    def encode(self, prompt: str, actions: Sequence[str], observations: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of a context, and for each action the position whose output predicts it."""
        cfg = self.config
        ids = [BOS] + [self._word0 + self.word_index[w] if w in self.word_index else UNK
                       for w in prompt_words(prompt, cfg.max_prompt_words)] + [SEP]
        reads = []
        for i, a in enumerate(actions):
            reads.append(len(ids) - 1)
            j = self.action_index.get(a)
            ids.append(self._act0 + j if j is not None else UNK)
            if i < len(observations):
                bucket, err = observation_tokens(observations[i], cfg.obs_buckets)
                ids += [self._obs0 + bucket, ERR if err else OK]
        if len(ids) > cfg.max_len:
            raise ValueError(f"context of {len(ids)} tokens exceeds max_len={cfg.max_len}")
        return ids, reads

    def mask(self, allowed: Sequence[str]) -> torch.Tensor:
        """Additive logit mask: 0 for allowed actions, -inf elsewhere."""
        key = tuple(allowed)
        m = self._masks.get(key)
        if m is None:
            m = torch.full((len(self.config.actions),), -math.inf)
            idx = [self.action_index[a] for a in allowed if a in self.action_index]
            if not idx:
                raise ValueError("none of the allowed actions is in this policy's vocabulary")
            m[idx] = 0.0
            self._masks[key] = m
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[batch, length] token ids -> [batch, length, actions] logits."""
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))

    # ---- sampling (rollouts) ----

    def allowed_for(self, task_id: str | None = None, prompt: str | None = None) -> tuple[str, ...]:
        if task_id is None and prompt is not None:
            task_id = self.prompt_task.get(prompt)
        if task_id is None or task_id not in self.task_actions:
            return self.config.actions
        return self.task_actions[task_id]

    @torch.no_grad()
    def distribution(self, prompt: str, steps: Sequence[tuple[str, str]], allowed: Sequence[str],
                     temperature: float | None = None) -> torch.Tensor:
        """Probabilities over the action vocabulary for the next action."""
        ids, _ = self.encode(prompt, [a for a, _ in steps] + ["<next>"], [o for _, o in steps])
        ids = ids[:-1]  # the placeholder's token: only its read position was wanted
        t = self.temperature if temperature is None else temperature
        if t <= 0:
            raise ValueError("temperature must be > 0 (greedy decoding would not be a sampling policy)")
        logits = self.forward(torch.tensor([ids]))[0, -1] / t
        return torch.softmax(logits + self.mask(allowed), dim=-1)

    def sample(self, prompt: str, steps: Sequence[tuple[str, str]], allowed: Sequence[str],
               seed: int | None, temperature: float | None = None) -> tuple[str, float]:
        """(action text, its log-probability) drawn with `seed` (None: from fresh entropy)."""
        probs = self.distribution(prompt, steps, allowed, temperature)
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        j = int(torch.multinomial(probs, 1, generator=gen))
        return self.config.actions[j], float(torch.log(probs[j]))

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        steps = [(s.call.key, s.observation) for s in history]
        seed = sample_seed(self.seed, ctx.epoch, ctx.task_id, ctx.sample, len(history))
        text, logp = self.sample(ctx.prompt, steps, self.allowed_for(ctx.task_id, ctx.prompt), seed)
        with self._lock:
            self._behaviour[(ctx.epoch, ctx.task_id, ctx.sample, len(history))] = logp
        return parse_action(text)

    def behaviour_logprobs(self, epoch: int) -> dict[tuple[str, int, int], float]:
        """(task, sample, step) -> log-probability of each action sampled in `epoch` (taken out)."""
        with self._lock:
            keys = [k for k in self._behaviour if k[0] == epoch]
            return {k[1:]: self._behaviour.pop(k) for k in keys}

    # ---- training ----

    def logprobs(self, episodes: Sequence[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
        """Differentiable log-probabilities of every action of every episode, flattened, and the
        episode index of each (for per-sequence averaging)."""
        seqs, reads = [], []
        for e in episodes:
            ids, pos = self.encode(e.prompt, e.actions, e.observations)
            seqs.append(ids)
            reads.append(pos)
        width = max(len(s) for s in seqs)
        batch = torch.full((len(seqs), width), PAD, dtype=torch.long)
        for i, s in enumerate(seqs):
            batch[i, : len(s)] = torch.tensor(s)
        logits = self.forward(batch)
        rows, cols, targets, masks, owner = [], [], [], [], []
        for i, (e, pos) in enumerate(zip(episodes, reads, strict=True)):
            m = self.mask(self.allowed_for(e.task_id, e.prompt))
            for p, a in zip(pos, e.actions, strict=True):
                rows.append(i)
                cols.append(p)
                targets.append(self.action_index[a])
                masks.append(m)
                owner.append(i)
        picked = logits[torch.tensor(rows), torch.tensor(cols)] / self.temperature + torch.stack(masks)
        logp = torch.log_softmax(picked, dim=-1).gather(1, torch.tensor(targets)[:, None])[:, 0]
        return logp, torch.tensor(owner)

    def parameters_digest(self) -> str:
        """A hash of the weights: equal digests mean bit-identical models."""
        h = hashlib.sha256()
        for k, v in sorted(self.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    def snapshot(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "seed": self.seed, "temperature": self.temperature,
                "state": self.state_dict()}

    @classmethod
    def from_snapshot(cls, snap: Mapping[str, Any]) -> TorchPolicy:
        p = cls(PolicyConfig.from_dict(snap["config"]), seed=snap["seed"], temperature=snap["temperature"])
        p.load_state_dict(snap["state"])
        return p


def task_map(tasks: Iterable[VerifiableTask]) -> dict[str, VerifiableTask]:
    return {t.id: t for t in tasks}
