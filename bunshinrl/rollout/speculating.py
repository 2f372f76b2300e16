"""Speculation glue: a predicted chain launched at the tree's frontier on the sample's warm
workspace, and a speculative hit adopted (the cache learns the call like a real one)."""

from __future__ import annotations

import asyncio

from bunshinfork import Workspace

from ..calls.signature import ToolCall
from ..speculation.speculator import SpecHit, SpeculativeBranch
from .sample_state import Diverged, Idle, Live, Speculating


class SpeculationGlue:
    """Where a sample's rollout meets its speculative branches (a Rollout mixin)."""

    async def _speculate_on(self, warm: asyncio.Future[Workspace], chain: list[ToolCall],
                            replays: int = 1) -> Live | Speculating | Idle:
        """Speculation at the tree's frontier: the chain runs on the sample's warm workspace.
        Nothing speculates on a workspace whose replay diverged: it is gone, and the next call
        (or finish()) meets the divergence again, then rebuilds and verifies the sample's state
        (Idle with the diverged shadow, as a sample that did not speculate). replays: the served
        calls the warm workspace replays (0: a fork of a captured state, which cannot diverge)."""
        self.timeline.speculation_checks += replays > 0
        try:
            ws = await warm
        except Diverged as d:
            # Counted as it was met; the chain meant for the workspace is its kind too (flagged
            # once, however many chains meet the same diverged shadow).
            self.timeline.flag_speculation(d.index)
            return Idle(warm)  # type: ignore[arg-type]
        except Exception as e:
            self.timeline.errors.append(f"prefetch failed: {e!r}")
            return Idle()
        await self.note_fork(ws)
        assert self.core.speculator is not None
        try:
            branch = await self.core.speculator.launch(ws, chain, self.tools)
        except Exception as e:
            self.timeline.errors.append(f"speculation not started: {e!r}")
            return Live(ws)
        self.branches.append(branch)
        self.core.workspaces.discard(ws)  # held by the branch now
        return Speculating(branch)

    async def _adopt(self, call: ToolCall, hit: SpecHit) -> None:
        """The sample moves to the speculative state; the cache learns the call like a real one."""
        core = self.core
        assert isinstance(self.state, Speculating)
        branch = self.state.branch
        capture = None
        if core.cache is not None and self.node is not None:
            rec = core.cache.begin(self.node, call)
            if rec.created and rec.complete(hit.observation, hit.exec_seconds, **self._capture_context(rec.node)):
                if branch.exhausted:
                    capture = rec  # captured below, from the adopted workspace
                else:
                    # The chain runs on; the checkpoint taken after this call is the node's state.
                    core.background(self._attach_checkpoint(rec, branch, hit.index))
            self.node = rec.node if rec.created else \
                await self._same_as_sibling(call, rec.node, hit.observation, speculation=True)
        if branch.exhausted:
            self._enter(Live(core.workspaces.add(await branch.close())))
            self._after_real_call(call, capture)

    async def _close_and_destroy(self, branch: SpeculativeBranch) -> None:
        await self.core.destroy(await branch.close())
