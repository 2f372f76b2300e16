"""E2B's sandbox semantics as functions over a bunshin Workspace: the one implementation that
the in-process Sandbox (sync and async) and `bunshin serve` both call. Lifecycle options,
lifetimes and their extension, fork counts, list filters and paging, metrics from the
host-cost accounting, pause to disk and resume, and the watcher that pauses a sandbox at its
deadline.

Pause is E2B's and AgentENV's: the workspace's whole state (memory, processes, files) is saved
to disk and its processes and memory go back to the host (Workspace.pause_to_disk: the
workspace's status is then paused, and only its record is left); resume restores it under the
same id (Workspace.resume_from_disk). Workspace.pause() stays a freeze. A filesystem-only pause
(E2B's pause {"memory": false}, autoPauseMemory false) keeps the files alone (pause_files) and
its resume is a cold boot (boot_files): a new workspace, so a new hostname and boot id by the
identity rule, with the files as they were.
"""

from __future__ import annotations

import datetime
import heapq
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import InvalidArgumentException
from ..workspace import Workspace, host_memory
from . import sidecar
from .types import SandboxMetrics

OnTimeout = Literal["kill", "pause"]
T = TypeVar("T")
MAX_FORKS = 20  # E2B's limit per fork call
MAX_SNAPSHOT_FORKS = 100  # POST /snapshots/{id}/fork's (e2b-dev/infra PR #3441: maxForkCount)
DEFAULT_TIMEOUT = 300
MAX_TIMEOUT = 24 * 3600  # E2B's longest lifetime (Pro)
PAUSED_TO_DISK = "paused-to-disk"  # WorkspaceInfo.state of a workspace paused to disk
log = logging.getLogger("bunshin.e2b")


# ---- options ----


@dataclass(frozen=True)
class Lifecycle:
    """What happens at a sandbox's deadline, and whether traffic to it resumes it."""

    on_timeout: OnTimeout = "kill"
    auto_resume: bool = False
    pause_memory: bool = True  # False: the deadline's pause keeps the files alone (autoPauseMemory)

    def to_api(self) -> dict[str, Any]:
        return {"onTimeout": self.on_timeout, "autoResume": self.auto_resume}

    def to_sdk(self) -> dict[str, Any]:
        return {"on_timeout": self.on_timeout, "auto_resume": self.auto_resume}


def lifecycle_of(auto_pause: Any = False, auto_resume: Any = None, auto_pause_memory: Any = None) -> Lifecycle:
    """E2B's NewSandboxV2 fields (autoPause, autoResume, autoPauseMemory) as a Lifecycle; other
    values are refused, and so is autoPauseMemory false without autoPause or with autoResume
    (e2b-dev/infra packages/api/internal/handlers/sandbox_create.go: a filesystem-only pause
    cannot be resumed by traffic)."""
    auto_pause = False if auto_pause is None else auto_pause
    memory = True if auto_pause_memory is None else auto_pause_memory
    if not isinstance(auto_pause, bool) or not isinstance(memory, bool) \
            or (auto_resume is not None and not isinstance(auto_resume, (bool, dict))):
        raise InvalidArgumentException("autoPause and autoPauseMemory must be booleans and autoResume a boolean "
                                       "or an object")
    resume = auto_resume.get("enabled", False) if isinstance(auto_resume, dict) else bool(auto_resume)
    if not memory and not auto_pause:
        raise InvalidArgumentException("autoPauseMemory=false only applies when autoPause is true.")
    if not memory and resume:
        raise InvalidArgumentException("autoPauseMemory=false (filesystem-only auto-pause) cannot be combined with "
                                       "autoResume: a filesystem-only snapshot must be resumed explicitly.")
    return Lifecycle("pause" if auto_pause else "kill", bool(resume), memory)


def lifecycle_from_sdk(options: dict[str, Any] | None) -> Lifecycle:
    """The SDK's `lifecycle={"on_timeout": "kill" | "pause" | {"action": ...}, "auto_resume": ...}`."""
    if not options:
        return Lifecycle()
    on_timeout = options.get("on_timeout", "kill")
    action = on_timeout.get("action") if isinstance(on_timeout, dict) else on_timeout
    if action not in ("kill", "pause"):
        raise InvalidArgumentException(f"lifecycle on_timeout must be 'kill' or 'pause', not {action!r}")
    auto_resume = options.get("auto_resume")
    resume = auto_resume.get("enabled", False) if isinstance(auto_resume, dict) else bool(auto_resume)
    return Lifecycle(action, bool(resume))


def check_timeout(timeout: Any, default: int = DEFAULT_TIMEOUT) -> int:
    """A lifetime in seconds as E2B takes it: an integer from 0 to 24 h (0: none)."""
    t = default if timeout is None else timeout
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TIMEOUT:
        raise InvalidArgumentException(f"timeout must be an integer number of seconds from 0 to {MAX_TIMEOUT}, "
                                       f"got {timeout!r}")
    return t


def check_fork_count(count: Any, most: int = MAX_FORKS) -> int:
    n = 1 if count is None else count
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise InvalidArgumentException(f"count must be an integer between 1 and {most}, got {count!r}")
    return n


# ---- lifetimes ----


def deadline_after(timeout: float, now: float | None = None) -> float:
    """The wall-clock deadline of a lifetime of `timeout` seconds (0: none, as +inf)."""
    return float("inf") if timeout == 0 else (time.time() if now is None else now) + timeout


def extended(deadline: float, timeout: int | None, now: float | None = None) -> float:
    """connect(timeout)'s rule: a lifetime is extended to `timeout` from now, never shortened."""
    if timeout is None:
        return deadline
    return max(deadline, deadline_after(timeout, now))


def resumed_deadline(timeout: int | None) -> float:
    """A resumed sandbox lives `timeout` (E2B's default 300 s) from now, whatever was left of the
    lifetime it paused with (one paused at its deadline would pause again at once)."""
    return deadline_after(DEFAULT_TIMEOUT if timeout is None else timeout)


def workspace_lifetime(life: Lifecycle, deadline: float) -> int:
    """The lifetime to give the workspace's own init (seconds from now, 0: none): a kill at the
    deadline is the init's to enforce; a pause is the watcher's (the init would kill it)."""
    if life.on_timeout == "pause" or deadline == float("inf"):
        return 0
    return max(1, round(deadline - time.time()))


def utc(ts: float) -> datetime.datetime:
    if ts == float("inf"):
        return datetime.datetime.max.replace(tzinfo=datetime.UTC)
    return datetime.datetime.fromtimestamp(ts, datetime.UTC)


class DeadlineWatcher:
    """Runs an action at each armed deadline, on one daemon thread per process: the pause of a
    sandbox whose lifecycle pauses it (`bunshin serve` arms its own timers on its event loop).
    Re-arming a key moves its deadline; an action that raises is logged."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[str, tuple[float, Callable[[], None]]] = {}
        self._thread: threading.Thread | None = None

    def arm(self, key: str, deadline: float, action: Callable[[], None]) -> None:
        with self._cond:
            if deadline == float("inf"):
                self._due.pop(key, None)
            else:
                self._due[key] = (deadline, action)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="bunshin-e2b-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self, key: str) -> None:
        with self._cond:
            self._due.pop(key, None)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    soonest = heapq.nsmallest(1, self._due.items(), key=lambda kv: kv[1][0])
                    if soonest and soonest[0][1][0] <= time.time():
                        key, (_, action) = soonest[0]
                        del self._due[key]
                        break
                    self._cond.wait(None if not soonest else soonest[0][1][0] - time.time())
            try:
                action()
            except Exception:
                log.exception("the deadline action of %s failed", key)


WATCHER = DeadlineWatcher()


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
        # The bound is inclusive, at the microseconds a startedAt carries: a client that sends a
        # sandbox's own startedAt back lists that sandbox (E2B's test_list_sandboxes_started_after).
        if self.started_after is not None and utc(started_at) < utc(self.started_after):
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


def metrics(ws: Workspace) -> SandboxMetrics:
    """One sample of E2B's metrics, now (no daemon records a history). Memory is what the
    workspace costs the host (bunshin's host-cost accounting: anon, tmpfs, page cache, kernel);
    CPU the average since it started; disk what its layer holds."""
    cost = host_memory([ws])
    info = ws.info()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu_s = 0.0
    for pid in ws.host_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu_s += (int(fields[11]) + int(fields[12])) / ticks
        except OSError:
            continue
    cpus = os.cpu_count() or 1
    elapsed = max(time.time() - info.created_at, 1e-3)
    layer = ws.layer_dir
    disk = shutil.disk_usage(layer or ws.state_dir)
    used = layer_bytes(layer / "upper") if layer else 0
    total = info.memory_limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return SandboxMetrics(cpu_count=cpus, cpu_used_pct=round(100.0 * cpu_s / elapsed / cpus, 2),
                          disk_total=disk.total, disk_used=used, mem_total=total, mem_used=cost.total,
                          mem_cache=cost.page_cache, timestamp=datetime.datetime.now(datetime.UTC))


def layer_bytes(top: Path) -> int:
    """What the entries under `top` (a workspace's layer, written by whatever runs in it) take:
    each one's own size, a link's included, and no link followed: a link's target is a path
    inside the workspace, which here, on the host, would name the host's files."""
    total = 0
    dirs = [str(top)]
    while dirs:
        try:
            it = os.scandir(dirs.pop())
        except OSError:
            continue  # removed meanwhile
        with it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        dirs.append(entry.path)
                    else:
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    return total


# ---- pause to disk ----


def is_paused(ws: Workspace) -> bool:
    """Paused as E2B means it: to disk. (A frozen cgroup is not: every snapshot and fork
    freezes its source for a moment, and Workspace.pause() is bunshin's, which connect() thaws.)"""
    return ws.info().state == PAUSED_TO_DISK


def pause(ws: Workspace, dest: Path | None = None) -> bool:
    """E2B's pause: save the whole state to disk (at `dest`, or bunshin's default place) and
    give the workspace's processes and memory back to the host. False if it is paused already;
    on a failed save it keeps running, unchanged."""
    state = ws.info().state
    if state == PAUSED_TO_DISK:
        return False
    if state == "paused":  # frozen by Workspace.pause(): saved as it runs
        ws.resume()
    ws.pause_to_disk(dest)
    return True


def resume(ws: Workspace, life: Lifecycle, deadline: float) -> None:
    """Bring a paused sandbox back, running, with its processes and files as they were: a
    workspace paused to disk is restored under its id, a frozen one thawed. Its lifetime ends
    at `deadline` (the init's to enforce for a kill lifecycle)."""
    if ws.info().state == PAUSED_TO_DISK:
        ws.resume_from_disk(timeout=workspace_lifetime(life, deadline))
    elif ws.info().state == "paused":
        ws.resume()


# ---- filesystem-only pause, and the cold boot that resumes it ----

FILES = "files"  # a filesystem-only pause's directory, under the sandbox's paused directory


def files_paused(dest: Path) -> bool:
    """Whether `dest` holds a filesystem-only pause (pause_files)."""
    return Workspace.files_saved(dest)


def pause_files(ws: Workspace, dest: Path) -> None:
    """E2B's filesystem-only pause (Workspace.pause_files), the in-process Sandbox's E2B state
    (its sidecar) kept with the files."""
    side = ws.state_dir / sidecar.FILE
    ws.pause_files(dest, {"sidecar": side.read_text() if side.is_file() else None})


def boot_files(dest: Path, timeout: float) -> Workspace:
    """The cold boot of a filesystem-only pause (Workspace.boot_files), its sidecar put back."""
    ws, extra = Workspace.boot_files(dest, timeout=timeout or None)
    if extra.get("sidecar") is not None:
        try:
            (ws.state_dir / sidecar.FILE).write_text(extra["sidecar"])
        except BaseException:
            ws.destroy()
            raise
    return ws


def reboot_saved(ws: Workspace, timeout: float) -> Workspace:
    """E2B's on_resume="reboot" (connect {"memory": false}) of a sandbox paused to disk with its
    memory (Workspace.reboot): a cold boot from the files its pause saved, its sidecar kept."""
    return ws.reboot(timeout=timeout or None, keep=(sidecar.FILE,))
