"""Ancestor-aware LRU over the resident nodes of a prefix tree.

The resident set is kept ancestor-closed: a resident node's captured ancestors are resident too,
or have a copy on disk (sparse nodes, which never had a snapshot, are the other gaps).
Reconstruction then always finds a retained ancestor on the path, and a lookup walking down from
the root meets retained states first. Touching a node refreshes its ancestors as well, so an
ancestor is never older than its descendants, and eviction only takes nodes with no resident
descendant. A copy on disk closes the gap because without it the closure was a trap: a state
captured while the budget had no room went to disk only, and so did every state captured below
it afterwards and every restore below it, however much room came later, so each hit there
restored from disk or replayed from the root, with the cache at a third of its budget (issue 38).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .tree import Node


class AncestorLRU:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity = capacity_bytes
        self.resident: set[Node] = set()
        self.resident_bytes = 0
        self.root_bytes = 0  # of resident roots (the tasks' initialized states), within resident_bytes
        self._clock = 0

    def touch(self, node: Node) -> None:
        self._clock += 1
        node.last_used = self._clock
        for a in node.ancestors():
            a.last_used = self._clock

    @staticmethod
    def held(node: Node) -> bool:
        """Whether `node` closes the set above a resident descendant: resident, on disk, or
        never captured."""
        return node.resident or node.sparse or node.disk_ref is not None

    def may_hold(self, node: Node) -> bool:
        """Whether making `node` resident keeps the set ancestor-closed."""
        return all(self.held(a) for a in node.ancestors())

    def add(self, node: Node, payload: Any, size: int) -> None:
        if node.resident:
            raise ValueError(f"{node} is already resident")
        if not self.may_hold(node):
            raise ValueError(f"{node} has a captured ancestor neither resident nor on disk")
        node.payload, node.payload_bytes = payload, size
        self.resident.add(node)
        self.resident_bytes += size
        self.root_bytes += size if node.parent is None else 0
        for a in node.ancestors():
            a.resident_below += 1
        self.touch(node)

    def resize(self, node: Node, size: int) -> None:
        """Record a resident state's current size (a copy-on-write snapshot grows over time)."""
        if not node.resident:
            raise ValueError(f"{node} is not resident")
        self.resident_bytes += size - node.payload_bytes
        self.root_bytes += size - node.payload_bytes if node.parent is None else 0
        node.payload_bytes = size

    def drop(self, node: Node) -> Any:
        """Make `node` non-resident and return its payload for the caller to release."""
        if node.resident_below:
            raise ValueError(f"{node} still has resident descendants")
        payload = node.payload
        node.payload = None
        self.resident.discard(node)
        self.resident_bytes -= node.payload_bytes
        self.root_bytes -= node.payload_bytes if node.parent is None else 0
        node.payload_bytes = 0
        for a in node.ancestors():
            a.resident_below -= 1
        return payload

    def evict(self, can_drop: Callable[[Node], bool]) -> list[tuple[Node, Any]]:
        """Drop least recently used leaves of the resident set until it fits the capacity.

        Pinned nodes (being forked or persisted) and nodes `can_drop` refuses are skipped; when
        nothing can go the set stays over capacity until the next call.
        """
        out = []
        while self.resident_bytes > self.capacity:
            leaves = [n for n in self.resident if n.resident_below == 0 and n.pins == 0 and can_drop(n)]
            if not leaves:
                break
            # Roots go last: every sample of a task starts from its root.
            victim = min(leaves, key=lambda n: (n.parent is None, n.last_used, -n.depth))
            out.append((victim, self.drop(victim)))
        return out

    def violations(self) -> list[str]:
        """Invariant breaches, for tests: ancestor closure, recency order, counters."""
        bad = []
        for n in self.resident:
            for a in n.ancestors():
                if not self.held(a):
                    bad.append(f"{n} is resident but its ancestor {a} is neither resident nor on disk")
                if a.last_used < n.last_used:
                    bad.append(f"{a} was used less recently than its descendant {n}")
        for n in list(self.resident) + [a for r in self.resident for a in r.ancestors()]:
            below = sum(1 for m in self.resident if n in m.ancestors())
            if below != n.resident_below:
                bad.append(f"{n} counts {n.resident_below} resident descendants, has {below}")
        if sum(n.payload_bytes for n in self.resident) != self.resident_bytes:
            bad.append("resident_bytes does not match the resident payloads")
        if sum(n.payload_bytes for n in self.resident if n.parent is None) != self.root_bytes:
            bad.append("root_bytes does not match the resident roots' payloads")
        return bad
