"""The oracle: an epoch's recorded reasoning replayed through the same server model with every
tool at 0 s, a discrete-event simulation (docs/rl_rollouts_method.md, issue 38's method).

A sample is its decisions' (prompt tokens, output tokens), in the order the server answered
them (Server.recorded). Every sample starts at 0 s. A step is priced when it starts, by
`price(prompt, output, reasoning)`, `reasoning` the samples reasoning at that instant, this one
included (Server.price, the pricing the live server uses), and keeps its price. At an instant,
the steps that end are counted out before the steps that start are priced, and these start in
sample order, each counting those started before it, as the live server counts its requests.

With `pauses`, a sample waits that long after each of its steps before the next: the same
simulation with tool time, which the tests hold the oracle against. Only stdlib here, so the
tests load this file by its path.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

# (prompt tokens, output tokens, samples reasoning, this one included) -> the step's seconds
Price = Callable[[int, int, int], float]


def replay(samples: Sequence[Sequence[tuple[int, int]]], price: Price,
           pauses: Sequence[Sequence[float]] | None = None) -> float:
    """The time the last sample finishes: the oracle without `pauses` (0.0 without steps)."""
    step = [0] * len(samples)
    # (instant, sample, whether a reasoning step ends there: else a pause does)
    events: list[tuple[float, int, bool]] = []
    reasoning = 0
    last = 0.0

    def start(i: int, t: float) -> None:
        nonlocal reasoning, last
        if step[i] >= len(samples[i]):
            last = max(last, t)
            return
        reasoning += 1
        prompt, output = samples[i][step[i]]
        heapq.heappush(events, (t + price(prompt, output, reasoning), i, True))

    for i in range(len(samples)):
        start(i, 0.0)
    while events:
        t = events[0][0]
        ready: list[int] = []
        while events and events[0][0] == t:  # every end at this instant before any start
            _, i, reasoned = heapq.heappop(events)
            if reasoned:
                reasoning -= 1
                pause = pauses[i][step[i]] if pauses is not None else 0.0
                step[i] += 1
                if pause > 0:
                    heapq.heappush(events, (t + pause, i, False))
                    continue
            ready.append(i)
        for i in sorted(ready):
            start(i, t)
    return last
