"""Captures: after a real call the new state is captured for the cache (when the reasoning step
that follows is predicted to outlast the capture and another sample is expected to come by),
and/or handed to a speculative chain, while the policy reasons."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bunshinfork import Workspace

from ..calls.signature import ToolCall
from ..calls.task import REWARD_TOOL
from ..prefix.recording import Recording
from ..prefix.tree import Node
from ..speculation.selector import SelectorContext, is_fitted
from ..speculation.speculator import SpeculativeBranch
from ..states.backend import SharedSnapshot
from .sample_state import Live, Settling, Speculating


class Captures:
    """A sample's captures of its states for the cache (a Rollout mixin)."""

    def _capture_context(self, node: Node) -> dict[str, Any]:
        """What the cache weighs a capture of `node` with: the next step's predicted reasoning and
        whether another sample is expected there."""
        if not self.core.critical_path_captures:
            return {"reasoning": None, "revisit": True}
        return {"reasoning": self.core.reasoning.predict(), "revisit": self._revisit_expected(node)}

    def _revisit_expected(self, node: Node) -> bool:
        """Will another sample come by `node`? Yes below the root and where its parent had a
        visitor besides its creator; on a path only this sample took (an off-tree straggler),
        only when the selector predicts the call from the parent's state."""
        parent = node.parent
        if parent is None or parent.parent is None or parent.hits > 0:
            return True
        spec = self.core.speculator
        sel = spec.selector if spec is not None else None
        if sel is None or not is_fitted(sel) or node.call is None:
            return False
        calls = tuple(h.call for h in self.history if h.call.name != REWARD_TOOL)
        top = sel.top_k(SelectorContext(self.task.id, calls), 1)
        return bool(top) and top[0][0] == node.call.key and top[0][1] >= 0.5

    def _after_real_call(self, call: ToolCall, capture: Recording | None) -> None:
        """Capture the new state for the cache and/or start speculating, while the policy reasons."""
        core = self.core
        assert isinstance(self.state, Live)
        calls = [h.call for h in self.history] + [call]
        chain = core.speculation_chain(self.task.id, self.ctx.sample, calls, self.tools,
                                       real_calls=self.timeline.count("tool"))
        if capture is None and not chain:
            return
        ws = self.state.ws
        self._enter(Settling(ws, asyncio.ensure_future(self._post_call(ws, capture, chain))))

    async def _post_call(self, ws: Workspace, capture: Recording | None, chain: list[ToolCall]) -> Live | Speculating:
        core = self.core
        try:
            t = time.monotonic()
            snap = await SharedSnapshot.take_async(ws, core.memory)
            took = time.monotonic() - t
            core.note_snapshot(self.task.id, took)
        except Exception as e:
            self.timeline.errors.append(f"capture failed: {e!r}")
            if capture is not None:
                capture.attach(None)
            return Live(ws)
        try:
            if capture is not None:
                capture.attach(snap.acquire(), capture_seconds=took)
            if chain and core.speculator is not None:
                try:
                    branch = await core.speculator.launch(ws, chain, self.tools, snapshot=snap)
                except Exception as e:
                    self.timeline.errors.append(f"speculation not started: {e!r}")
                    return Live(ws)
                self.branches.append(branch)
                core.workspaces.discard(ws)  # held by the branch now
                return Speculating(branch)
            return Live(ws)
        finally:
            await snap.release_async()

    async def _attach_checkpoint(self, rec: Recording, branch: SpeculativeBranch, index: int) -> None:
        rec.attach(await branch.state_after(index))

    async def _capture_for_second_visitor(self, ws: Workspace, node: Node, since: float) -> None:
        """This warm workspace is a second visitor's copy of `node`'s state: capture it when the
        cache wants it and what is left of the reasoning step is predicted to outlast a capture."""
        cache = self.core.cache
        assert cache is not None
        predicted = self.core.reasoning.predict()
        left = None if predicted is None else predicted - (time.monotonic() - since)
        rec = cache.claim(node, left) if node.parent is not None else None
        if rec is None:
            return
        try:
            t = time.monotonic()
            snap = await SharedSnapshot.take_async(ws, self.core.memory)
            took = time.monotonic() - t
            self.core.note_snapshot(self.task.id, took)
        except Exception as e:
            self.timeline.errors.append(f"capture failed: {e!r}")
            rec.attach(None)
            return
        try:
            rec.attach(snap.acquire(), capture_seconds=took)
        finally:
            await snap.release_async()
