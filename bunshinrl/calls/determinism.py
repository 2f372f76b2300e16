"""check_family: are a task family's tools deterministic enough for the prefix cache?

The cache and speculation serve a recorded observation in place of a fresh call, which is only
sound when a fresh call from the same state observes the same thing. A tool that prints anything
fork-specific (a random uuid, a clock, a workspace id, an address leased per workspace) breaks
that, and the guard finds out only when a replay diverges, mid-epoch, after serving it. So before
a family is used with the cache, run every one of its tools in two forks of one state (bunshinfork's
`Workspace.fork`, the same live fork the cache's hits are) and compare the observations.

The calls checked are the task's candidate actions (`Task.actions`, those that name a tool) plus
any the caller passes; a tool no call names is reported `unchecked` (its arguments cannot be
guessed). Tools declared `deterministic=False` are run too and reported apart: the cache never
serves them, so a difference there is expected, not a finding.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bunshinfork import AsyncWorkspace, BunshinError, Workspace

from .._async import call_sync_or_async
from .signature import ToolCall
from .task import Task

DEFAULT_TIMEOUT = 300.0  # seconds for the whole check: a family's setup plus two runs of each call


@dataclass(frozen=True)
class ToolDifference:
    """One call that observed different things in two forks of one state."""

    tool: str
    call: str  # the call's key: name + canonical arguments
    first: str
    second: str


@dataclass
class FamilyReport:
    """What check_family found. `differing`: deterministic-declared tools whose two forks
    observed different things (the cache must not serve them: declare them deterministic=False
    or make them print nothing fork-specific); `declared`: tools declared non-deterministic
    (run, never compared); `unchecked`: tools no call named; `checked`: calls compared."""

    task_id: str
    family: str
    checked: list[str] = field(default_factory=list)
    differing: list[ToolDifference] = field(default_factory=list)
    declared: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differing

    @property
    def differing_tools(self) -> list[str]:
        return sorted({d.tool for d in self.differing})

    def summary(self) -> dict[str, object]:
        return {"task": self.task_id, "family": self.family, "ok": self.ok, "checked": list(self.checked),
                "differing": [{"tool": d.tool, "call": d.call, "first": d.first[:500], "second": d.second[:500]}
                              for d in self.differing],
                "declared_nondeterministic": list(self.declared), "unchecked": list(self.unchecked)}


class FamilyNotDeterministic(Exception):
    """check_family(strict=True) found tools whose forks observed different things."""

    def __init__(self, report: FamilyReport) -> None:
        self.report = report
        lines = [f"{d.call}: {d.first[:120]!r} != {d.second[:120]!r}" for d in report.differing]
        super().__init__(f"task family {report.family or report.task_id}: tools {report.differing_tools} observe "
                         "different things in two forks of one state, so the prefix cache would serve a stale "
                         "observation; declare them deterministic=False or make them print nothing "
                         "fork-specific:\n  " + "\n  ".join(lines))


def _calls(task: Task, extra: Iterable[ToolCall]) -> list[ToolCall]:
    out: list[ToolCall] = []
    for text in task.actions:
        if "{" not in text:
            continue  # actions.FINAL and other non-call actions
        try:
            call = ToolCall.from_key(text)
        except ValueError:
            continue
        if call.name in task.agent_tools:
            out.append(call)
    for call in extra:
        if call.name not in task.agent_tools:
            raise KeyError(f"check_family: task {task.id} has no tool {call.name!r}")
        out.append(call)
    return list(dict.fromkeys(out))  # in order, once each


async def _destroy(ws: Workspace) -> None:
    with contextlib.suppress(BunshinError):
        await AsyncWorkspace(ws).destroy()


async def _run_in_two_forks(task: Task, state: Workspace, call: ToolCall) -> tuple[str, str]:
    clones = await asyncio.to_thread(state.fork, 2)
    forks = [c for c in clones if isinstance(c, Workspace)]
    try:
        for c in clones:
            if isinstance(c, Exception):
                raise c
        tool = task.engine_tools[call.name]
        # Both at once, as a sample and its replay (or two siblings) run beside each other.
        first, second = await asyncio.gather(*(tool.run(ws, call.args) for ws in forks))
        return first, second
    finally:
        for ws in forks:
            await _destroy(ws)


async def check_family_async(task: Task, calls: Sequence[ToolCall] = (), *, prefix: Sequence[ToolCall] = (),
                             strict: bool = False, timeout: float = DEFAULT_TIMEOUT) -> FamilyReport:
    """Run every call of `task` (its candidate actions and `calls`) in two forks of its initial
    state (after `prefix`'s calls, when given: a state deeper in an episode) and compare what
    they observe. strict=True raises FamilyNotDeterministic on any difference."""
    report = FamilyReport(task.id, task.family)
    todo = _calls(task, calls)
    named = {c.name for c in todo}
    report.unchecked = sorted(n for n in task.agent_tools if n not in named)

    async def run() -> None:
        state = (await AsyncWorkspace.create(**task.spec)).workspace
        try:
            await call_sync_or_async(task.setup, state)
            for c in prefix:
                await task.engine_tools[c.name].run(state, c.args)
            for call in todo:
                first, second = await _run_in_two_forks(task, state, call)
                if not task.agent_tools[call.name].deterministic:
                    if call.name not in report.declared:
                        report.declared.append(call.name)
                    continue
                report.checked.append(call.key)
                if first != second:
                    report.differing.append(ToolDifference(call.name, call.key, first, second))
        finally:
            await _destroy(state)

    try:
        await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        raise TimeoutError(f"check_family: task {task.id} took over {timeout:.0f} s") from None
    if strict and not report.ok:
        raise FamilyNotDeterministic(report)
    return report


def check_family(task: Task, calls: Sequence[ToolCall] = (), *, prefix: Sequence[ToolCall] = (),
                 strict: bool = False, timeout: float = DEFAULT_TIMEOUT) -> FamilyReport:
    """check_family_async from synchronous code (not from inside a running event loop)."""
    return asyncio.run(check_family_async(task, calls, prefix=prefix, strict=strict, timeout=timeout))


__all__ = ["FamilyNotDeterministic", "FamilyReport", "ToolDifference", "check_family", "check_family_async"]
