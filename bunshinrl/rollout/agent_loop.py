"""The agent loop, written once: ask the policy, run its calls, finish; act again from a rewind.

Both of our drivers run it: RolloutEngine over a Rollout in this process, ClusterEngine over
a rollout stepped on a Ray host. The loop knows no tools, no cache and no host, only a
Session (as verl's agent loop knows only its server and its tools); verl and SkyRL run their
own loops over the same core (bunshinrl.adapters).

A Session's `call` and `finish` raise Rewound when a step served to the sample did not
reproduce: its history then ends at that step, with what its call observed afresh, and the
policy acts again from there (on-policy; its randomness is keyed by the step, so no later
draw shifts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..calls.policy import FinalAnswer, Policy, SampleContext, Step, calls_of
from ..calls.signature import ToolCall
from .sample_state import Rewound


class Session(Protocol):
    """One sample's trajectory as a driver steps it."""

    @property
    def ctx(self) -> SampleContext: ...

    @property
    def history(self) -> Sequence[Step]: ...

    @property
    def calls_left(self) -> int:
        """The task's budget of tool calls still open."""

    def now(self) -> float:
        """The sample's clock (its timeline's seconds)."""

    def reasoned(self, started: float) -> None:
        """The policy reasoned from `started` (now()) until now."""

    async def call(self, call: ToolCall, decision: int) -> object:
        """Run one call of decision `decision`; its step joins the history (or Rewound)."""

    async def finish(self, answer: str | None) -> object:
        """Score the trajectory (or Rewound)."""


@dataclass
class AgentLoop:
    """max_steps bounds a sample's decisions (those kept through a rewind count); the task's
    budget bounds its calls."""

    policy: Policy
    max_steps: int = 32

    async def run(self, s: Session) -> None:
        """Act until the policy answers or a budget ends, then finish; after a rewind, act again."""
        while True:
            try:
                await s.finish(await self.act(s))
                return
            except Rewound:
                continue

    async def act(self, s: Session) -> str | None:
        """The policy's decisions and their calls until it answers (its text) or its budget of
        decisions or calls ends (None). Rewound passes through."""
        for _ in range(len({st.decision for st in s.history}), self.max_steps):
            if s.calls_left == 0:
                break
            t = s.now()
            action = await self.policy.act(s.ctx, list(s.history))
            s.reasoned(t)
            if isinstance(action, FinalAnswer):
                return action.text
            decision = len(s.history)
            for c in calls_of(action)[:s.calls_left]:
                await s.call(c, decision)
        return None
