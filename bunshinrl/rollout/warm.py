"""Warm workspaces: a sample served from the cache keeps a workspace behind it, brought to the
new state in the background while the policy reasons (the skipped call replayed on it, or a fork
of the state when that is cheaper), so a later miss adopts it without a fork on its path. A warm
workspace whose replay diverged is destroyed (Diverged), never adopted."""

from __future__ import annotations

import asyncio
import time
from typing import NoReturn

from bunshinfork import Workspace

from ..calls.signature import ToolCall
from ..prefix.cache import Plan, ReplayDiverged
from ..prefix.tree import Node
from ..speculation.speculator import SpeculativeBranch
from .sample_state import Diverged, Idle, Live, Settling, Speculating


class WarmWorkspaces:
    """The warm workspace kept behind a sample served from the cache (a Rollout mixin)."""

    def _move_to(self, call: ToolCall, child: Node) -> None:
        """The sample moves to a cached state. Without prefetch, or where the core's warm policy
        predicts the next call hits too (bunshinrl.rollout.warm_policy), its workspace goes;
        otherwise it is kept warm: brought to the child's state in the background (a replay of
        the skipped call, or a fork of the child's state when that is cheaper), and at the tree's
        frontier a predicted chain is speculated on it."""
        st, self.node = self.state, child
        cache = self.core.cache
        assert cache is not None
        calls = [h.call for h in self.history] + [call]
        if not self.core.prefetch or not self.core.keep_warm(child, self.task.id, calls):
            # No warm workspace: a later miss rebuilds the state from the cache, verified there.
            if isinstance(st, Speculating):
                self.core.background(self._close_and_destroy(st.branch))
            elif isinstance(st, Live):
                self.core.background(self.core.destroy(st.ws))
            elif isinstance(st, Idle):
                self._discard_shadow(st.shadow)
            self._shadow_replays = 0
            self._enter(Idle())
            return
        prev: asyncio.Future[Workspace] | None = None
        if isinstance(st, Live):
            prev = asyncio.get_running_loop().create_future()
            prev.set_result(st.ws)
        elif isinstance(st, Speculating):
            prev = asyncio.ensure_future(self._close_branch(st.branch))
        elif isinstance(st, Idle):
            prev = st.shadow
        # How many calls the warm workspace will have replayed (a divergence past the first is mid-plan).
        replayed = self._shadow_replays if isinstance(st, Idle) and st.shadow is not None else 0
        if prev is not None and child.exec_seconds <= cache.rebuild_seconds(child):
            warm = asyncio.ensure_future(self._extend_shadow(prev, child, mid_plan=replayed > 0))
            self._shadow_replays = replayed + 1
        else:
            self._discard_shadow(prev)
            warm = asyncio.ensure_future(self._rebuild(child))
            self._shadow_replays = 0
        self._enter(Idle(warm))
        if self.core.speculator is not None and not child.children:
            chain = self.core.speculation_chain(self.task.id, self.ctx.sample, calls, self.tools,
                                                real_calls=self.timeline.count("tool"))
            if chain:
                replays = self._shadow_replays or self._rebuild_replays(child)
                self._enter(Settling(None, asyncio.ensure_future(self._speculate_on(warm, chain, replays)),
                                     "materialize"))

    @staticmethod
    def _rebuild_replays(node: Node) -> int:
        """Whether a rebuild of `node` replays a recorded call (0: a fork of its captured state)."""
        captured = node.resident or (node.capturing is not None and not node.capturing.done())
        return 0 if captured else 1

    async def _close_branch(self, branch: SpeculativeBranch) -> Workspace:
        return self.core.workspaces.add(await branch.close())

    async def _materialize(self, st: Idle) -> None:
        """A workspace in the state of the sample's history. The warm one when its replays all
        matched; otherwise (a replay diverged: that workspace is gone) one rebuilt from the deepest
        captured state on the sample's path, every served observation replayed and compared. A
        step that does not reproduce rewinds the sample to it (Rewound)."""
        tl = self.timeline
        t = self.now()
        assert self.core.cache is not None and self.node is not None
        ws: Workspace | None = None
        diverged = False
        detail = "warm"  # what the path waited for: the warm workspace, or the rebuild's plan
        if st.shadow is not None:
            try:
                ws = await st.shadow
            except Diverged:
                diverged = True
            except Exception as e:
                tl.errors.append(f"prefetch failed: {e!r}")
        if ws is None:
            plans: list[Plan] = []
            ws = await self._verified_rebuild(t if diverged else None, on_plan=plans.append)
            detail = plans[-1].describe() if plans else "rebuilt"
        # The sample's state is verified: a warm workspace destroyed on the way is accounted for.
        self.timeline.settle_divergences("destroyed_reproduced")
        if self.node is not None and self.node.removed:
            self.node = None  # verified, but nothing is recorded under a dropped subtree
        self._enter(Live(self.core.workspaces.add(ws)))
        await self.note_fork(ws)
        tl.add("materialize", t, self.now(), detail)

    async def _verify_served(self) -> None:
        """Before the sample finishes: the replays behind the cache hits it was served (its warm
        workspace, still being brought to the last hit's state) are awaited and the workspace
        adopted (_materialize), so a step that does not reproduce rewinds the sample (Rewound)
        before anything is scored. A warm workspace not ready within the core's verify_seconds
        is left to be destroyed when it is, and the state rebuilt and verified from the cache."""
        st = self.state
        if not isinstance(st, Idle) or self.core.cache is None or self.node is None:
            return  # nothing pending: a workspace of its own
        if st.shadow is None:
            if self.core.prefetch:
                # Served without a warm workspace (the warm policy predicted another hit): the
                # state is rebuilt and verified now, on the path.
                await self._materialize(st)
            return  # without prefetch: no replay behind the hits
        shadow = st.shadow
        if not shadow.done():
            done, _ = await asyncio.wait({shadow}, timeout=self.core.verify_seconds)
            if not done:
                self.timeline.errors.append(f"the warm workspace was not verified within {self.core.verify_seconds:g} "
                                            "s: the state is rebuilt from the cache")
                self._discard_shadow(shadow)
                st = Idle()
        await self._materialize(st)

    async def _rebuild(self, node: Node) -> Workspace:
        assert self.core.cache is not None
        t = time.monotonic()
        removed = node.removed
        try:
            ws = self.core.workspaces.add(await self.core.cache.materialize(node, self.tools))
        except ReplayDiverged as e:
            await self._lose_diverged(e, mid_plan=e.index > 0, removed_node=removed)
        await self._capture_for_second_visitor(ws, node, t)
        return ws

    async def _extend_shadow(self, previous: asyncio.Future[Workspace], node: Node, mid_plan: bool) -> Workspace:
        """The warm workspace brought from the previous shadow's state to `node`'s by replaying
        its call. A previous shadow that diverged or failed left no workspace: its error is
        passed on and nothing is replayed."""
        t = time.monotonic()
        ws = await previous
        assert self.core.cache is not None
        removed = node.removed
        try:
            await self.core.cache.materialize(node, self.tools, warm=ws)
        except ReplayDiverged as e:
            await self._lose_diverged(e, mid_plan=mid_plan, removed_node=removed)
        except BaseException:
            await self.core.destroy(ws)
            raise
        await self._capture_for_second_visitor(ws, node, t)
        return ws

    async def _lose_diverged(self, e: ReplayDiverged, *, mid_plan: bool, removed_node: bool) -> NoReturn:
        """A warm workspace's replay diverged: it is destroyed, never adopted (Diverged). Its
        outcome waits for the sample's next verified state (destroyed_rewound or
        destroyed_reproduced, SampleTimeline.settle_divergences)."""
        index = self.timeline.diverged(mid_plan=mid_plan, removed_node=removed_node)
        self.timeline.errors.append(str(e))
        await self.core.destroy(self.core.workspaces.add(e.workspace))
        raise Diverged(str(e), index) from None

    def _discard_shadow(self, shadow: asyncio.Task[Workspace] | None) -> None:
        if shadow is None:
            return

        async def discard() -> None:
            try:
                ws = await shadow
            except Exception:
                return  # a diverged or failed shadow left no workspace
            await self.core.destroy(ws)

        self.core.background(discard())
