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
import json
import logging
import os
import shutil
import stat
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

from .. import idmap
from ..errors import InvalidArgumentException, WorkspaceStateError
from ..fs import SAVED_LAYER, frozen
from ..spec import WorkspaceSpec
from ..state import SnapshotMeta
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
_LAYER, _META = "layer", "meta.json"
# The old boot's identity and init: a cold boot gets its own (the identity rule).
_IDENTITY = {".bunshin", "etc/hostname", "etc/hosts"}
_ARCHIVE, _DELETED, _OPAQUE = "/.bunshin-files.tar", "/.bunshin-files.del", "/.bunshin-files.opq"
_APPLY_SECONDS = 600


def files_paused(dest: Path) -> bool:
    """Whether `dest` holds a filesystem-only pause (pause_files)."""
    return (dest / _META).is_file()


def pause_files(ws: Workspace, dest: Path) -> None:
    """E2B's filesystem-only pause: the workspace's files (its layers above the rootfs, flattened,
    whiteouts and opaque directories kept, copied while it is frozen) saved at `dest` with its
    spec and egress rules; then the workspace is destroyed: no memory, no process is kept. A
    failed save leaves it running, unchanged."""
    rec = ws.record
    fs = rec.fs
    if fs is None or fs.layer is None:
        raise WorkspaceStateError(f"workspace {ws.id} has no layer to keep")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700, parents=True)
    was_frozen = ws.info().state == "paused"
    try:
        if not was_frozen:
            ws.pause()  # the files stop changing while they are copied
        flat = frozen.flatten([fs.layer, *fs.lowers], tmp / _LAYER, subvolume=False)
        os.rename(flat.path, tmp / _LAYER)
        side = ws.state_dir / sidecar.FILE  # the in-process Sandbox's E2B state, kept with the files
        meta = {"spec": rec.spec.to_dict(), "egress": ws.info().egress,
                "sidecar": side.read_text() if side.is_file() else None}
        (tmp / _META).write_text(json.dumps(meta))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not was_frozen:
            ws.resume()
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    ws.destroy()  # frozen still: nothing it does after the copy is kept or half-kept


def boot_files(dest: Path, timeout: float) -> Workspace:
    """The cold boot of a filesystem-only pause: a new workspace (new hostname, new boot id) with
    the saved spec and egress rules, its `timeout` (0: none), and the saved files put back as
    they were (what was deleted deleted). `dest` is left for the caller to remove once it
    records the new workspace."""
    meta = json.loads((dest / _META).read_text())
    spec = WorkspaceSpec(**meta["spec"])
    ws = Workspace.create(spec, timeout=timeout or None)
    try:
        if meta.get("egress") is not None:
            ws.set_egress(meta["egress"])
        if meta.get("sidecar") is not None:
            (ws.state_dir / sidecar.FILE).write_text(meta["sidecar"])
        _put_back(ws, dest / _LAYER / "upper", idmap.BASE if spec.userns else 0)
    except BaseException:
        ws.destroy()
        raise
    return ws


def reboot_saved(ws: Workspace, timeout: float) -> Workspace:
    """E2B's on_resume="reboot" (connect {"memory": false}) of a workspace paused to disk with
    its memory: a cold boot from the files its pause saved (the saved snapshot's flattened
    layer, its spec and egress rules), its memory ignored; the paused workspace is then
    destroyed. The rescue path for a memory image that will not restore."""
    saved = ws.record.saved
    if ws.info().state != PAUSED_TO_DISK or saved is None:
        raise WorkspaceStateError(f"workspace {ws.id} is not paused to disk")
    meta = SnapshotMeta.load(Path(saved))
    new = Workspace.create(meta.spec, timeout=timeout or None)
    try:
        _put_back(new, Path(saved) / SAVED_LAYER / "upper", idmap.BASE if meta.spec.userns else 0)
        side = ws.state_dir / sidecar.FILE
        if side.is_file():
            (new.state_dir / sidecar.FILE).write_text(side.read_text())
    except BaseException:
        new.destroy()
        raise
    ws.destroy()
    return new


def _put_back(ws: Workspace, upper: Path, shift: int) -> None:
    """The saved layer's entries, written into the new workspace by tar in it (as root: nothing
    it extracts can reach past the workspace's own root), after what the layer's whiteouts
    delete and what its opaque directories hide is removed there."""
    with tempfile.TemporaryFile() as archive:
        whiteouts, opaque = _archive(upper, archive, shift)
        archive.seek(0)
        ws.files.write(_ARCHIVE, archive)
    ws.files.write(_DELETED, b"".join(p.encode() + b"\0" for p in whiteouts))
    ws.files.write(_OPAQUE, b"".join(p.encode() + b"\0" for p in opaque))
    keep = " ".join(f"! -path /{p}" for p in sorted(_IDENTITY))
    script = (f"set -e; xargs -0 -r rm -rf -- < {_DELETED}; "
              f"xargs -0 -r -I% sh -c 'test ! -d \"$1\" || find \"$1\" -mindepth 1 -maxdepth 1 {keep} "
              f"-exec rm -rf -- {{}} +' sh % < {_OPAQUE}; "
              f"tar -xpf {_ARCHIVE} -C / --numeric-owner; rm -f {_ARCHIVE} {_DELETED} {_OPAQUE}")
    result = ws.commands.run(["/bin/sh", "-c", script], timeout=_APPLY_SECONDS)
    if result.exit_code != 0:
        raise WorkspaceStateError(f"putting the saved files back into {ws.id} failed: {result.stderr.strip()}")


def _archive(upper: Path, out: IO[bytes], shift: int) -> tuple[list[str], list[str]]:
    """A tar of the layer's entries (no link followed: they are the sandbox's); the paths its
    whiteouts delete, and its opaque directories (whose earlier contents it hides)."""
    whiteouts: list[str] = []
    opaque: list[str] = []
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = [""]
        while dirs:
            rel = dirs.pop()
            with os.scandir(upper / rel) as it:
                for entry in sorted(it, key=lambda e: e.name):
                    name = f"{rel}/{entry.name}" if rel else entry.name
                    if name in _IDENTITY:
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                        whiteouts.append("/" + name)
                        continue
                    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                        continue  # inert on a nodev root; a socket is nobody's once its process is gone
                    info = tar.gettarinfo(entry.path, arcname=name)
                    if shift:
                        info.uid, info.gid = max(0, info.uid - shift), max(0, info.gid - shift)
                    if info.isreg():
                        with open(entry.path, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
                    if stat.S_ISDIR(st.st_mode):
                        if frozen._is_opaque(entry.path):
                            opaque.append("/" + name)
                        dirs.append(name)
    return whiteouts, opaque
