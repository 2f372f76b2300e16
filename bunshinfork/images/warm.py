"""Making warm templates: a workspace started from an image, initialised until a ready command
succeeds, and saved under a name in the template store (templates.py). Starting from one is
Workspace.from_template(): it forks the saved snapshot, so neither command runs again."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentException, TemplateNotReady
from ..workspace import Workspace
from . import templates

READY_POLL = 0.2  # seconds between two runs of a ready command that has not yet succeeded
ENTRYPOINT = "entrypoint"  # --start entrypoint: the image's Entrypoint and Cmd


def save(ws: Workspace, name: str | None, meta: dict[str, Any] | None = None) -> Path:
    """Snapshot `ws` and save it in the template store, named `name` where given (a name names
    the newest snapshot given it, as E2B's do); `meta` makes it a template (template.json)."""
    dest: Path | None = None
    try:
        with ws.snapshot() as snap:
            templates.ROOT.mkdir(parents=True, exist_ok=True)
            dest = templates.ROOT / snap.id
            snap.save(dest).result()
        if meta is not None:
            (dest / templates.META).write_text(json.dumps(meta))
        if name:
            templates.name_it(dest, name)
        return dest
    except BaseException:
        if dest is not None:
            shutil.rmtree(dest, ignore_errors=True)
        raise


def wait_ready(ws: Workspace, ready: str, timeout: float) -> float:
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
           ready_timeout: float = 60.0, **spec: Any) -> templates.TemplateInfo:
    """Start a workspace from `source` (a rootfs: 'docker:IMAGE', 'oci:DIR', ...), run `start`
    in the background ('entrypoint': the image's Entrypoint and Cmd), wait until `ready`
    succeeds, and save its snapshot under `name`. The workspace is destroyed afterwards; on
    any failure nothing is kept."""
    templates.check_name(name)
    if not (isinstance(ready_timeout, (int, float)) and ready_timeout > 0):
        raise InvalidArgumentException(f"ready_timeout must be a positive number of seconds, got {ready_timeout!r}")
    if start is not None and (not isinstance(start, str) or not start.strip()):
        raise InvalidArgumentException(f"start must be a command, got {start!r}")
    ws = Workspace.create(rootfs=source, start=ENTRYPOINT if start == ENTRYPOINT else None, **spec)
    try:
        if start is not None and start != ENTRYPOINT:
            ws.commands.run(start, background=True, timeout=0)
        took = wait_ready(ws, ready, float(ready_timeout)) if ready else None
        meta = {"from": source, "start": start, "ready": ready, "ready_seconds": took, "created_at": time.time()}
        return templates.info(save(ws, name, meta))
    finally:
        ws.destroy()
