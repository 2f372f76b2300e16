"""The invariant of bunshinrl: a sample's workspace is exactly the history it was shown.

Here: what the prefix cache serves. A subtree dropped because a tool in it turned out
non-deterministic serves nothing, to a sample standing inside it either."""

from __future__ import annotations

from rl_support import counter_task

from bunshinrl import ToolCall, ToolPrefixCache

C = ToolCall


def test_hits_under_a_removed_node_are_refused() -> None:
    """A tool found non-deterministic drops its subtrees; a sample standing inside one must get
    no hit for its other tools (the tree keeps the removed nodes' children)."""

    class Payloads:
        persists = False

        def size(self, payload: object) -> int:
            return 1

        def release(self, payload: object) -> None:
            pass

    tools = counter_task().tools
    cache = ToolPrefixCache(Payloads(), 1 << 40, background=False)  # type: ignore[arg-type]
    root = cache.add_root("task", "tmpl", object())
    path = [root]
    for call, obs in [(C("liar"), "tick 1"), (C("bump", {"n": 1}), "1"), (C("touch", {"name": "a"}), "a")]:
        node, created = cache.begin(path[-1], call)
        assert created
        cache.complete(node, obs, 0.1)
        path.append(node)
    _root, liar, bump, touch = path
    assert cache.lookup(bump, C("touch", {"name": "a"}), tools["touch"]) is touch
    assert not cache.guard.check(C("liar"), "tick 1", "tick 2", source="replay")  # drops liar's subtree
    assert liar.removed and bump.removed and touch.removed
    assert cache.lookup(bump, C("touch", {"name": "a"}), tools["touch"]) is None
    assert cache.lookup(liar, C("bump", {"n": 1}), tools["bump"]) is None
    below, created = cache.begin(bump, C("state"))  # recorded below a dropped subtree: dropped too
    assert created and below.removed
    cache.complete(below, "x", 0.1)
    assert cache.lookup(bump, C("state"), tools["state"]) is None
    cache.close()
