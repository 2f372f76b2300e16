"""The measured gate: speculate a predicted call when what it is expected to save on the
sample's path outweighs what it is expected to cost there, both from measurements.

A speculated call runs while the policy reasons, so a right guess removes at most the reasoning
step's length of the call from the path: min(call, reasoning). A wrong guess puts the rollback
on the path (the pre-speculation state forked back, measured as the task's spec_miss spans,
or a snapshot's time until one is), and a snapshot that outlasts the reasoning step is waited
for whatever the guess. The probability is the selector's, scaled by how its launched guesses
have fared (hits over the probabilities it gave them). A call never measured is not speculated:
nothing says it would save anything. This replaces a fixed "slow call" threshold, which let a
0.6 s call through beside a 1 s fork and kept a 0.9 s call out beside a 0.1 s one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..calls.signature import ToolCall


@dataclass(frozen=True)
class GateCosts:
    """What the path pays around a speculation, measured by the core (None: not measured yet).
    reasoning: the next step's predicted seconds; snapshot: a snapshot of the task's workspace;
    miss: the task's mean spec_miss span (a wrong guess rolled back on the path)."""

    reasoning: float | None = None
    snapshot: float | None = None
    miss: float | None = None


class MeasuredGate:
    """prior: pseudo-outcomes at the selector's own word, so that a few early misses do not
    silence it and a few hits do not make it certain."""

    def __init__(self, prior: float = 4.0) -> None:
        self.prior = prior
        self._lock = threading.Lock()
        self._hits = 0.0
        self._predicted = 0.0
        self.stats = {"admitted": 0, "declined_unmeasured": 0, "declined_cost": 0}
        # The last decisions on a chain's first call, what each weighed (a run's profile).
        self.decisions: deque[dict[str, float | str | bool]] = deque(maxlen=4096)

    def record_outcome(self, probability: float, hit: bool) -> None:
        """A launched guess resolved: it had `probability` and was right (hit) or not."""
        with self._lock:
            self._predicted += probability
            self._hits += 1.0 if hit else 0.0

    def calibration(self) -> float:
        """Realised hits over predicted ones, shrunk towards 1 by the prior."""
        with self._lock:
            return (self._hits + self.prior) / (self._predicted + self.prior)

    def calibrated(self, probability: float) -> float:
        return min(1.0, max(0.0, probability * self.calibration()))

    def expected(self, probability: float, call_seconds: float, costs: GateCosts) -> tuple[float, float]:
        """(saving, cost) on the path, in seconds, of speculating one call."""
        p = self.calibrated(probability)
        reasoning = costs.reasoning if costs.reasoning is not None else call_seconds
        saving = p * min(call_seconds, max(0.0, reasoning))
        miss = costs.miss if costs.miss is not None else (costs.snapshot or 0.0)
        waited = max(0.0, (costs.snapshot or 0.0) - reasoning) if costs.reasoning is not None else 0.0
        return saving, (1.0 - p) * miss + waited

    def admit(self, chain: Sequence[tuple[ToolCall, float]], call_seconds: Callable[[ToolCall], float | None],
              costs: GateCosts) -> list[ToolCall]:
        """The longest prefix of `chain` (calls with the selector's conditional probabilities)
        worth running: its first call when its expected saving exceeds its expected cost, and each
        next call when the chance of reaching it, times its time, exceeds the checkpoint taken
        before it (a snapshot)."""
        out: list[ToolCall] = []
        reach = 1.0
        for i, (call, p) in enumerate(chain):
            seconds = call_seconds(call)
            if seconds is None:
                if i == 0:
                    self._count("declined_unmeasured")
                break
            reach *= self.calibrated(p)
            if i == 0:
                saving, cost = self.expected(p, seconds, costs)
                self._note(call, p, seconds, costs, saving, cost)
                if saving <= cost:
                    self._count("declined_cost")
                    break
            elif reach * seconds <= (costs.snapshot or 0.0):
                break
            out.append(call)
        if out:
            self._count("admitted")
        return out

    def _note(self, call: ToolCall, p: float, seconds: float, costs: GateCosts, saving: float, cost: float) -> None:
        calibrated = self.calibrated(p)  # before the lock: it takes it too
        with self._lock:
            self.decisions.append({"tool": call.name, "p": round(p, 3), "p_calibrated": round(calibrated, 3),
                                   "call": round(seconds, 3), "reasoning": _r(costs.reasoning),
                                   "snapshot": _r(costs.snapshot), "miss": _r(costs.miss), "saving": round(saving, 3),
                                   "cost": round(cost, 3), "admitted": saving > cost})

    def take_decisions(self) -> list[dict[str, float | str | bool]]:
        """The decisions noted since the last take."""
        with self._lock:
            out = list(self.decisions)
            self.decisions.clear()
        return out

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


__all__ = ["GateCosts", "MeasuredGate"]
