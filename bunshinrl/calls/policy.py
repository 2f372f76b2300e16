"""What the rollout engine asks of a policy, and what it gives it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .signature import ToolCall


@dataclass(frozen=True)
class FinalAnswer:
    text: str = ""


# One decision: a tool call, several calls made at once (parallel tool calls: they run in order,
# each observed on its own), or the final answer.
Action = ToolCall | tuple[ToolCall, ...] | FinalAnswer


def calls_of(action: Action) -> tuple[ToolCall, ...]:
    """The calls a decision makes (none for a final answer)."""
    if isinstance(action, FinalAnswer):
        return ()
    if isinstance(action, ToolCall):
        return (action,)
    if isinstance(action, tuple) and action and all(isinstance(c, ToolCall) for c in action):
        return action
    raise TypeError(f"the policy returned {action!r}, not a ToolCall, a tuple of them or a FinalAnswer")


@dataclass(frozen=True)
class Step:
    """One completed tool call of a trajectory and the observation the policy was given.
    decision: how many steps the trajectory had when the policy made the decision that issued
    this call; calls of one decision (parallel tool calls) share it."""

    call: ToolCall
    observation: str
    decision: int = -1


@dataclass(frozen=True)
class SampleContext:
    """Which rollout the policy is acting for: sample `sample` of task `task_id`'s GRPO group."""

    task_id: str
    sample: int
    epoch: int
    prompt: str = ""


@runtime_checkable
class Policy(Protocol):
    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        """Reason over the history and return the next tool call(s), or the final answer."""
        ...
