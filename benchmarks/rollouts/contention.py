"""Contention (issue 38's measurement, item 5): what running many rollouts on a few cores did.

- cpu_pressure: the share of the epoch's wall time in which some runnable task waited for a CPU
  (the kernel's /proc/pressure/cpu "some" total, read before and after the epoch; None where
  the kernel has no PSI).
- the contention factor: each real call's seconds over its seconds alone. "Alone" comes from a
  calibration after the seed's epochs: for each task, the Base sample that spent the most time
  in real calls in the last epoch has its history re-executed call by call in a fresh workspace
  (create, setup), with nothing else running. The factor of an epoch is the sum of its calls'
  seconds over the sum of the same calls alone (calls never calibrated are left out, and
  counted); beside it the median call's ratio, and the straggler's.
- reasoning_busy_share: the share of the epoch in which at least one rollout was reasoning (the
  GPU duty cycle verl and SkyRL users quote).
- distinct_prefixes: per task group, the distinct call prefixes its samples made over the calls
  they made (1 / G: every sample the same; 1: no two alike).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bunshinfork import AsyncWorkspace
from bunshinrl import EpochResult, Task
from bunshinrl._async import call_sync_or_async

PSI_CPU = Path("/proc/pressure/cpu")


def _some_total() -> int | None:
    """Microseconds in which some task waited for a CPU, since boot (None: no PSI)."""
    try:
        for line in PSI_CPU.read_text().splitlines():
            if line.startswith("some "):
                return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class CpuPressure:
    """The CPU pressure of an interval: start(), then share() (None without PSI)."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._some0: int | None = None

    def start(self) -> None:
        self._t0, self._some0 = time.monotonic(), _some_total()

    def share(self) -> float | None:
        some, wall = _some_total(), time.monotonic() - self._t0
        if some is None or self._some0 is None or wall <= 0:
            return None
        return round((some - self._some0) / 1e6 / wall, 4)


def reasoning_busy_share(r: EpochResult) -> float:
    """The share of the epoch in which at least one rollout was reasoning (intervals merged)."""
    spans = sorted((e.start, e.end) for s in r.samples for e in s.events if e.kind == "reason")
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return round(busy / r.seconds, 4) if r.seconds > 0 else 0.0


def distinct_prefixes(r: EpochResult) -> dict[str, float]:
    """Per task, the distinct call prefixes of its group over the calls its samples made."""
    out: dict[str, float] = {}
    for task in sorted({s.task_id for s in r.samples}):
        paths = [[st.call.key for st in s.steps] for s in r.samples if s.task_id == task]
        made = sum(len(p) for p in paths)
        seen = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
        out[task] = round(len(seen) / made, 4) if made else 0.0
    return out


async def calibrate(tasks: Sequence[Task], last: EpochResult) -> dict[str, float]:
    """Per call key, its seconds alone (see the module doc): one sample per task, run call by
    call in a fresh workspace, one task after another."""
    alone: dict[str, float] = {}
    for task in tasks:
        samples = [s for s in last.samples if s.task_id == task.id and s.steps]
        if not samples:
            continue
        s = max(samples, key=lambda t: t.seconds("tool"))
        aws = await AsyncWorkspace.create(**task.spec)
        try:
            await call_sync_or_async(task.setup, aws.workspace)
            for step in s.steps:
                tool = task.engine_tools[step.call.name]
                t = time.monotonic()
                await tool.run(aws.workspace, step.call.args)
                alone.setdefault(step.call.key, time.monotonic() - t)
        finally:
            await aws.destroy()
    return alone


def factor(r: EpochResult, alone: dict[str, float]) -> dict[str, Any]:
    """The epoch's real calls against their times alone (see the module doc)."""
    def of(samples: Sequence[Any]) -> tuple[list[tuple[float, float]], int]:
        pairs, missing = [], 0
        for s in samples:
            for e in s.events:
                if e.kind != "tool":
                    continue
                a = alone.get(e.detail)
                if a is None or a <= 0:
                    missing += 1
                else:
                    pairs.append((e.seconds, a))
        return pairs, missing

    pairs, missing = of(r.samples)
    last = [max(r.samples, key=lambda t: t.finished)] if r.samples else []
    path, _ = of(last)

    def ratio(ps: list[tuple[float, float]]) -> float | None:
        return round(sum(m for m, _ in ps) / sum(a for _, a in ps), 3) if ps else None

    return {"factor": ratio(pairs), "median_call": round(statistics.median(m / a for m, a in pairs), 3) if pairs
            else None, "straggler": ratio(path), "calls": len(pairs), "not_calibrated": missing}


__all__ = ["CpuPressure", "calibrate", "distinct_prefixes", "factor", "reasoning_busy_share"]
