"""Fault injection for the invariant's proof (issue 37): tools that, now and then, observe
something a replay of them will not.

`inject_faults(task, rate, seed)` wraps every agent tool of a task: after the real call, with
probability `rate` the observation gains a token specific to the sample whose fork ran it. The
draw and the token are keyed by (seed, task, epoch, sample, call), never by a clock or a global
generator, so a run is reproducible, while another sample replaying the same call from the same
state (the prefix cache's replay, a rebuilt state, the begin() race) observes something else:
exactly the divergence the rollout core must catch. The tools still claim to be deterministic,
as a buggy environment's would. The mark names the sample that drew it.

Who runs a call is carried by a context variable (`running_as`), not by the workspace: the
rollout core runs a sample's replays, rebuilds and speculative chains in tasks made from the
sample's own, which inherit it. `KeyedPolicy` sets it at each decision of a sample. Outside it
(check_family, a tool run by hand) nothing is injected.

`FaultAuditor` is the trajectory audit with the faults' one non-reproducible part pinned: each
step is re-executed as the execution that produced what the sample was shown (the sample named
by its mark; none for an unmarked observation), since a state captured by another sample with
the same history is one the invariant lets a sample fork. Every other byte of every observation,
and the reward, must reproduce as in the plain audit.

`FaultGuard` is a DeterminismGuard with its auto-disable off: a mismatch still drops the tool's
cached subtrees (so samples end up under removed nodes), but the tool stays reusable, and the
next mismatch drops them again, so a run keeps meeting divergences instead of turning the
cache off for the faulty tool at the first one.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from bunshinfork import Workspace

from ..calls.guard import DeterminismGuard
from ..calls.policy import SampleContext, Step
from ..calls.signature import ToolCall
from ..calls.task import Task
from ..calls.tools import Tool
from ..rollout.audit import SampleAudit, TrajectoryAuditor
from ..rollout.timeline import SampleTimeline

# (task id, epoch, sample) of the sample whose fork runs the calls of this context.
running_as: contextvars.ContextVar[tuple[str, int, int] | None] = contextvars.ContextVar(
    "bunshinrl_fault_sample", default=None)
# While auditing: per faulty call still to run, in order, the sample it runs as (None: nobody).
_audit_plan: contextvars.ContextVar[list[tuple[str, int, int] | None] | None] = contextvars.ContextVar(
    "bunshinrl_fault_audit_plan", default=None)

MARK = "[injected fault "
_MARK_RE = re.compile(re.escape(MARK) + r"(?P<task>.+)/(?P<epoch>\d+)/(?P<sample>\d+) [0-9a-f]{16}\]$")


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


def fault_token(seed: int, who: tuple[str, int, int], call: ToolCall, rate: float) -> str | None:
    """The token `who` observes for `call` under this seed, or None when no fault fires there
    (probability 1 - rate)."""
    d = _digest(seed, *who, call.key)
    if int.from_bytes(d[:8], "big") / 2**64 >= rate:
        return None
    return d[8:16].hex()


def faulty(tool: Tool, rate: float, seed: int) -> Tool:
    """`tool`, whose observation gains a sample-specific token with probability `rate` per
    (sample, call) (see the module doc)."""

    async def execute(ws: Workspace, args: dict[str, Any]) -> str:
        obs = await tool.run(ws, args)
        plan = _audit_plan.get()
        who = (plan.pop(0) if plan else None) if plan is not None else running_as.get()
        if who is None:
            return obs
        token = fault_token(seed, who, ToolCall(tool.name, args), rate)
        return obs if token is None else f"{obs}\n{MARK}{'/'.join(map(str, who))} {token}]"

    return dataclasses.replace(tool, execute=execute)


def inject_faults(task: Task, rate: float, seed: int = 0) -> Task:
    """The task with every agent tool made faulty; its id, fingerprint (so its cache keys), setup
    and verifier are unchanged."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a fault rate is a probability in [0, 1], not {rate}")
    return dataclasses.replace(task, tools=[faulty(t, rate, seed) for t in task.agent_tools.values()])


def _who(task_id: str, epoch: int, sample: int) -> tuple[str, int, int]:
    return (task_id, epoch, sample)


class KeyedPolicy:
    """A policy whose decisions run as their sample (running_as), so the calls they issue, and
    every replay and speculative chain started from them, are keyed by it."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Any:
        running_as.set(_who(ctx.task_id, ctx.epoch, ctx.sample))
        return await self.policy.act(ctx, history)


def producer(observation: str) -> tuple[str, int, int] | None:
    """The sample whose fault marked `observation`, or None when it carries no mark."""
    m = _MARK_RE.search(observation)
    return None if m is None else (m["task"], int(m["epoch"]), int(m["sample"]))


class FaultAuditor(TrajectoryAuditor):
    """The trajectory audit with each faulty step re-executed as the execution that produced
    what the sample was shown (see the module doc)."""

    async def audit_sample(self, s: SampleTimeline) -> SampleAudit:
        tools = self.tasks[s.task_id].agent_tools
        _audit_plan.set([producer(step.observation) for step in s.steps if step.call.name in tools])
        return await super().audit_sample(s)


class FaultGuard(DeterminismGuard):
    """A DeterminismGuard with its auto-disable off (see the module doc): every mismatch is
    recorded in `findings` and drops the tool's cached subtrees, and the tool stays reusable."""

    def check(self, call: ToolCall, recorded: str, fresh: str, source: str = "audit") -> bool:
        if super().check(call, recorded, fresh, source):
            return True
        # super() marked the tool and told the cache; forgetting the mark keeps it reusable
        # and makes the next mismatch tell the cache again.
        self.detected.discard(call.name)
        return False

    def report(self) -> dict[str, object]:
        return {**super().report(), "auto_disable": False}


__all__ = ["MARK", "FaultAuditor", "FaultGuard", "KeyedPolicy", "fault_token", "faulty", "inject_faults", "producer",
           "running_as"]
