"""How long the policy's next reasoning step will take: what decides whether work fits beside it.

A capture of a sample's workspace freezes it, so the cache starts one only when the reasoning
step that follows is predicted to outlast it. The prediction comes from a model of the serving
backend when the driver has one (a latency model, a trainer's recent step times), or else from
the steps this core has seen: the time between a call's return and the sample's next call.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable

# Below this a gap is the next call of one decision (parallel calls), not a reasoning step.
_MIN_STEP_SECONDS = 0.005


class ReasoningClock:
    """model: a callable predicting the next step's seconds (it wins when given); otherwise the
    `quantile` of the last `window` observed steps, low on purpose: a capture that outlasts a
    short step is paid on the path, one skipped beside a long step only costs a later replay."""

    def __init__(self, model: Callable[[], float] | None = None, window: int = 64, quantile: float = 0.25) -> None:
        if not 0.0 <= quantile <= 1.0:
            raise ValueError("quantile must be within [0, 1]")
        self.model = model
        self.quantile = quantile
        self._seen: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def note(self, seconds: float) -> None:
        """One observed reasoning step (a driver's or the trainer's)."""
        if seconds >= _MIN_STEP_SECONDS:
            with self._lock:
                self._seen.append(seconds)

    def predict(self) -> float | None:
        """The next step's predicted seconds; None while nothing is known."""
        if self.model is not None:
            return float(self.model())
        with self._lock:
            seen = sorted(self._seen)
        if not seen:
            return None
        if len(seen) == 1:
            return seen[0]
        return statistics.quantiles(seen, n=100, method="inclusive")[max(0, round(self.quantile * 100) - 1)] \
            if 0 < self.quantile < 1 else (seen[0] if self.quantile == 0 else seen[-1])


__all__ = ["ReasoningClock"]
