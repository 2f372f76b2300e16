"""CPU slots: at most N CPU-heavy tool executions at once on this host (issue 38's contention).

Many rollouts on a few cores make a test suite or an office export take several times its time
alone, and that slowdown is silent: it inflates every configuration's tool time and the ceiling
with it. With slots configured, a tool's CPU-heavy part (a test suite, a compiler, an office
program starting, saving or exporting) waits for a free slot first; the wait counts as the
call's time (it is inside the tool, as a scheduler's queue would be), and is counted here apart
(`stats()`), so a run shows its oversubscription as queueing instead of hiding it in slower
calls. Every execution takes a slot: a real call, a replay behind a hit, a speculative run, an
audit. Unconfigured (the default), nothing waits.

The slots also tell speculation's gate what a wrong guess costs the host: each tool's seconds in
a slot per execution (`tool_seconds`, by the tool that ran: `running_tool`) and how busy the
slots are now (`load`). On a full host a wrong speculative test suite holds a slot another
sample's real call then waits for.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

# The tool whose execution this is (Tool.run sets it; it travels into the executor's threads).
_tool: contextvars.ContextVar[str | None] = contextvars.ContextVar("bunshinrl_running_tool", default=None)


@contextlib.contextmanager
def running_tool(name: str) -> Iterator[None]:
    """Slots held inside the block are counted for the tool `name`."""
    token = _tool.set(name)
    try:
        yield
    finally:
        _tool.reset(token)


class CpuSlots:
    """N slots (None: unlimited). timeout: the longest wait for one (TimeoutError after it)."""

    def __init__(self, slots: int | None = None, timeout: float = 900.0) -> None:
        if slots is not None and slots < 1:
            raise ValueError(f"cpu slots must be >= 1 or None, not {slots}")
        self.slots = slots
        self.timeout = timeout
        self._sem = threading.BoundedSemaphore(slots) if slots is not None else None
        self._lock = threading.Lock()
        self._stats = {"held": 0, "waited": 0, "wait_seconds": 0.0, "max_wait_seconds": 0.0, "held_seconds": 0.0}
        self._in_use = 0
        self._waiting = 0
        self._by_tool: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # executions, seconds held

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """One slot for the block: waited for first, released after."""
        if self._sem is None:
            yield
            return
        t = time.monotonic()
        with self._lock:
            self._waiting += 1
        try:
            got = self._sem.acquire(timeout=self.timeout)
        finally:
            with self._lock:
                self._waiting -= 1
                self._in_use += got
        if not got:
            raise TimeoutError(f"no CPU slot free within {self.timeout:g} s ({self.slots} slots)")
        waited = time.monotonic() - t
        held = time.monotonic()
        try:
            yield
        finally:
            self._sem.release()
            took = time.monotonic() - held
            with self._lock:
                self._in_use -= 1
                tool = _tool.get()
                if tool is not None:
                    self._by_tool[tool][0] += 1
                    self._by_tool[tool][1] += took
                s = self._stats
                s["held"] += 1
                s["waited"] += waited > 0.001
                s["wait_seconds"] += waited
                s["max_wait_seconds"] = max(s["max_wait_seconds"], waited)
                s["held_seconds"] += took

    def load(self) -> float | None:
        """The share of the slots in use or waited for now, at most 1 (None: no slots)."""
        if self.slots is None:
            return None
        with self._lock:
            return min(1.0, (self._in_use + self._waiting) / self.slots)

    def tool_seconds(self, name: str) -> float:
        """The mean seconds an execution of the tool `name` held slots (0: it never held one)."""
        with self._lock:
            runs, seconds = self._by_tool.get(name, (0, 0.0))
        return seconds / runs if runs else 0.0

    def stats(self) -> dict[str, Any]:
        """Slots, executions that held one, how many waited, for how long, and time held."""
        with self._lock:
            return {"slots": self.slots, **{k: round(v, 3) if isinstance(v, float) else v
                                           for k, v in self._stats.items()}}


_slots = CpuSlots()


def configure(slots: int | None, timeout: float = 900.0) -> CpuSlots:
    """Set this process's CPU slots (None: unlimited); the new CpuSlots, its counts at zero."""
    global _slots
    _slots = CpuSlots(slots, timeout)
    return _slots


def current() -> CpuSlots:
    return _slots


def cpu_slot() -> contextlib.AbstractContextManager[None]:
    """A slot of this process's CpuSlots for the CPU-heavy part of a tool."""
    return _slots.hold()


__all__ = ["CpuSlots", "configure", "cpu_slot", "current", "running_tool"]
