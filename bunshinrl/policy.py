"""What the rollout engine asks of a policy, and what it gives it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from bunshinfork import Workspace

from .signature import ToolCall
from .tools import Tool, ToolSet


@dataclass(frozen=True)
class FinalAnswer:
    text: str = ""


Action = ToolCall | FinalAnswer


@dataclass(frozen=True)
class Step:
    """One completed tool call of a trajectory and the observation the policy was given."""

    call: ToolCall
    observation: str


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
        """Reason over the history and return the next tool call, or the final answer."""
        ...


@dataclass
class Environment:
    """How a task's initial workspace is made and which tools act on it.

    setup runs once per group on a fresh workspace (write the repository, start services). The
    fingerprint must change whenever setup would produce a different state: together with the
    root file system's digest it forms the template digest every cached prefix is keyed by.
    """

    tools: ToolSet
    setup: Callable[[Workspace], None]
    fingerprint: str
    spec: dict[str, Any] = field(default_factory=dict)

    def __init__(self, tools: Sequence[Tool] | ToolSet, setup: Callable[[Workspace], None], fingerprint: str,
                 spec: dict[str, Any] | None = None) -> None:
        self.tools = tools if isinstance(tools, ToolSet) else ToolSet(tools)
        self.setup = setup
        self.fingerprint = fingerprint
        self.spec = dict(spec or {})


@dataclass(frozen=True)
class Task:
    id: str
    environment: Environment
    prompt: str = ""
