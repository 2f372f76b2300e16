"""The trajectory audit: after an epoch, re-execute each sample's history from its root.

The invariant says a sample's workspace is exactly the history it was shown, however its steps
were served (the prefix cache, speculation, a sibling's call, a rebuilt state). The audit checks
it from outside the machinery that keeps it: a fresh fork of the task's root state runs the
history's calls one by one, as a Base sample would, and every observation the sample was shown,
the verifier's included (so the reward), is compared with what the fresh run observes.

A tool declared `deterministic=False` was never served, but its effects may reach the state the
later steps read, so from its first call on a fresh run proves nothing either way: such a sample
is reported `not_auditable` (the steps before it are still compared), never silently passed,
unless the caller names the tool `stateless` (it changes nothing: its observation is skipped and
the audit goes on).

modes: "all" (every sample), "sample" (one per task, drawn by a seeded generator keyed by the
epoch and the task, so a run is reproducible), "off".
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from bunshinfork import AsyncWorkspace, BunshinError, Workspace

from .._async import call_sync_or_async
from ..calls.task import REWARD_TOOL, Task, parse_reward
from ..states.backend import SharedSnapshot
from .core import RolloutCore
from .timeline import EpochResult, SampleTimeline

AUDIT_MODES = ("all", "sample", "off")
RootFork = Callable[[Task], Awaitable["Workspace | None"]]  # a fresh fork of the task's root, or None


@dataclass(frozen=True)
class AuditMismatch:
    """A step whose fresh execution observed something else than the sample was shown."""

    step: int
    call: str
    served: str
    fresh: str
    how: str = ""  # what had served the step to the sample (executed, cache, speculation)


@dataclass
class SampleAudit:
    """status: "ok" (every step reproduced), "mismatch", "not_auditable" (a call of a tool
    declared non-deterministic: reason names it; the steps before it were compared), "error"
    (the fresh run itself failed: reason)."""

    task_id: str
    sample: int
    status: str = "ok"
    steps: int = 0  # steps re-executed and compared
    mismatches: list[AuditMismatch] = field(default_factory=list)
    reason: str = ""
    reward: float | None = None  # what the sample was scored
    fresh_reward: float | None = None  # what the fresh run's verifier said
    path: list[str] = field(default_factory=list)  # per step, what served it to the sample

    def summary(self) -> dict[str, Any]:
        return {"sample": f"{self.task_id}/{self.sample}", "status": self.status, "steps": self.steps,
                "reward": self.reward, "fresh_reward": self.fresh_reward, "reason": self.reason,
                "mismatches": [{"step": m.step, "call": m.call, "how": m.how, "served": m.served[:300],
                                "fresh": m.fresh[:300]} for m in self.mismatches],
                "path": ",".join(self.path)}


@dataclass
class AuditReport:
    epoch: int
    mode: str
    samples: list[SampleAudit] = field(default_factory=list)
    seconds: float = 0.0

    def _count(self, status: str) -> int:
        return sum(s.status == status for s in self.samples)

    @property
    def mismatches(self) -> int:
        """Samples whose history did not reproduce (the invariant broken)."""
        return self._count("mismatch")

    @property
    def not_auditable(self) -> int:
        return self._count("not_auditable")

    @property
    def errors(self) -> int:
        return self._count("error")

    @property
    def ok(self) -> bool:
        """Nothing mismatched and nothing failed (not_auditable samples are reported, not failed)."""
        return self.mismatches == 0 and self.errors == 0

    def summary(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "mode": self.mode, "audited": len(self.samples), "passed": self._count("ok"),
                "mismatches": self.mismatches, "not_auditable": self.not_auditable, "errors": self.errors,
                "steps": sum(s.steps for s in self.samples), "seconds": round(self.seconds, 3),
                "samples": [s.summary() for s in self.samples if s.status != "ok"]}


def choose(result: EpochResult, mode: str, seed: int = 0) -> list[SampleTimeline]:
    """The samples `mode` audits."""
    if mode not in AUDIT_MODES:
        raise ValueError(f"audit mode {mode!r}: use one of {', '.join(AUDIT_MODES)}")
    if mode == "off":
        return []
    if mode == "all":
        return list(result.samples)
    by_task: dict[str, list[SampleTimeline]] = {}
    for s in result.samples:
        by_task.setdefault(s.task_id, []).append(s)
    # Keyed by (seed, epoch, task): the same run audits the same samples, another epoch others.
    return [random.Random(f"{seed}/{result.epoch}/{t}").choice(ss) for t, ss in sorted(by_task.items())]


async def _destroy(ws: Workspace) -> None:
    with contextlib.suppress(BunshinError):
        await AsyncWorkspace(ws).destroy()


class TrajectoryAuditor:
    """Audits epochs of `tasks` (EpochResult.samples) by re-executing their histories.

    root: a fresh fork of a task's root state (`cache_roots(core)` forks the prefix cache's
    root, the state the samples started from); when it is None or answers None, the auditor
    builds the task's initial workspace itself once (create, setup), keeps its snapshot for later
    epochs and forks that. stateless: tools declared non-deterministic that change no state.
    concurrency: samples re-executed at once. timeout: seconds per sample."""

    def __init__(self, tasks: Sequence[Task], *, mode: str = "all", root: RootFork | None = None,
                 stateless: Collection[str] = (), seed: int = 0, memory: str = "auto", concurrency: int = 4,
                 timeout: float = 600.0) -> None:
        if mode not in AUDIT_MODES:
            raise ValueError(f"audit mode {mode!r}: use one of {', '.join(AUDIT_MODES)}")
        self.tasks = {t.id: t for t in tasks}
        self.mode = mode
        self.root = root
        self.stateless = frozenset(stateless)
        self.seed = seed
        self.memory = memory
        self.timeout = timeout
        self._sem = asyncio.Semaphore(max(1, concurrency))
        self._own: dict[str, asyncio.Task[SharedSnapshot]] = {}
        self.reports: list[AuditReport] = []

    async def audit(self, result: EpochResult) -> AuditReport:
        t0 = time.monotonic()
        report = AuditReport(result.epoch, self.mode)
        report.samples = list(await asyncio.gather(*(self._guarded(s) for s in choose(result, self.mode, self.seed))))
        report.seconds = time.monotonic() - t0
        self.reports.append(report)
        return report

    async def close(self) -> None:
        """Release the initial snapshots the auditor built."""
        own, self._own = self._own, {}
        for fut in own.values():
            with contextlib.suppress(Exception):
                await (await fut).release_async()

    async def _guarded(self, s: SampleTimeline) -> SampleAudit:
        async with self._sem:
            try:
                return await asyncio.wait_for(self.audit_sample(s), self.timeout)
            except Exception as e:  # the fresh run failed: reported, never passed
                return SampleAudit(s.task_id, s.sample, "error", reason=f"{type(e).__name__}: {e}",
                                   reward=s.reward)

    async def _fork_root(self, task: Task) -> Workspace:
        if self.root is not None:
            ws = await self.root(task)
            if ws is not None:
                return ws
        if task.id not in self._own:
            self._own[task.id] = asyncio.ensure_future(self._initial(task))
        try:
            snap = await asyncio.shield(self._own[task.id])
        except BaseException:
            self._own.pop(task.id, None)  # not kept: the next sample tries again
            raise
        return await snap.fork_async()

    async def _initial(self, task: Task) -> SharedSnapshot:
        ws = (await AsyncWorkspace.create(**task.spec)).workspace
        try:
            await call_sync_or_async(task.setup, ws)
            return await SharedSnapshot.take_async(ws, self.memory)
        finally:
            await _destroy(ws)

    async def audit_sample(self, s: SampleTimeline) -> SampleAudit:
        """Re-execute `s`'s history in a fresh fork of its task's root and compare."""
        task = self.tasks[s.task_id]
        out = SampleAudit(s.task_id, s.sample, reward=s.reward, path=list(s.served))
        ws = await self._fork_root(task)
        try:
            for i, step in enumerate(s.steps):
                tool = task.engine_tools[step.call.name]
                if not tool.deterministic and tool.name not in self.stateless:
                    out.status = "not_auditable"
                    out.reason = (f"step {i} calls {tool.name}, declared non-deterministic, whose effects may "
                                  "reach the state later steps read")
                    break
                fresh = await tool.run(ws, step.call.args)
                if not tool.deterministic:
                    continue  # stateless: nothing of its observation is expected to repeat
                out.steps += 1
                if step.call.name == REWARD_TOOL:
                    with contextlib.suppress(ValueError):
                        out.fresh_reward = parse_reward(fresh)
                if fresh != step.observation:
                    how = s.served[i] if i < len(s.served) else ""
                    out.mismatches.append(AuditMismatch(i, step.call.key, step.observation, fresh, how))
        finally:
            await _destroy(ws)
        if out.mismatches or (out.fresh_reward is not None and s.reward is not None and out.fresh_reward != s.reward):
            out.status = "mismatch"
        return out


def cache_roots(core: RolloutCore) -> RootFork:
    """Fresh forks of the roots the core's prefix cache holds (None where it holds none)."""

    async def fork(task: Task) -> Workspace | None:
        cache = core.cache
        if cache is None:
            return None
        node = cache.root(task.id, await core.digest(task))
        if node is None:
            return None
        return await cache.materialize(node, task.engine_tools)

    return fork


__all__ = ["AUDIT_MODES", "AuditMismatch", "AuditReport", "SampleAudit", "TrajectoryAuditor", "cache_roots", "choose"]
