"""Warm templates: a workspace started from an image, initialised until a ready command
succeeds, and saved as a snapshot under a name, so that every workspace made from it starts
already running and already initialised (as E2B's templates and AgentENV's `aenv pull
--start-cmd --ready-cmd` do). Starting from one forks its saved snapshot with the default
memory engine: neither the start nor the ready command runs again.

Templates and E2B's saved snapshots (Sandbox.create_snapshot) share one store and one
namespace: BUNSHIN_SNAPSHOT_ROOT/<snapshot id>/, a saved snapshot with names.json (the names
that name it; a name names the newest snapshot given it) and, for a template, template.json
(what it was made from).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentException, TemplateNotFound, TemplateNotReady, WarmTemplateError

if TYPE_CHECKING:
    from ..workspace import Workspace

ROOT = Path(os.environ.get("BUNSHIN_SNAPSHOT_ROOT", "/var/lib/bunshin/snapshots"))
NAMES = "names.json"
META = "template.json"
SAVED = "snapshot.json"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", re.ASCII)
READY_POLL = 0.2  # seconds between two runs of a ready command that has not yet succeeded
ENTRYPOINT = "entrypoint"  # --start entrypoint: the image's Entrypoint and Cmd


@dataclass(frozen=True)
class TemplateInfo:
    name: str  # the first of its names ("" for an unnamed snapshot)
    snapshot_id: str
    kind: str  # template | snapshot
    source: str  # the image (template) or the sandbox it was taken from (snapshot)
    created_at: float
    start: str | None = None
    ready: str | None = None
    ready_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.startswith("snap-"):
        raise InvalidArgumentException(
            f"template name {name!r} is not a name: letters, digits, '_', '.', '-' (not starting 'snap-'), "
            "at most 128")
    return name


def _dirs() -> list[Path]:
    if not ROOT.is_dir():
        return []
    return sorted(p for p in ROOT.iterdir() if (p / SAVED).is_file())


def _names(d: Path) -> list[str]:
    try:
        return list(json.loads((d / NAMES).read_text()))
    except (OSError, ValueError):
        return []


def _info(d: Path) -> TemplateInfo:
    names = _names(d)
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError):
        meta = None
    if meta is not None:
        return TemplateInfo(names[0] if names else "", d.name, "template", meta.get("from", ""),
                            meta.get("created_at", 0.0), meta.get("start"), meta.get("ready"),
                            meta.get("ready_seconds"))
    try:
        saved = json.loads((d / SAVED).read_text())
    except (OSError, ValueError):
        saved = {}
    return TemplateInfo(names[0] if names else "", d.name, "snapshot", str(saved.get("source", "")),
                        (d / SAVED).stat().st_mtime)


def find(name: str) -> Path | None:
    """The saved snapshot a template name, snapshot name or snapshot id names."""
    for d in _dirs():
        if name == d.name or name in _names(d):
            return d
    return None


def ls() -> list[TemplateInfo]:
    return [_info(d) for d in _dirs()]


def rm(name: str) -> TemplateInfo:
    """Remove the template (or saved snapshot) `name` names. Workspaces started from it keep
    running: each loaded its layer into the layer store."""
    d = find(name)
    if d is None:
        raise TemplateNotFound(f"no template or saved snapshot {name!r}; see 'bunshin template ls'")
    info = _info(d)
    shutil.rmtree(d)
    return info


def _name_it(dest: Path, name: str) -> None:
    for d in _dirs():  # a name names the newest snapshot given it, as E2B's do
        if d != dest and name in _names(d):
            (d / NAMES).write_text(json.dumps([n for n in _names(d) if n != name]))
    (dest / NAMES).write_text(json.dumps([name]))


def _wait_ready(ws: Workspace, ready: str, timeout: float) -> float:
    """Run `ready` until it exits 0; seconds it took. TemplateNotReady past `timeout`."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    last = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            r = ws.commands.run(ready, timeout=max(left, 0.05))
        except TimeoutError:
            break
        if r.exit_code == 0:  # type: ignore[union-attr]
            return time.monotonic() - t0
        last = r
        if deadline - time.monotonic() > READY_POLL:
            time.sleep(READY_POLL)  # the check's own pace: it polls something still starting
    tail = f"; its last run exited {last.exit_code}: {(last.stderr or last.stdout or '')[-300:]}" if last else ""  # type: ignore[union-attr]
    raise TemplateNotReady(f"ready command {ready!r} did not succeed within {timeout:g}s{tail}")


def create(name: str, source: str, *, start: str | None = None, ready: str | None = None,
           ready_timeout: float = 60.0, **spec: Any) -> TemplateInfo:
    """Start a workspace from `source` (a rootfs: 'docker:IMAGE', 'oci:DIR', ...), run `start`
    in the background ('entrypoint': the image's Entrypoint and Cmd), wait until `ready`
    succeeds, and save its snapshot under `name`. The workspace is destroyed afterwards; on
    any failure nothing is kept."""
    from ..workspace import Workspace

    check_name(name)
    if not (isinstance(ready_timeout, (int, float)) and ready_timeout > 0):
        raise InvalidArgumentException(f"ready_timeout must be a positive number of seconds, got {ready_timeout!r}")
    if start is not None and (not isinstance(start, str) or not start.strip()):
        raise InvalidArgumentException(f"start must be a command, got {start!r}")
    ws = Workspace.create(rootfs=source, start=ENTRYPOINT if start == ENTRYPOINT else None, **spec)
    dest: Path | None = None
    try:
        if start is not None and start != ENTRYPOINT:
            ws.commands.run(start, background=True, timeout=0)
        took = _wait_ready(ws, ready, float(ready_timeout)) if ready else None
        with ws.snapshot() as snap:
            ROOT.mkdir(parents=True, exist_ok=True)
            dest = ROOT / snap.id
            snap.save(dest).result()
        (dest / META).write_text(json.dumps({"from": source, "start": start, "ready": ready,
                                             "ready_seconds": took, "created_at": time.time()}))
        _name_it(dest, name)
        return _info(dest)
    except BaseException:
        if dest is not None:
            shutil.rmtree(dest, ignore_errors=True)
        raise
    finally:
        ws.destroy()


def start(name: str, *, timeout: float | None = None, memory: str | None = None) -> Workspace:
    """A workspace forked from the template (or saved snapshot) `name`: running and initialised."""
    from ..workspace import Snapshot

    d = find(name)
    if d is None:
        raise TemplateNotFound(f"no template or saved snapshot {name!r}; see 'bunshin template ls'")
    snap = Snapshot.load(d, memory)
    try:
        (clone,) = snap.fork(1, timeout=timeout)
    finally:
        snap.release()
    if isinstance(clone, BaseException):
        raise WarmTemplateError(f"starting from template {name!r} failed: {clone}") from clone
    return clone
