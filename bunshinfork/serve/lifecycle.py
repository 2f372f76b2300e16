"""E2B's sandbox semantics as functions over a bunshin Workspace, for the server and for the
in-process Sandbox alike (one implementation): lifecycle options, lifetimes, list filters and
paging, metrics from the host-cost accounting, and pause to disk / resume.

Pause here is E2B's and AgentENV's: the workspace's whole state (memory, processes, files) is
saved as a snapshot on disk and the workspace is destroyed, so its memory goes back to the
host; resume starts a workspace from that snapshot. Workspace.pause() stays a freeze.
"""

from __future__ import annotations

import datetime
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import InvalidArgumentException
from ..workspace import Workspace, host_memory

OnTimeout = Literal["kill", "pause"]
T = TypeVar("T")
MAX_FORKS = 20  # E2B's limit per fork call
DEFAULT_TIMEOUT = 300
MAX_TIMEOUT = 24 * 3600  # E2B's longest lifetime (Pro)


@dataclass(frozen=True)
class Lifecycle:
    """What happens at a sandbox's deadline, and whether a connect may resume it."""

    on_timeout: OnTimeout = "kill"
    auto_resume: bool = False

    def to_api(self) -> dict[str, Any]:
        return {"onTimeout": self.on_timeout, "autoResume": self.auto_resume}


def lifecycle_of(auto_pause: Any = False, auto_resume: Any = None) -> Lifecycle:
    """E2B's NewSandboxV2 fields (autoPause, autoResume) as a Lifecycle; other values are refused."""
    auto_pause = False if auto_pause is None else auto_pause
    if not isinstance(auto_pause, bool) or (auto_resume is not None and not isinstance(auto_resume, (bool, dict))):
        raise InvalidArgumentException("autoPause must be a boolean and autoResume a boolean or an object")
    resume = auto_resume.get("enabled", False) if isinstance(auto_resume, dict) else bool(auto_resume)
    return Lifecycle("pause" if auto_pause else "kill", bool(resume))


def check_timeout(timeout: Any, default: int = DEFAULT_TIMEOUT) -> int:
    """A lifetime in seconds as E2B takes it: an integer from 0 to 24 h (0: none)."""
    t = default if timeout is None else timeout
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TIMEOUT:
        raise InvalidArgumentException(f"timeout must be an integer number of seconds from 0 to {MAX_TIMEOUT}, "
                                       f"got {timeout!r}")
    return t


def check_fork_count(count: Any) -> int:
    n = 1 if count is None else count
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORKS:
        raise InvalidArgumentException(f"count must be an integer between 1 and {MAX_FORKS}, got {count!r}")
    return n


def deadline_after(timeout: int, now: float | None = None) -> float:
    """The wall-clock deadline of a lifetime of `timeout` seconds (0: none, as +inf)."""
    return float("inf") if timeout == 0 else (time.time() if now is None else now) + timeout


def extended(deadline: float, timeout: int | None, now: float | None = None) -> float:
    """connect(timeout)'s rule: a lifetime is extended to `timeout` from now, never shortened."""
    if timeout is None:
        return deadline
    return max(deadline, deadline_after(timeout, now))


def utc(ts: float) -> datetime.datetime:
    if ts == float("inf"):
        return datetime.datetime.max.replace(tzinfo=datetime.UTC)
    return datetime.datetime.fromtimestamp(ts, datetime.UTC)


# ---- listing ----


@dataclass(frozen=True)
class ListQuery:
    """E2B's list filters: metadata (all pairs match), states, started after, template."""

    metadata: dict[str, str] | None = None
    states: Sequence[str] | None = None
    started_after: float | None = None
    template: str | None = None

    def matches(self, metadata: dict[str, str], state: str, started_at: float, template: str) -> bool:
        if self.metadata and any(metadata.get(k) != v for k, v in self.metadata.items()):
            return False
        if self.states and state not in self.states:
            return False
        if self.started_after is not None and started_at <= self.started_after:
            return False
        return not (self.template and template != self.template)


def page(items: Sequence[T], limit: int | None, next_token: str | None,
         key: Callable[[T], Any], order: str | None = None) -> tuple[list[T], str | None]:
    """One page of `items` sorted by `key` (E2B sorts by start time, ascending unless 'desc'),
    and the token of the next page (None on the last). The token is the position of the page's
    end: a token that is not one is refused."""
    if order not in (None, "asc", "desc"):
        raise InvalidArgumentException(f"Invalid order {order!r}, expected 'asc' or 'desc'")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 100):
        raise InvalidArgumentException(f"limit must be an integer from 1 to 100, got {limit!r}")
    try:
        start = int(next_token) if next_token else 0
    except ValueError:
        raise InvalidArgumentException(f"invalid next token {next_token!r}") from None
    if start < 0:
        raise InvalidArgumentException(f"invalid next token {next_token!r}")
    ordered = sorted(items, key=key, reverse=order == "desc")
    end = len(ordered) if limit is None else start + limit
    return ordered[start:end], (str(end) if end < len(ordered) else None)


# ---- metrics ----


@dataclass(frozen=True)
class Metrics:
    cpu_count: int
    cpu_used_pct: float
    mem_total: int
    mem_used: int
    mem_cache: int
    disk_total: int
    disk_used: int
    timestamp: float


def metrics(ws: Workspace) -> Metrics:
    """One sample of E2B's metrics, memory from bunshin's host-cost accounting (what the
    workspace costs the host: anon, tmpfs, page cache, kernel)."""
    cost = host_memory([ws])
    info = ws.info()
    cpus = os.cpu_count() or 1
    total = info.memory_limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    disk = shutil.disk_usage("/")
    return Metrics(cpu_count=cpus, cpu_used_pct=0.0, mem_total=total, mem_used=cost.total,
                   mem_cache=cost.page_cache, disk_total=disk.total, disk_used=0, timestamp=time.time())


# ---- pause to disk ----


def pause_to_disk(ws: Workspace, dest: Path) -> None:
    """Save the workspace's whole state under `dest`, then destroy it: its memory and
    processes go back to the host. On a failed save the workspace keeps running, unchanged."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        with ws.snapshot() as snap:
            snap.save(tmp).result()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    ws.destroy()


def resume_from_disk(src: Path, timeout: float | None = None) -> Workspace:
    """A running workspace started from a state pause_to_disk saved (the files stay until the
    caller drops them: a failed resume loses nothing)."""
    return Workspace.from_saved(src, timeout=timeout)
