"""Persistence of cached states on the cache's one writer thread (in insertion order, so a
parent's delta exists before its child's), deferred to the gap between epochs when asked, and
the releases of evicted states. A ToolPrefixCache mixin."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any

from .tree import Node


class Persistence:
    """ToolPrefixCache's persists and releases (see the module doc)."""

    def _queue_persist(self, node: Node, payload: Any, release_after: bool) -> None:
        if self.persist_between_epochs and self._bg is not None:
            with self._lock:
                self._deferred.append((node, payload, release_after))
            return
        self._submit(self._persist, node, payload, release_after)

    def flush_persistence(self) -> int:
        """Start every deferred persist (in order, on the cache's one writer); returns how many."""
        with self._lock:
            queued, self._deferred = self._deferred, []
        for node, payload, release_after in queued:
            self._submit(self._persist, node, payload, release_after)
        return len(queued)

    @property
    def persistence_pending(self) -> int:
        """Persists deferred or still running."""
        with self._lock:
            return len(self._deferred) + len(self._jobs)

    def _persist(self, node: Node, payload: Any, release_after: bool) -> None:
        with self._lock:
            parent_ref = next((a.disk_ref for a in node.ancestors() if a.disk_ref), None)
        try:
            saved = self.backend.persist(payload, parent_ref)
        except Exception:
            with self._lock:
                self.counters["persist_failures"] += 1
            saved = None
        with self._lock:
            if saved is not None:
                node.disk_ref, node.disk_bytes, node.load_bytes = saved.ref, saved.stored_bytes, saved.logical_bytes
                self.counters["persisted"] += 1
            if not release_after:
                node.pins -= 1
            victims = self._evict_locked()
        if release_after:
            self.backend.release(payload)
        self._release(victims)

    def _release(self, victims: list[tuple[Node, Any]]) -> None:
        for _node, payload in victims:
            if self._bg is not None:
                self._submit(self.backend.release, payload)
            else:
                self.backend.release(payload)

    def _submit(self, fn: Any, *args: Any) -> None:
        if self._bg is None:
            fn(*args)
            return
        fut = self._bg.submit(fn, *args)
        with self._lock:
            self._jobs.add(fut)
        fut.add_done_callback(self._job_done)

    def _job_done(self, fut: Future[Any]) -> None:
        with self._lock:
            self._jobs.discard(fut)

    def drain(self) -> None:
        """Start the deferred persists and wait for them and every queued release."""
        self.flush_persistence()
        while True:
            with self._lock:
                jobs = list(self._jobs)
            if not jobs:
                return
            for j in jobs:
                with contextlib.suppress(Exception):
                    j.result()
