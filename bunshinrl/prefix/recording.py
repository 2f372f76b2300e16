"""A recording handle: what begin() (a call about to run) or claim() (a second visitor's copy of a
known state) hands the sample that records a node, so that the sample holds a handle's three
verbs (complete, abandon, attach) instead of the cache's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from .tree import Node


class RecordingCache(Protocol):
    """What a Recording asks of its cache (ToolPrefixCache)."""

    def complete(self, node: Node, observation: str, exec_seconds: float, *, reasoning: float | None = None,
                 revisit: bool = True) -> bool: ...

    def abandon(self, node: Node, error: BaseException) -> None: ...

    def attach(self, node: Node, payload: Any | None) -> None: ...

    def note_capture(self, seconds: float, task_id: str | None = None) -> None: ...


class Recording:
    """The recording of `node`. created: this caller made the node (begin()) and must complete()
    or abandon() it; False: another sample made it (begin() found it) or it is known already
    (claim()), and only attach() applies. Unpacks as (node, created), the pair begin() returned
    before it returned handles."""

    def __init__(self, cache: RecordingCache, node: Node, created: bool) -> None:
        self._cache = cache
        self.node = node
        self.created = created

    def __iter__(self) -> Iterator[Any]:
        return iter((self.node, self.created))

    def complete(self, observation: str, exec_seconds: float, *, reasoning: float | None = None,
                 revisit: bool = True) -> bool:
        """Record the call's observation; True when the caller should capture the state and
        attach() it (ToolPrefixCache.should_capture weighs reasoning and revisit)."""
        if not self.created:
            raise RuntimeError(f"{self.node} was created by another recording: only attach() applies")
        return self._cache.complete(self.node, observation, exec_seconds, reasoning=reasoning, revisit=revisit)

    def abandon(self, error: BaseException) -> None:
        """The call failed: the node is forgotten; samples waiting on it see `error`."""
        if self.created:
            self._cache.abandon(self.node, error)

    def attach(self, payload: Any | None, capture_seconds: float | None = None) -> None:
        """Hand the node's captured state to the cache (None: the capture failed);
        capture_seconds: what it took, for the cache's capture estimates."""
        if capture_seconds is not None:
            self._cache.note_capture(capture_seconds, self.node.task_id)
        self._cache.attach(self.node, payload)
