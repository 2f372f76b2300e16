"""A speculative branch: one predicted chain running in a workspace of its own (see
bunshinrl.speculation.speculator for the placements), resolved call by call against what the
policy really calls, and rolled back to the pre-speculation state or the last adopted call's
checkpoint on the first mismatch."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from bunshinfork import AsyncWorkspace, Workspace

from ..calls.signature import ToolCall
from ..calls.tools import Tool
from ..states.backend import SharedSnapshot
from ..states.metrics import WorkspaceRegistry

Placement = Literal["live", "fork_first"]
PLACEMENTS: tuple[Placement, ...] = ("live", "fork_first")


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")


class SpeculationError(RuntimeError):
    pass


@dataclass(frozen=True)
class SpecHit:
    observation: str
    exec_seconds: float  # how long the speculative execution took
    waited_seconds: float  # how much of it the caller still had to wait for
    index: int  # position in the chain


class BranchOwner(Protocol):
    """What a branch reports to the Speculator that launched it."""

    egress: str
    workspaces: WorkspaceRegistry
    stats: dict[str, Any]

    def track(self, aw: Any) -> None: ...

    def record_waste(self, seconds: float) -> None: ...

    def record_outcome(self, probability: float | None, hit: bool) -> None: ...


class SpeculativeBranch:
    """One chain of predicted calls, from the state the sample's workspace had at launch.

    Once that state is snapshotted, the workspace the sample had and any fork restored from the
    snapshot are interchangeable copies of it. With placement "live" the chain runs in the
    workspace that exists already, so it starts at once, and a fork of the snapshot is restored
    only when a mismatch needs the pre-speculation state back. With "fork_first" the chain runs in
    a fork and the sample's workspace (`home`) is the pre-speculation state: every speculation
    first waits for a restore, but a first-call mismatch hands `home` back without one.
    The branch owns the workspace and the snapshot until close(), which returns the workspace the
    sample continues with and discards the rest.
    """

    def __init__(self, owner: BranchOwner, ws: Workspace, snapshot: SharedSnapshot, calls: Sequence[ToolCall],
                 tools: Mapping[str, Tool], placement: Placement = "live",
                 probabilities: Sequence[float] | None = None) -> None:
        check_placement(placement)
        loop = asyncio.get_running_loop()
        self._owner = owner
        self.calls = list(calls)
        self.probabilities = list(probabilities) if probabilities else []
        self.placement = placement
        # The chain runs in _live; with fork_first it is restored by _run and _home waits for the
        # real call, until call 0 is adopted (then it is stale and goes).
        self._live: Workspace | None = ws if placement == "live" else None
        self._home: Workspace | None = ws if placement == "fork_first" else None
        self._home_destroy: asyncio.Future[None] | None = None
        self._snap: SharedSnapshot | None = snapshot  # the pre-speculation state, until call 0 resolves
        self._memory = snapshot.memory  # checkpoints fork like the state they branch from
        self._tools = tools
        self._results: list[asyncio.Future[tuple[str, float]]] = [loop.create_future() for _ in self.calls]
        self._checkpoints: list[asyncio.Future[SharedSnapshot]] = [loop.create_future() for _ in self.calls[1:]]
        self._released: set[int] = set()
        self._started: list[float | None] = [None] * len(self.calls)
        self._finished: list[float | None] = [None] * len(self.calls)
        self._live_destroy: asyncio.Future[None] | None = None
        # egress="closed": the chain's workspace while its egress is held closed, and the count of
        # refused packets there after each call (a call that tried to reach out is a miss).
        self._held: Workspace | None = None
        self._refused_after: list[int] = [0] * len(self.calls)
        self._next = 0
        self._aborted = False
        self._closed = False
        self.wasted_seconds = 0.0
        owner.workspaces.add(ws)
        self._runner = asyncio.create_task(self._run())

    # ---- the speculative chain ----

    async def _run(self) -> None:
        if self._live is None:  # fork_first: the chain's workspace is a restore of the snapshot
            assert self._snap is not None
            try:
                forked = await self._snap.fork_async()
            except BaseException as e:
                self._fail_from(0, e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                return
            self._live = forked  # a close() that came meanwhile leaves it to _cleanup
            self._owner.workspaces.add(forked)
            self._owner.track(self._release_snapshot())  # home is the rollback state; the snapshot is spent
        ws = self._live
        if self._owner.egress == "closed":
            try:
                if await asyncio.to_thread(ws.hold_egress):
                    self._held = ws
            except BaseException as e:
                self._fail_from(0, e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                return
        for j, call in enumerate(self.calls):
            if self._aborted:
                return
            self._started[j] = time.monotonic()
            try:
                obs = await self._tools[call.name].run(ws, call.args)
                if self._held is ws:
                    self._refused_after[j] = await asyncio.to_thread(ws.egress_refused)
            except BaseException as e:
                self._fail_from(j, e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                return
            self._finished[j] = time.monotonic()
            self._results[j].set_result((obs, self._finished[j] - self._started[j]))  # type: ignore[operator]
            if j < len(self._checkpoints) and not self._aborted:
                # The rollback point should the policy take this call and then deviate.
                try:
                    cp = await SharedSnapshot.take_async(ws, self._memory)
                except BaseException as e:
                    self._fail_from(j, e)
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    return
                self._checkpoints[j].set_result(cp)

    def _fail_from(self, j: int, error: BaseException) -> None:
        """Calls from j on will not run; the checkpoint after call j (if any) will not exist."""
        for f in [*self._results[j:], *self._checkpoints[j:]]:
            if not f.done():
                f.set_exception(SpeculationError(f"speculative chain stopped: {error!r}"))

    # ---- resolution ----

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self.calls)

    @property
    def adopted(self) -> int:
        return self._next

    @property
    def completed(self) -> int:
        """How many speculative calls have finished executing."""
        return sum(f is not None for f in self._finished)

    async def resolve(self, call: ToolCall) -> SpecHit | None:
        """The speculative observation of `call` if it is the next predicted call; None when the
        chain mismatches (or failed), after which only close() may be called."""
        j = self._next
        if self._closed or self._aborted or j >= len(self.calls):
            return None
        p = self.probabilities[j] if j < len(self.probabilities) else None
        if self.calls[j] != call:
            self._owner.stats["mismatches"] += 1
            self._owner.record_outcome(p, False)
            return None
        t0 = time.monotonic()
        try:
            obs, took = await self._results[j]
        except SpeculationError:
            self._owner.stats["mismatches"] += 1
            return None  # the chain failed: no word on the guess itself
        if self._refused_after[j] > (self._refused_after[j - 1] if j else 0):
            # It tried to reach outside and was refused: its observation is not the real call's.
            self._owner.stats["spec_refused_egress"] += 1
            self._owner.stats["mismatches"] += 1
            return None
        self._owner.stats["hits"] += 1
        self._owner.record_outcome(p, True)
        waited = time.monotonic() - t0
        self._next = j + 1
        if j == 0:
            self._owner.track(self._release_snapshot())  # the pre-speculation state is history now
            if self._home is not None:
                home, self._home = self._home, None
                self._home_destroy = asyncio.ensure_future(self._destroy(home))
        else:
            self._release_checkpoint(j - 1)
        return SpecHit(obs, took, waited, j)

    async def state_after(self, index: int) -> SharedSnapshot | None:
        """A reference to the checkpoint taken after adopted call `index` (None for the last call
        of the chain or a failed checkpoint); the caller releases it."""
        if index >= len(self._checkpoints):
            return None
        try:
            cp = await self._checkpoints[index]
        except SpeculationError:
            return None
        if index in self._released:
            return None
        return cp.acquire()

    def _release_checkpoint(self, i: int) -> None:
        f = self._checkpoints[i]
        if i not in self._released and f.done() and not f.cancelled() and f.exception() is None:
            self._released.add(i)
            f.result().release()

    async def close(self) -> Workspace:
        """Stop speculating; return the workspace in the state after the last adopted call (the
        pre-speculation state when none was adopted). Everything speculative is discarded."""
        if self._closed:
            raise SpeculationError("branch already closed")
        self._closed = True
        try:
            return await self._close()
        finally:
            self._owner.track(self._cleanup(abort_time=time.monotonic()))

    async def _close(self) -> Workspace:
        last = self._next - 1
        if self.exhausted:
            await self._runner
            return self._take_live()
        self._aborted = True
        if last < 0:
            self._kill_live()
            if self._home is not None:  # fork_first: the untouched workspace is the rollback
                home, self._home = self._home, None
                self._owner.workspaces.discard(home)  # the caller's now
                return home
            return await self._take_rollback()
        try:
            # The rollback point must exist before the speculative workspace may go.
            cp = await self._checkpoints[last]
        except Exception:
            # The chain stops at a failed checkpoint, so the workspace is still right after the
            # last adopted call: it is the rollback state itself.
            await asyncio.wait([self._runner])
            if self._started[last + 1] is None and self._live is not None and self._live.is_running():
                return self._take_live()
            raise
        self._kill_live()
        return await cp.fork_async()

    async def _take_rollback(self) -> Workspace:
        assert self._snap is not None
        return await self._snap.fork_async()

    async def _release_snapshot(self) -> None:
        snap, self._snap = self._snap, None
        if snap is not None:
            await snap.release_async()

    def _take_live(self) -> Workspace:
        ws, self._live = self._live, None
        assert ws is not None
        if self._held is ws:
            self._held = None
            ws.release_egress_hold()  # the caller's workspace again, with its own policy
        self._owner.workspaces.discard(ws)  # the caller's now
        return ws

    def _kill_live(self) -> None:
        """Destroy the speculative workspace right away (killing the call it runs); the sample does
        not wait for this. Exactly one destroy per workspace: concurrent destroys of one race."""
        ws, self._live = self._live, None
        if ws is not None:
            self._live_destroy = asyncio.ensure_future(self._destroy(ws))

    async def _destroy(self, ws: Workspace) -> None:
        try:
            await AsyncWorkspace(ws).destroy()
        finally:
            self._owner.workspaces.discard(ws)

    async def _cleanup(self, abort_time: float) -> None:
        # Every step runs even if an earlier one fails: a skipped release would leak a snapshot.
        with contextlib.suppress(BaseException):
            await self._runner
        for pending in (self._live_destroy, self._home_destroy):
            if pending is not None:
                with contextlib.suppress(Exception):
                    await pending
        if self._home is not None:  # close() failed before handing it back
            with contextlib.suppress(Exception):
                await self._destroy(self._home)
            self._home = None
        if self._live is not None:
            with contextlib.suppress(Exception):
                await self._destroy(self._live)
            self._live = None
        await self._release_snapshot()
        for i in range(len(self._checkpoints)):
            with contextlib.suppress(Exception):
                self._release_checkpoint(i)
        for f in [*self._results, *self._checkpoints]:
            if f.done() and not f.cancelled():
                f.exception()  # retrieved: a failed speculation is expected, not an error to log
        for j in range(self._next, len(self.calls)):
            start, end = self._started[j], self._finished[j]
            if start is not None:
                self.wasted_seconds += (end if end is not None else abort_time) - start
        self._owner.record_waste(self.wasted_seconds)
