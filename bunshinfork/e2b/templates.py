"""What a sandbox starts from: E2B's template names mapped onto a rootfs, and the snapshots
create_snapshot() saves under SNAPSHOT_ROOT (E2B's persistent snapshot templates)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import NotFoundException
from ..workspace import Snapshot, Workspace
from .types import SnapshotInfo

SNAPSHOT_ROOT = Path(os.environ.get("BUNSHIN_SNAPSHOT_ROOT", "/var/lib/bunshin/snapshots"))
DEFAULT = "base"


def _dirs() -> list[Path]:
    if not SNAPSHOT_ROOT.is_dir():
        return []
    return sorted(p for p in SNAPSHOT_ROOT.iterdir() if (p / "snapshot.json").exists())


def _info(d: Path) -> tuple[SnapshotInfo, dict[str, Any]]:
    meta = json.loads((d / "snapshot.json").read_text())
    names = json.loads((d / "names.json").read_text()) if (d / "names.json").exists() else []
    return SnapshotInfo(d.name, names), meta


def saved(source: str | None = None, name: str | None = None) -> list[SnapshotInfo]:
    """The saved snapshots, of the sandbox `source` and named `name` where given."""
    out = []
    for d in _dirs():
        info, meta = _info(d)
        if (source is None or meta.get("source") == source) and (name is None or name in (d.name, *info.names)):
            out.append(info)
    return out


def find(template: str) -> Path | None:
    """The directory of the saved snapshot with this id or name."""
    for d in _dirs():
        if template == d.name or template in _info(d)[0].names:
            return d
    return None


def save(ws: Workspace, name: str | None) -> SnapshotInfo:
    """Snapshot `ws` and save it under SNAPSHOT_ROOT; a name names the newest snapshot given it,
    as E2B's do."""
    with ws.snapshot() as snap:
        dest = SNAPSHOT_ROOT / snap.id
        SNAPSHOT_ROOT.mkdir(parents=True, exist_ok=True)
        snap.save(dest).result()
    if name:
        for d in _dirs():
            info, _ = _info(d)
            if name in info.names:
                (d / "names.json").write_text(json.dumps([n for n in info.names if n != name]))
        (dest / "names.json").write_text(json.dumps([name]))
    return SnapshotInfo(dest.name, [name] if name else [])


def delete(snapshot_id: str) -> bool:
    d = find(snapshot_id)
    if d is None or d.name != snapshot_id:
        return False
    shutil.rmtree(d)
    return True


def start(template: str | None, lifetime: float, env: dict[str, str], network: dict[str, Any]) -> Workspace:
    """A running workspace from `template`: a saved snapshot's clone (given `env` on top of
    its own), or a new workspace on the rootfs the template names."""
    saved_dir = find(template) if template and template != DEFAULT else None
    if saved_dir is not None:
        snap = Snapshot.load(saved_dir)
        try:
            (clone,) = snap.fork(1, timeout=lifetime)
        finally:
            snap.release()
        if isinstance(clone, Exception):
            raise clone
        if env:
            try:
                clone.update_env(env)
            except BaseException:
                clone.destroy()
                raise
        return clone
    rootfs = "host" if template in (None, DEFAULT) else str(template)
    if not (rootfs in ("host", "debian") or rootfs.startswith(("docker:", "/"))):
        raise NotFoundException(f"no template {template!r}: use 'base', 'debian', 'docker:IMAGE', a "
                                "directory, or a snapshot saved by create_snapshot()")
    return Workspace.create(timeout=lifetime, rootfs=rootfs, env=env, **network)
