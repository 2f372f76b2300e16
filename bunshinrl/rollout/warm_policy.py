"""Whether a sample served from the cache keeps a warm workspace behind it (issue 38).

A warm workspace is brought to each cached state the sample moves to (a replay of the skipped
call, or a fork of the state) so that a later miss finds it ready. Behind a hit that is followed
by another hit that work is thrown away, and on a host with few cores it competes with the
calls on the path. With the "predicted" policy a warm workspace is kept only where the next
call is predicted to miss: at the tree's frontier (the node has no child: nothing to hit), or
where the selector (fitted) or, before it is, the node's own record gives the next call less
than even odds of being one of the node's children (the episode's end counts as a miss: the
sample's state is verified before it is scored). Elsewhere the sample goes on without one, and
a later miss, or a finish the prediction did not see coming, rebuilds its state from the
deepest captured state on its path, every served call below it replayed and compared there (on
the path: the timeline's materialize).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..calls.signature import ToolCall
from ..calls.task import REWARD_TOOL
from ..prefix.tree import Node
from ..speculation.selector import SelectorContext, ToolSelector, is_fitted

WarmPolicy = Literal["always", "predicted"]
WARM_POLICIES: tuple[WarmPolicy, ...] = ("always", "predicted")


def check_warm_policy(policy: str) -> WarmPolicy:
    if policy not in WARM_POLICIES:
        raise ValueError(f"warm must be one of {WARM_POLICIES}, not {policy!r}")
    return policy  # type: ignore[return-value]


def hit_probability(node: Node, task_id: str, calls: Sequence[ToolCall], selector: ToolSelector | None) -> float:
    """The chance that the agent's call after `calls` (the sample now stands on `node`) is one of
    `node`'s children. From the selector's distribution over the next call when it is fitted;
    before that, from how the node's earlier visitors left it: the share of them that hit a
    child, Laplace-smoothed (a child's first visitor created it, a miss). The end of the episode
    counts as a miss: nothing is scored on an unverified state, so a sample that finishes needs
    its workspace (Rollout.finish)."""
    agent = {k: c for k, c in node.children.items() if c.call is None or c.call.name != REWARD_TOOL}
    if not agent:
        return 0.0
    if is_fitted(selector):
        assert selector is not None
        proba = selector.predict_proba([SelectorContext(task_id, tuple(calls))])[0]
        return float(sum(p for label, p in zip(selector.classes_, proba, strict=True) if str(label) in agent))
    hits = sum(c.hits for c in agent.values())
    departures = sum(c.hits + 1 for c in node.children.values())
    return (hits + 1) / (departures + 2)


def keep_warm(policy: WarmPolicy, node: Node, task_id: str, calls: Sequence[ToolCall],
              selector: ToolSelector | None) -> bool:
    """Whether a warm workspace is kept behind the hit that moved the sample to `node`."""
    if policy == "always":
        return True
    return hit_probability(node, task_id, calls, selector) < 0.5


__all__ = ["WARM_POLICIES", "WarmPolicy", "check_warm_policy", "hit_probability", "keep_warm"]
