"""Where a sample's state lives (Rollout.state), the one checked way it changes (transition,
along TRANSITIONS only), and the errors that move a sample back.

    Idle         no workspace of its own: its state is the prefix-cache node it stands on
                 (a shadow may be rebuilding that state ahead of an expected miss)
    Live         a workspace in the state after the last call
    Settling     that workspace is being captured for the cache and/or handed to a speculative
                 branch, while the policy reasons; the next call waits for it
    Speculating  a speculative branch owns the workspace and runs predicted calls
    Closed

A state changes only by transition(); an edge the machine does not have raises
IllegalTransition (runc's libcontainer checks its container states the same way).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bunshinfork import Workspace

from ..speculation.speculator import SpeculativeBranch


@dataclass
class Idle:
    shadow: asyncio.Task[Workspace] | None = None


@dataclass
class Live:
    ws: Workspace


@dataclass
class Settling:
    ws: Workspace | None  # None: the sample's first fork (or its warm workspace) is still under way
    task: asyncio.Future[Live | Speculating | Idle]  # Idle: the warm workspace was lost
    kind: str = "post_wait"  # what a wait for it is counted as on the sample's path


@dataclass
class Speculating:
    branch: SpeculativeBranch


@dataclass
class Closed:
    pass


State = Idle | Live | Settling | Speculating | Closed

# (from, to): every edge of a sample's state machine; None is "not started yet".
TRANSITIONS: frozenset[tuple[type | None, type]] = frozenset({
    (None, Idle), (None, Live), (None, Settling),
    # Idle: a hit moves on (a new shadow), a miss materializes, a chain speculates on the shadow.
    (Idle, Idle), (Idle, Live), (Idle, Settling), (Idle, Closed),
    # Live: a hit leaves the workspace behind (warm), a real call settles (capture, speculation).
    (Live, Idle), (Live, Settling), (Live, Closed),
    # Settling: the capture or launch ends Live, Speculating, or Idle (the warm workspace lost).
    (Settling, Live), (Settling, Speculating), (Settling, Idle), (Settling, Closed),
    # Speculating: a miss rolls the branch back, a hit leaves it behind, an adopted chain ends.
    (Speculating, Live), (Speculating, Idle), (Speculating, Closed),
})


class IllegalTransition(RuntimeError):
    """A sample's state was asked to move along an edge TRANSITIONS does not have."""

    def __init__(self, before: State | None, after: State) -> None:
        name = "none" if before is None else type(before).__name__
        super().__init__(f"a sample's state cannot go from {name} to {type(after).__name__}")
        self.before = before
        self.after = after


def transition(before: State | None, after: State) -> State:
    """The one way a sample's state changes: `after`, when (before, after) is an edge of
    TRANSITIONS (before None: the sample's first state); IllegalTransition otherwise."""
    if (None if before is None else type(before), type(after)) not in TRANSITIONS:
        raise IllegalTransition(before, after)
    return after


class Diverged(Exception):
    """A warm workspace's replay observed something else than the sample was shown; the
    workspace was destroyed (it is never adopted), and the next call rebuilds a verified one."""

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index  # the divergence's index in the sample's timeline (divergence_outcomes)


class Rewound(RuntimeError):
    """A step served to this sample (`step`, counted from 0) did not reproduce: replayed from
    the deepest captured state on the sample's path, its call observed `observation` instead.
    The rollout's history is cut back to that step with the fresh observation and its workspace
    is in the state after it; the driver's policy acts again on `rollout.history` (the call that
    raised this did not run). A driver that cannot cut its conversation back (Rollout.rewinds
    False) gets the trajectory refused: every later call fails and nothing is scored."""

    def __init__(self, step: int, observation: str, dropped: int) -> None:
        super().__init__(f"step {step} did not reproduce on replay: history cut back ({dropped} steps dropped)")
        self.step = step
        self.observation = observation
        self.dropped = dropped
