"""Speculative tool execution: run the calls the policy is predicted to make while it reasons.

After a real call, the workspace is snapshotted and a chain of K predicted calls runs while the
policy reasons. When the policy emits its next call the signatures are compared: a match adopts
the speculative observation and workspace (waiting only for whatever part of the call is still
running); the first mismatch aborts the chain, destroys the speculative workspace with everything
it wrote or started, and the real call runs from the state before the mismatched speculation: a
fork of the pre-speculation snapshot, or of the checkpoint taken after the last adopted call.
Only slow calls are chained: a checkpoint between two calls costs more than a fast call saves.

Two placements of the chain (Speculator(placement=...)):
  live        the chain runs in the sample's own workspace at once; a fork of the snapshot is
              restored only when the first predicted call mismatches
  fork_first  the paper's: the chain runs in a fork of the snapshot and the sample's workspace
              stays untouched for the real call, so a first-call mismatch costs no restore, but
              every speculation first waits for one
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from bunshinfork import Workspace

from ..calls import cpu_slots
from ..calls.guard import DeterminismGuard
from ..calls.signature import ToolCall
from ..calls.tools import Tool
from ..states.backend import SharedSnapshot
from ..states.metrics import WorkspaceRegistry
from .branch import PLACEMENTS, Placement, SpecHit, SpeculationError, SpeculativeBranch, check_placement
from .gate import GateCosts, MeasuredGate
from .selector import SelectorContext, ToolSelector, is_fitted
from .tail import TailPolicy

# "closed": a speculative chain's workspace cannot reach outside (an uncommitted call must have no
# remote effect); a call that tried is refused there and discarded as a miss, and runs for real.
# "inherit": the chain has the workspace's own egress policy.
Egress = Literal["closed", "inherit"]
EGRESS: tuple[Egress, ...] = ("closed", "inherit")


class Chain(list[ToolCall]):
    """A predicted chain, with the selector's probability of each call given the ones before it
    (the speculator calibrates its gate on how they fare)."""

    def __init__(self, calls: Sequence[ToolCall] = (), probabilities: Sequence[float] = ()) -> None:
        super().__init__(calls)
        self.probabilities = list(probabilities)


def _check_isolated(ws: Workspace, egress: str = "inherit") -> None:
    mode = ws.info().network.get("mode", "none")
    if mode != "none" and egress != "closed":
        # A speculative call must not reach anything a rollback could not undo.
        raise SpeculationError(f"workspace {ws.id} has network={mode!r}; speculating there needs "
                               "Speculator(egress='closed') or network='none'")


class Speculator:
    """Predicts K-call chains with a ToolSelector and runs them in forks, for tail samples only.

    memory: the memory engine of the snapshot launch() takes when it is given none (a branch's
    checkpoints use the engine of the state it started from). min_probability: shorter chains
    rather than guesses the selector itself doubts. placement: where the chain runs (see the
    module's docstring).
    """

    def __init__(self, selector: ToolSelector | None = None, *, depth: int = 2, memory: str = "auto",
                 tail: TailPolicy | None = None, guard: DeterminismGuard | None = None,
                 min_probability: float = 0.5, placement: Placement = "live", egress: Egress = "closed",
                 gate: MeasuredGate | None = None) -> None:
        if depth < 1:
            raise ValueError("depth must be >= 1")
        check_placement(placement)
        if egress not in EGRESS:
            raise ValueError(f"egress must be one of {EGRESS}, not {egress!r}")
        self.egress = egress
        self.placement = placement
        self.selector = selector
        self.depth = depth
        self.memory = memory
        self.tail = tail
        self.guard = guard or DeterminismGuard()
        self.min_probability = min_probability
        # With a gate, whether a chain is worth running is weighed from measured times and the
        # selector's calibrated probabilities; without, the tail policy's fixed slow-call rule.
        self.gate = gate
        self._tasks: set[asyncio.Future[Any]] = set()
        self.workspaces = WorkspaceRegistry()  # speculative forks alive right now (memory sampling)
        self.stats = {"launched": 0, "hits": 0, "mismatches": 0, "spec_refused_egress": 0, "wasted_seconds": 0.0}

    def predict(self, task_id: str, sample: int, calls: Sequence[ToolCall],
                tools: Mapping[str, Tool], real_calls: int = 0, costs: GateCosts | None = None) -> Chain:
        """The chain worth speculating from here: empty when the selector has no guess, the first
        guess is an unreusable tool, or the tail policy does not consider this sample slow; with a
        gate, only the calls its measured saving and cost admit (costs: what the core measured).
        real_calls: how many calls this rollout has executed for real so far."""
        if self.selector is None or not is_fitted(self.selector):
            return Chain()
        # With a gate, long shots are weighed too (a 20 s export guessed at 0.3 saves more than a
        # sure 20 ms call): the gate's floor replaces min_probability.
        floor = self.gate.min_probability if self.gate is not None else self.min_probability
        guesses: list[tuple[ToolCall, float]] = []
        for c, p in self.selector.predict_chain_proba(SelectorContext(task_id, tuple(calls)), self.depth, floor):
            tool = tools.get(c.name)
            if tool is None or not self.guard.reusable(tool):
                break  # a non-deterministic call's result could never be adopted
            guesses.append((c, p))
        if self.gate is not None:
            if self.tail is not None and not self.tail.in_tail(task_id, sample, real_calls):
                return Chain()
            measured = self.tail.call_seconds if self.tail is not None else (lambda _c: None)
            # A wrong guess's CPU-slot time is weighed at the slots' load now (the gate's docstring).
            slots = cpu_slots.current()
            costs = dataclasses.replace(costs or GateCosts(), slot_load=slots.load())
            keep = self.gate.admit(guesses, measured, costs, lambda c: slots.tool_seconds(c.name))
            return Chain(keep, [p for _, p in guesses[:len(keep)]])
        keep: list[ToolCall] = []
        for c, _ in guesses:
            if keep and self.tail is not None and not self.tail.is_slow(c):
                break  # the checkpoint before it would cost more than running it later saves
            keep.append(c)
        if self.tail is not None and not self.tail.should_speculate(task_id, sample, keep, real_calls):
            return Chain()
        return Chain(keep, [p for _, p in guesses[:len(keep)]])

    def report(self) -> dict[str, Any]:
        """The speculator's counts, with its gate's (gate_*) and calibration when it has one."""
        out: dict[str, Any] = dict(self.stats)
        if self.gate is not None:
            out.update({f"gate_{k}": v for k, v in self.gate.stats.items()})
            out["gate_calibration"] = round(self.gate.calibration(), 4)
        return out

    def record_outcome(self, probability: float | None, hit: bool) -> None:
        """A launched guess resolved (the gate calibrates the selector's probabilities on it)."""
        if self.gate is not None and probability is not None:
            self.gate.record_outcome(probability, hit)

    async def launch(self, ws: Workspace, calls: Sequence[ToolCall], tools: Mapping[str, Tool],
                     snapshot: SharedSnapshot | None = None) -> SpeculativeBranch:
        """Snapshot `ws` (or use `snapshot`, a capture of ws's current state the caller already
        holds) and start running `calls`. The branch owns `ws` until its close()."""
        if not calls:
            raise ValueError("nothing to speculate")
        _check_isolated(ws, self.egress)
        snap = snapshot.acquire() if snapshot is not None else await SharedSnapshot.take_async(ws, self.memory)
        self.stats["launched"] += 1
        return SpeculativeBranch(self, ws, snap, calls, tools, self.placement,
                                 probabilities=getattr(calls, "probabilities", None))

    def track(self, aw: Any) -> None:
        """Run a branch's teardown in the background; drain() waits for it."""
        fut = asyncio.ensure_future(aw)
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    def record_waste(self, seconds: float) -> None:
        """A discarded branch's speculative execution, in seconds (stats["wasted_seconds"])."""
        self.stats["wasted_seconds"] += seconds

    async def drain(self) -> None:
        """Wait until every discarded branch is torn down."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


__all__ = ["EGRESS", "PLACEMENTS", "Chain", "Egress", "Placement", "SpecHit", "SpeculationError", "SpeculativeBranch",
           "Speculator"]
