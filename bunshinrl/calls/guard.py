"""Sampling-semantics guard: reuse a recorded result only when a fresh call would observe the same.

RL samples the policy's behaviour in the environment; serving a cached or speculative observation
that a fresh execution would not produce changes what is being sampled. Tools declared
deterministic=False are therefore never reused, and an optional audit re-executes a random
share of reused calls and, on any difference, marks the tool non-deterministic for good.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .signature import ToolCall
from .tools import Tool


@dataclass(frozen=True)
class Finding:
    tool: str
    call: str
    recorded: str
    fresh: str
    source: str  # "audit" | "replay"


class DeterminismGuard:
    def __init__(self, audit_rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= audit_rate <= 1.0:
            raise ValueError("audit_rate is a probability in [0, 1]")
        self.audit_rate = audit_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.detected: set[str] = set()
        self.declared: set[str] = set()
        self.findings: list[Finding] = []
        self.audits = 0
        self._listeners: list[Callable[[str], None]] = []

    def on_nondeterministic(self, callback: Callable[[str], None]) -> None:
        """Call `callback(tool_name)` when a tool is found non-deterministic (caches drop its entries)."""
        self._listeners.append(callback)

    def reusable(self, tool: Tool) -> bool:
        """May a recorded result of `tool` stand in for a fresh call?"""
        if not tool.deterministic:
            with self._lock:
                self.declared.add(tool.name)
            return False
        return tool.name not in self.detected

    def should_audit(self) -> bool:
        if self.audit_rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < self.audit_rate

    def check(self, call: ToolCall, recorded: str, fresh: str, source: str = "audit") -> bool:
        """Compare a recorded observation with a fresh one; a difference marks the tool."""
        with self._lock:
            if source == "audit":
                self.audits += 1
            if recorded == fresh:
                return True
            self.findings.append(Finding(call.name, call.key, recorded, fresh, source))
            new = call.name not in self.detected
            self.detected.add(call.name)
        if new:
            for cb in self._listeners:
                cb(call.name)
        return False

    def report(self) -> dict[str, object]:
        with self._lock:
            return {
                "audit_rate": self.audit_rate,
                "audits": self.audits,
                "declared_nondeterministic": sorted(self.declared),
                "detected_nondeterministic": sorted(self.detected),
                "mismatches": [
                    {"tool": f.tool, "call": f.call, "source": f.source,
                     "recorded": f.recorded[:200], "fresh": f.fresh[:200]}
                    for f in self.findings
                ],
            }
