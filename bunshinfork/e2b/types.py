"""E2B's data types for a local sandbox: its state, info, metrics, queries, snapshots, and the
paginators that list them."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SandboxState(StrEnum):
    PAUSED = "paused"
    RUNNING = "running"


@dataclass
class SandboxQuery:
    metadata: dict[str, str] | None = None
    state: list[SandboxState] | None = None
    started_after: datetime.datetime | None = None
    template: str | None = None


@dataclass
class SandboxInfo:
    """E2B's SandboxInfo for a local workspace."""

    sandbox_id: str
    sandbox_domain: str | None
    template_id: str
    name: str | None
    metadata: dict[str, str]
    started_at: datetime.datetime
    end_at: datetime.datetime
    state: SandboxState
    cpu_count: int
    memory_mb: int
    envd_version: str
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    lifecycle: dict[str, Any] | None = None
    volume_mounts: list[dict[str, str]] = field(default_factory=list)
    envd_unresponsive_at_pause: bool | None = None

    def matches(self, q: SandboxQuery) -> bool:
        if q.metadata and any(self.metadata.get(k) != v for k, v in q.metadata.items()):
            return False
        if q.state and self.state not in q.state:
            return False
        if q.started_after and self.started_at <= q.started_after:
            return False
        return not (q.template and self.template_id != q.template)


@dataclass
class SandboxMetrics:
    cpu_count: int
    cpu_used_pct: float
    disk_total: int
    disk_used: int
    mem_total: int
    mem_used: int
    mem_cache: int
    timestamp: datetime.datetime


@dataclass
class SnapshotInfo:
    snapshot_id: str
    names: list[str] = field(default_factory=list)


class Paginator(Generic[T]):
    """E2B's paginator protocol (has_next, next_token, next_items) over a list known up front."""

    def __init__(self, items: list[T], limit: int | None, next_token: str | None) -> None:
        self._items = items
        self.limit = limit
        self._offset = int(next_token) if next_token else 0
        self._has_next = True

    @property
    def has_next(self) -> bool:
        return self._has_next

    @property
    def next_token(self) -> str | None:
        return str(self._offset) if self._has_next and self._offset else None

    def next_items(self, **opts: Any) -> list[T]:
        if not self._has_next:
            raise Exception("No more items to fetch")
        end = len(self._items) if not self.limit else self._offset + self.limit
        page = self._items[self._offset:end]
        self._offset = min(end, len(self._items))
        self._has_next = self._offset < len(self._items)
        return page


class SandboxPaginator(Paginator[SandboxInfo]):
    pass


class SnapshotPaginator(Paginator[SnapshotInfo]):
    pass


def utc(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC)
