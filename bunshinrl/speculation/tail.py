"""Tail-aware speculation: spend speculative forks only where recorded timings say they pay off.

An epoch ends with its slowest rollout, and speculation costs CPU and memory, so it is reserved
for samples that were slow before and for tools whose recorded executions are slow.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import defaultdict
from collections.abc import Sequence

from ..calls.signature import ToolCall


class TailPolicy:
    """slow_tool_seconds: a call is slow when its mean recorded time reaches this (None: when it
    is in the upper tool_quantile of tools). A call's own record (same tool and arguments) is
    used when there is one, else its tool's: query("/report") and query("/stats") differ. A
    sample is in the tail when its task's recorded rollout time is at least the
    task_quantile of all tasks' (GRPO samples of a task are exchangeable, so the task is what
    history can tell about a sample), a task's time being its slow rollouts' (the 90th percentile
    of its records: the epoch waits for the slowest); without any record every sample qualifies.

    online_real_calls: with a prefix cache, a sample that has already run this many calls for real
    in the current rollout counts as tail too: it left what the cache knows early and has the
    rest of its trajectory to execute, so it is the one that will finish last.
    """

    def __init__(self, slow_tool_seconds: float | None = 0.5, tool_quantile: float = 0.7,
                 task_quantile: float = 0.0, online_real_calls: int | None = None) -> None:
        self.slow_tool_seconds = slow_tool_seconds
        self.tool_quantile = tool_quantile
        self.task_quantile = task_quantile
        self.online_real_calls = online_real_calls
        self._tools: dict[str, list[float]] = defaultdict(list)
        self._calls: dict[str, list[float]] = defaultdict(list)
        self._tasks: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()
        # Set to a list, every record is also kept there until take_journal(): how several
        # processes (the hosts of a pool) learn each other's timings (replay()).
        self.journal: list[tuple[str, str, str, float]] | None = None

    def record_tool(self, name: str, seconds: float) -> None:
        self._add(("tool", name, "", seconds))

    def record_call(self, call: ToolCall, seconds: float) -> None:
        self._add(("call", call.name, call.key, seconds))

    def record_rollout(self, task_id: str, sample: int, seconds: float) -> None:
        self._add(("rollout", task_id, "", seconds))

    def _add(self, entry: tuple[str, str, str, float], journal: bool = True) -> None:
        kind, name, key, seconds = entry
        with self._lock:
            if kind == "rollout":
                self._tasks[name].append(seconds)
            else:
                self._tools[name].append(seconds)
                if kind == "call":
                    self._calls[key].append(seconds)
            if journal and self.journal is not None:
                self.journal.append(entry)

    def take_journal(self) -> list[tuple[str, str, str, float]]:
        """The records made since the last take (journal on), for replay() elsewhere."""
        with self._lock:
            if self.journal is None:
                return []
            out, self.journal = self.journal, []
        return out

    def replay(self, entries: Sequence[tuple[str, str, str, float]]) -> None:
        """Learn records another TailPolicy journalled (they are not journalled again here)."""
        for e in entries:
            self._add(e, journal=False)

    def tool_seconds(self, name: str) -> float | None:
        with self._lock:
            times = self._tools.get(name)
            return statistics.fmean(times) if times else None

    def call_seconds(self, call: ToolCall) -> float | None:
        with self._lock:
            times = self._calls.get(call.key)
            if times:
                return statistics.fmean(times)
        return self.tool_seconds(call.name)

    def is_slow(self, call: ToolCall) -> bool:
        return self._slow(self.call_seconds(call))

    def is_slow_tool(self, name: str) -> bool:
        return self._slow(self.tool_seconds(name))

    def _slow(self, mean: float | None) -> bool:
        if mean is None:
            return False
        if self.slow_tool_seconds is not None:
            return mean >= self.slow_tool_seconds
        with self._lock:
            means = sorted(statistics.fmean(v) for v in self._tools.values())
        return mean >= _quantile(means, self.tool_quantile)

    def is_tail_sample(self, task_id: str, sample: int) -> bool:
        with self._lock:
            own = self._tasks.get(task_id)
            if not own:
                return True
            tails = sorted(_upper(v) for v in self._tasks.values())
        return _upper(own) >= _quantile(tails, self.task_quantile)

    def should_speculate(self, task_id: str, sample: int, chain: Sequence[ToolCall], real_calls: int = 0) -> bool:
        """Speculate when the next predicted call is slow (a fast one saves less than the fork
        costs, and the call after it is predicted again once it has run) for a tail sample."""
        if not chain or not self.is_slow(chain[0]):
            return False
        return self.in_tail(task_id, sample, real_calls)

    def in_tail(self, task_id: str, sample: int, real_calls: int = 0) -> bool:
        """A tail sample: its task's record says so, or it has left the cache's paths (online)."""
        online = self.online_real_calls is not None and real_calls >= self.online_real_calls
        return online or self.is_tail_sample(task_id, sample)


def _upper(times: list[float]) -> float:
    """A task's slow rollouts: the 90th percentile of its recorded times. An epoch ends with its
    slowest rollout, and a task whose mean is low can still hold it (a group's exploration
    spreads its rollouts), so a filter on the mean could keep speculation off the sample the
    epoch waits for."""
    return _quantile(sorted(times), 0.9)


def _quantile(sorted_values: list[float], q: float) -> float:
    """The value at quantile q, rounded up to the next recorded value: with 2 tasks q=0.5 is the
    slower one (round(0.5) is 0 under banker's rounding, which let every task through)."""
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * (len(sorted_values) - 1) - 1e-9)))
    return sorted_values[i]
