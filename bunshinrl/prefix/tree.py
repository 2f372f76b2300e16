"""The tool-prefix tree: one root per (task, initial workspace), one edge per tool call."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..calls.signature import ToolCall, extend_signature, root_signature


@dataclass(eq=False)
class Node:
    """The workspace state after `call` from the parent's state, and what that call observed.

    The state can be held in three forms: resident (a retained snapshot in memory: payload),
    on disk (a delta against the nearest ancestor on disk: disk_ref), or neither, in which case
    only the metadata is kept and the state is rebuilt by replaying calls from an ancestor.
    """

    signature: str
    parent: Node | None
    call: ToolCall | None
    task_id: str
    template_digest: str
    depth: int
    children: dict[str, Node] = field(default_factory=dict)
    # Resolved with the observation once the call that creates this node finishes; samples that
    # reach a node whose call is still running wait on it instead of running it again.
    result: Future[str] = field(default_factory=Future)
    exec_seconds: float = 0.0
    payload: Any = None
    payload_bytes: int = 0
    disk_ref: str | None = None
    disk_bytes: int = 0  # what its delta added to the store
    load_bytes: int = 0  # what restoring it from disk reads
    sparse: bool = False  # never captured, by the sparse-snapshot policy
    capturing: Future[None] | None = None
    last_used: int = 0
    resident_below: int = 0  # resident nodes in this node's subtree, itself excluded
    pins: int = 0
    hits: int = 0
    removed: bool = False
    created: float = field(default_factory=time.monotonic)

    @property
    def resident(self) -> bool:
        return self.payload is not None

    @property
    def form(self) -> str:
        if self.resident:
            return "resident"
        return "disk" if self.disk_ref else "metadata"

    @property
    def done(self) -> bool:
        return self.result.done() and self.result.exception() is None

    @property
    def observation(self) -> str | None:
        return self.result.result() if self.done else None

    def ancestors(self) -> Iterator[Node]:
        n = self.parent
        while n is not None:
            yield n
            n = n.parent

    def path(self) -> list[Node]:
        """The nodes from the root down to this one."""
        out = [self, *self.ancestors()]
        out.reverse()
        return out

    def calls(self) -> list[ToolCall]:
        return [n.call for n in self.path() if n.call is not None]

    def __repr__(self) -> str:
        last = self.call.key if self.call else "<root>"
        return f"<Node {self.task_id} d={self.depth} {last[:40]} {self.form}>"


class PrefixTree:
    def __init__(self) -> None:
        self.roots: dict[tuple[str, str], Node] = {}
        self.index: dict[str, Node] = {}

    def root(self, task_id: str, template_digest: str, create: bool = False) -> Node | None:
        key = (task_id, template_digest)
        node = self.roots.get(key)
        if node is None and create:
            node = Node(root_signature(task_id, template_digest), None, None, task_id, template_digest, 0)
            node.result.set_result("")
            self.roots[key] = node
            self.index[node.signature] = node
        return node

    def child(self, node: Node, call: ToolCall) -> Node | None:
        return node.children.get(call.key)

    def add_child(self, node: Node, call: ToolCall) -> Node:
        if call.key in node.children:
            raise ValueError(f"{node} already has a child for {call.key}")
        c = Node(extend_signature(node.signature, call), node, call, node.task_id, node.template_digest,
                 node.depth + 1)
        node.children[call.key] = c
        self.index[c.signature] = c
        return c

    def remove(self, node: Node) -> list[Node]:
        """Detach `node` and its subtree; returns every removed node."""
        gone = list(self.subtree(node))
        if node.parent is not None:
            node.parent.children.pop(node.call.key, None)  # type: ignore[union-attr]
        else:
            self.roots.pop((node.task_id, node.template_digest), None)
        for n in gone:
            n.removed = True
            self.index.pop(n.signature, None)
        return gone

    def subtree(self, node: Node) -> Iterator[Node]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def nodes(self) -> Iterator[Node]:
        for r in list(self.roots.values()):
            yield from self.subtree(r)
