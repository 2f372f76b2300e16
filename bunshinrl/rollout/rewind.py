"""Rebuilding a sample's verified state after a divergence, and rewinding it to the step that
did not reproduce (Rewound)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from bunshinfork import Workspace

from ..calls.policy import Step
from ..prefix.cache import Plan, ReplayDiverged
from .sample_state import Live, Rewound


class Rewinding:
    """A verified rebuild and the rewind after it (a Rollout mixin)."""

    async def _verified_rebuild(self, since: float | None, on_plan: Callable[[Plan], None] | None = None) -> Workspace:
        """The sample's state, forked from the deepest captured state on its path with the calls
        below it replayed and compared (since: when a divergence sent us here, for its cost;
        on_plan: told the cache's plan)."""
        cache = self.core.cache
        assert cache is not None and self.node is not None
        removed = self.node.removed  # a sample standing on a dropped subtree, revalidated
        try:
            ws = await cache.materialize(self.node, self.tools, on_plan=on_plan)
        except ReplayDiverged as e:
            self.timeline.diverged(mid_plan=e.index > 0, removed_node=removed,
                                   outcome="rewound" if self.rewinds else "refused")
            # A warm workspace destroyed before this rebuild diverged too: this rewind answers it.
            self.timeline.settle_divergences("destroyed_rewound")
            await self._rewind(e)
        if since is not None:
            self.timeline.divergence_seconds += self.now() - since
        return ws

    async def _rewind(self, e: ReplayDiverged) -> NoReturn:
        """Step j (the one that moved the sample to the node whose replay diverged) did not
        reproduce: the history is cut back to j with the fresh observation, the workspace (in the
        state after that fresh call) is the sample's, off the tree, and Rewound tells the driver."""
        ws = self.core.workspaces.add(e.workspace)
        j = next((i for i, n in enumerate(self._nodes) if n is e.node and e.node is not None), None)
        if j is None or e.fresh is None:
            await self.core.destroy(ws)
            self.timeline.set_last_outcome("refused")  # the sample ends with the error, scored nothing
            raise RuntimeError(f"a replay diverged off this sample's path: {e}") from e
        self._enter(Live(ws))
        self.node = None
        await self.note_fork(ws)
        dropped = len(self.history) - j
        self.timeline.rewound += 1
        self.timeline.rewound_steps += dropped
        self.timeline.rewound_seconds += self.now() - self._started[j]
        fresh = Step(self.history[j].call, e.fresh, self.history[j].decision)
        self.history[j:] = [fresh]
        self.served[j:] = ["executed"]
        self._nodes[j:] = [None]
        self._started[j:] = [self._started[j]]
        self.timeline.steps[j:] = [fresh]
        self.timeline.errors.append(f"rewound to step {j}: {e}")
        self.refused = not self.rewinds
        raise Rewound(j, e.fresh, dropped)
