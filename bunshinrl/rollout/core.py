"""The rollout core: one sample's tool calls, one at a time, over the prefix cache and speculation.

Every driver shares it: RolloutEngine (our own GRPO loop), verl's agent loop and SkyRL's env.
A driver starts a Rollout for a sample, calls `await rollout.call(tool_call)` for each tool call
its model makes, `await rollout.finish(answer)` when the model is done (the task's verifier then
runs on the state the trajectory built) and `await rollout.close()`.

Where a sample's state lives is explicit (Rollout.state):

    Idle         no workspace of its own: its state is the prefix-cache node it stands on
                 (a shadow may be rebuilding that state ahead of an expected miss)
    Live         a workspace in the state after the last call
    Settling     that workspace is being captured for the cache and/or handed to a speculative
                 branch, while the policy reasons; the next call waits for it
    Speculating  a speculative branch owns the workspace and runs predicted calls
    Closed

and `Rollout.node` is its position in the prefix tree (None once it has left the tree). A call
is served, in order, by a speculative branch that predicted exactly it (adopted), by the prefix
cache (skipped: the recorded observation, the sample moves to the child node and drops its
workspace), or run for real from the state of the last call served (a miss: the branch is rolled
back, or the cached state is materialised by a fork, a disk load or a replay).

The critical path (paper Fig. 3, adapted to engines whose capture is not free):
- A sample served from the cache keeps a warm workspace behind it where its next call is
  predicted to miss (the tree's frontier, or the selector's or the node's odds; warm="always":
  behind every hit; bunshinrl.rollout.warm_policy): the workspace it held is brought to the new
  state in the background while the policy reasons (the skipped call replayed on it, or a fork
  of the state when that is cheaper), so a later miss adopts it without a fork on its path.
  Behind a hit predicted to be followed by another, nothing runs: a miss the prediction did not
  see coming rebuilds the state on the path (materialize). Every sample's root state is
  prefetched, as Base overlaps its group's fork with the first reasoning step.
- A state is captured after its call only when the reasoning step that follows is predicted to
  outlast the capture (RolloutCore.reasoning, ToolPrefixCache.capture_seconds) and another
  sample is expected to come by (an off-tree straggler's states are not captured unless the
  selector predicts the call); a second visitor's warm workspace captures a state that was not.
  A misprediction is paid as post_wait on the sample's path.
- When a cached path ends (the node has no children: the next call is likely a miss) and the
  selector predicts a chain, the chain is speculated on the warm workspace.

The invariant: a sample's workspace is exactly the history it was shown. A warm workspace whose
replay diverged is destroyed (Diverged), never adopted nor speculated on; the next call rebuilds
the state from the deepest captured state on the sample's path, replaying and comparing every
served observation, and a step that does not reproduce rewinds the sample to it (Rewound).
finish() is such a call too: before the verifier scores (its own call may be a hit), the replays
behind the hits the sample was served are awaited, or, where no warm workspace was kept, the
state is rebuilt and verified then, so caching never changes a reward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from .._async import run_blocking
from ..calls.guard import DeterminismGuard
from ..prefix.budget import ResidentBudget
from ..prefix.cache import ToolPrefixCache
from ..speculation.selector import SelectorReport, train_selector
from ..speculation.speculator import Speculator
from ..speculation.tail import TailPolicy
from .reasoning import ReasoningClock
from .sample import Rollout
from .sample_state import Closed, Diverged, Idle, Live, Rewound, Settling, Speculating, State
from .starts import Starts
from .warm_policy import WarmPolicy


class RolloutCore(Starts):
    """What every rollout driver shares: the prefix cache, the speculator, the determinism guard,
    the tail policy and the memory engine; the workspaces alive right now (memory sampling),
    background work, and every finished trajectory (the selector's training data).

    cache=None and speculator=None is plain memory sharing (Base). prefetch: warm workspaces
    behind cache hits and the root prefetched (see the module doc); warm: behind which hits
    ("always", or "predicted": where the next call is predicted to miss; warm_policy); reasoning: what predicts the
    next reasoning step (default: the steps seen); verify_seconds: how long a finishing sample
    waits for the replay behind its last cache hit before its state is rebuilt and verified from
    the cache instead (None: no limit). Build one with bunshinrl.rollout.wiring.build_core.
    """

    def __init__(self, *, cache: ToolPrefixCache | None = None, speculator: Speculator | None = None,
                 guard: DeterminismGuard | None = None, tail: TailPolicy | None = None, memory: str = "auto",
                 prefetch: bool = True, keep_initial: bool = False, overlap_fork: bool = False,
                 reasoning: ReasoningClock | None = None, critical_path_captures: bool = True,
                 verify_seconds: float | None = 300.0, warm: WarmPolicy = "predicted",
                 cache_share: float | None = None) -> None:
        super().__init__(cache=cache, speculator=speculator, guard=guard, tail=tail, memory=memory, prefetch=prefetch,
                         keep_initial=keep_initial, overlap_fork=overlap_fork, reasoning=reasoning,
                         critical_path_captures=critical_path_captures, verify_seconds=verify_seconds, warm=warm)
        # The resident budget follows the rollouts' own workspaces (issue 38: Full's peak within
        # 1.1x Base's): the cache holds what they leave under cache_share x their highest level.
        # None: the cache's budget as given.
        if cache_share is not None and cache_share < 0:
            raise ValueError(f"cache_share must be >= 0 or None, not {cache_share}")
        self.budget = ResidentBudget(cache, cache_share) if cache is not None and cache_share is not None else None

    # ---- what every rollout reports back ----

    def fit_selector(self, held_out_epochs: Sequence[int] = ()) -> SelectorReport | None:
        """Train the speculator's selector on every recorded trajectory."""
        if self.speculator is None or not self.history:
            return None
        with self._lock:
            history = sorted(self.history, key=lambda t: (t.epoch, t.task_id, t.sample))
        sel, report = train_selector(history, held_out_epochs=held_out_epochs)
        self.speculator.selector = sel
        return report

    def stats(self) -> dict[str, Any]:
        cache = self.cache.stats() if self.cache is not None else None
        if cache is not None:
            cache["warm"] = dict(self.warm_stats)  # hits behind which a warm workspace was kept or not
            if self.budget is not None:
                cache["budget"] = self.budget.stats()  # the budget that followed the workspaces
        return {"cache": cache,
                "speculation": self.speculator.report() if self.speculator is not None else None,
                "guard": self.guard.report()}

    async def drain(self) -> None:
        """Wait for every background capture, teardown and persist."""
        await self.drain_rollouts()
        if self.cache is not None:
            await run_blocking(self.cache.drain)

    def start_persistence(self) -> Future[float] | None:
        """Start the cache's deferred persists (the gap between epochs); a future of the seconds
        they took, None without a cache."""
        if self.cache is None:
            return None
        cache = self.cache
        fut: Future[float] = Future()

        def work() -> None:
            t = time.monotonic()
            try:
                cache.drain()
            finally:
                fut.set_result(time.monotonic() - t)

        threading.Thread(target=work, name="bunshinrl-persist-epoch", daemon=True).start()
        return fut

    async def close(self) -> None:
        """Drain, then release the initialized snapshots keep_initial kept."""
        await self.drain()
        with self._lock:
            futs, self._initial = list(self._initial.values()), {}
        for f in futs:
            if f.done() and f.exception() is None:
                await f.result().release_async()


__all__ = ["Closed", "Diverged", "Idle", "Live", "Rewound", "Rollout", "RolloutCore", "Settling", "Speculating",
           "State"]
