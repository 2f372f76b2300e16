"""What a rollout backend records per decision, and how episodes become training sequences.

A Turn is one decision exactly as the rollout engine ran it: the prompt token ids (the chat
template's rendering of the task and history), the generated token ids, the engine's log-prob
of each, the choices the decoding was constrained to, and the weight version that produced it.
Training recomputes log-probs on these very ids, so tokenization never drifts between rollout
and learner.

An episode's turns are stitched into one sequence when each prompt extends the previous
prompt plus its reply (the usual case: the template appends the tool result and a new
assistant header); the loss mask is 1 exactly on generated tokens, so the task, tool outputs
and template scaffolding carry no gradient. Where a template re-renders earlier turns
differently (say it re-serialises a tool call), the sequence is split there instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

TurnKey = tuple[str, int, int]  # (task id, sample, step)


@dataclass(frozen=True)
class Turn:
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the rollout engine's log-prob of each response token
    choices: tuple[str, ...] | None = None  # the constraint decoding ran under, if any
    weight_version: str = ""
    finish_reason: str = ""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"{len(self.logprobs)} log-probs for {len(self.response_ids)} response tokens")


class TurnLog:
    """Turns by (epoch, task, sample, step), written by concurrent rollouts, taken by the trainer."""

    def __init__(self) -> None:
        self._turns: dict[tuple[int, str, int, int], Turn] = {}
        self._lock = threading.Lock()

    def record(self, epoch: int, task_id: str, sample: int, step: int, turn: Turn) -> None:
        with self._lock:
            self._turns[(epoch, task_id, sample, step)] = turn

    def take(self, epoch: int) -> dict[TurnKey, Turn]:
        """Every turn of `epoch`, removed from the log."""
        with self._lock:
            keys = [k for k in self._turns if k[0] == epoch]
            return {k[1:]: self._turns.pop(k) for k in keys}


@dataclass
class Segment:
    """A run of generated tokens inside a TokenSequence: where it starts, and its constraint."""

    start: int  # index in TokenSequence.ids of the first generated token
    length: int
    choices: tuple[str, ...] | None


@dataclass
class TokenSequence:
    """One training row: token ids, which of them the policy generated, and what the rollout
    engine said their log-probs were."""

    ids: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # 0/1 per token
    rollout_logprobs: list[float] = field(default_factory=list)  # per token (0 where not generated)
    segments: list[Segment] = field(default_factory=list)
    owner: int = 0  # index of the episode it belongs to

    def extend(self, ids: Sequence[int], generated: bool, logprobs: Sequence[float] | None = None,
               choices: tuple[str, ...] | None = None) -> None:
        if generated:
            self.segments.append(Segment(len(self.ids), len(ids), choices))
        self.ids.extend(ids)
        self.generated.extend([int(generated)] * len(ids))
        self.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def n_generated(self) -> int:
        return sum(self.generated)


def stitch(turns: Iterable[Turn], owner: int = 0) -> list[TokenSequence]:
    """An episode's turns (in order) as as few sequences as its chat template allows."""
    out: list[TokenSequence] = []
    cur: TokenSequence | None = None
    for t in turns:
        prompt = list(t.prompt_ids)
        if cur is not None and prompt[:len(cur.ids)] == cur.ids:
            cur.extend(prompt[len(cur.ids):], generated=False)
        else:
            cur = TokenSequence(owner=owner)
            out.append(cur)
            cur.extend(prompt, generated=False)
        cur.extend(t.response_ids, generated=True, logprobs=t.logprobs, choices=t.choices)
    return out


__all__ = ["Segment", "TokenSequence", "Turn", "TurnKey", "TurnLog", "stitch"]
