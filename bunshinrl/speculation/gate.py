"""The measured gate: speculate a predicted call when what it is expected to save on the
sample's path outweighs what it is expected to cost there, both from measurements.

A speculated call runs while the policy reasons, so a right guess removes at most the reasoning
step's length of the call from the path: min(call, reasoning). A chain is weighed whole: a fast
observation the agent makes first may lead to the slow action after it. A wrong guess puts the rollback
on the path (the pre-speculation state forked back, measured as the task's spec_miss spans,
or a snapshot's time until one is), and a snapshot that outlasts the reasoning step is waited
for whatever the guess. The probability is the selector's, scaled by how its launched guesses
have fared (hits over the probabilities it gave them). A call never measured is not speculated:
nothing says it would save anything. This replaces a fixed "slow call" threshold, which let a
0.6 s call through beside a 1 s fork and kept a 0.9 s call out beside a 0.1 s one.

A wrong guess also costs the host: a speculative test suite or PDF export holds a CPU slot
(bunshinrl.calls.cpu_slots) that another sample's real call may wait for, and on a full host it
does. Each call's measured seconds in a slot count, as far as the guess is wrong, at the share of
the slots busy when the chain is weighed (issue 38: on two cores a long-shot speculative test
suite made a straggler wait 49 s for it, then run it again).
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
    miss: the task's mean spec_miss span (a wrong guess rolled back on the path); slot_load: the
    share of the CPU slots in use or waited for now (None: no slots configured)."""

    reasoning: float | None = None
    snapshot: float | None = None
    miss: float | None = None
    slot_load: float | None = None


class MeasuredGate:
    """prior: pseudo-outcomes at the selector's own word, so that a few early misses do not
    silence it and a few hits do not make it certain. min_probability: the least likely guess
    weighed (the Speculator's own min_probability does not apply with a gate: a slow call is
    worth a long shot)."""

    def __init__(self, prior: float = 4.0, min_probability: float = 0.1) -> None:
        self.prior = prior
        # The selector's guesses below this are not weighed at all (noise, not a guess).
        self.min_probability = min_probability
        self._lock = threading.Lock()
        self._hits = 0.0
        self._predicted = 0.0
        self.stats = {"admitted": 0, "declined_unmeasured": 0, "declined_cost": 0, "declined_slots": 0}
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

    def expected(self, chain: Sequence[tuple[float, float, float]], costs: GateCosts) -> tuple[float, float, float]:
        """(saving, cost, slot cost), in seconds, of speculating `chain`: (the selector's
        probability, the measured seconds, the measured seconds in a CPU slot) of each call. A
        call saves its time with the chance that the chain gets to it right, as far as it runs
        within the reasoning it hides behind (the i-th call of the chain behind i + 1 steps: each
        adopted call is followed by another step; a checkpoint runs between calls); a wrong guess
        anywhere in it costs a rollback; a snapshot that outlasts the step is waited for. The
        slot cost (part of the cost) is each call's slot seconds, wasted unless the chain is
        right up to it, at the slots' load."""
        snapshot = costs.snapshot or 0.0
        reasoning = costs.reasoning
        miss = costs.miss if costs.miss is not None else snapshot
        load = costs.slot_load or 0.0
        saving, reach, elapsed, slots = 0.0, 1.0, snapshot, 0.0
        for i, (probability, seconds, slot_seconds) in enumerate(chain):
            reach *= self.calibrated(probability)
            start = elapsed + (snapshot if i else 0.0)
            elapsed = start + seconds
            hidden = seconds if reasoning is None else max(0.0, min(elapsed, (i + 1) * reasoning) - start)
            saving += reach * hidden
            slots += (1.0 - reach) * slot_seconds * load
        waited = max(0.0, snapshot - reasoning) if reasoning is not None else 0.0
        return saving, (1.0 - reach) * miss + waited + slots, slots

    def admit(self, chain: Sequence[tuple[ToolCall, float]], call_seconds: Callable[[ToolCall], float | None],
              costs: GateCosts, slot_seconds: Callable[[ToolCall], float] | None = None) -> list[ToolCall]:
        """The prefix of `chain` (calls with the selector's conditional probabilities) whose
        expected saving beats its expected cost by the most; empty when none does. A fast first
        call (an observation) may lead to a slow one (the action after it): the chain is weighed
        whole, not call by call. A call never measured ends the chain (nothing says it saves).
        slot_seconds: a call's measured seconds in a CPU slot (None: none is weighed)."""
        measured: list[tuple[float, float, float]] = []
        for call, p in chain:
            seconds = call_seconds(call)
            if seconds is None:
                break
            measured.append((p, seconds, slot_seconds(call) if slot_seconds is not None else 0.0))
        if not measured:
            if chain:
                self._count("declined_unmeasured")
            return []
        best, best_net, best_terms = 0, 0.0, (0.0, 0.0, 0.0)
        for k in range(1, len(measured) + 1):
            terms = self.expected(measured[:k], costs)
            if terms[0] - terms[1] > best_net:
                best, best_net, best_terms = k, terms[0] - terms[1], terms
        first = chain[0][0]
        terms = best_terms if best else self.expected(measured[:1], costs)
        self._note(first, measured[0][0], measured[0][1], costs, *terms, depth=best)
        if not best:
            # Declined for the slots: it would have run without them.
            self._count("declined_slots" if terms[0] > terms[1] - terms[2] else "declined_cost")
            return []
        self._count("admitted")
        return [c for c, _ in chain[:best]]

    def _note(self, call: ToolCall, p: float, seconds: float, costs: GateCosts, saving: float, cost: float,
              slot_cost: float, depth: int) -> None:
        calibrated = self.calibrated(p)  # before the lock: it takes it too
        with self._lock:
            self.decisions.append({"tool": call.name, "p": round(p, 3), "p_calibrated": round(calibrated, 3),
                                   "call": round(seconds, 3), "reasoning": _r(costs.reasoning),
                                   "snapshot": _r(costs.snapshot), "miss": _r(costs.miss), "saving": round(saving, 3),
                                   "cost": round(cost, 3), "slot_load": _r(costs.slot_load),
                                   "slot_cost": round(slot_cost, 3), "admitted": depth > 0, "depth": depth})

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
