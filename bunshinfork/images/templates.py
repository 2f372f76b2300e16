"""Warm templates: a workspace started from an image, initialised until a ready command
succeeds, and saved as a snapshot under a name, so that every workspace made from it starts
already running and already initialised (as E2B's templates and AgentENV's `aenv pull
--start-cmd --ready-cmd` do). Starting from one forks its saved snapshot with the default
memory engine: neither the start nor the ready command runs again.

Templates and E2B's saved snapshots (Sandbox.create_snapshot) share one store and one
namespace: BUNSHIN_SNAPSHOT_ROOT/<snapshot id>/, a saved snapshot with names.json (the names
that name it; a name names the newest snapshot given it) and, for a template, template.json
(what it was made from).

This module is the store; warm.py makes templates and Workspace.from_template() starts them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentException, TemplateNotFound

ROOT = Path(os.environ.get("BUNSHIN_SNAPSHOT_ROOT", "/var/lib/bunshin/snapshots"))
NAMES = "names.json"
META = "template.json"
SAVED = "snapshot.json"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", re.ASCII)


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


def saved() -> list[Path]:
    """Every saved snapshot in the store (templates among them)."""
    if not ROOT.is_dir():
        return []
    return sorted(p for p in ROOT.iterdir() if (p / SAVED).is_file())


def names(d: Path) -> list[str]:
    """The names the saved snapshot at `d` has."""
    try:
        return list(json.loads((d / NAMES).read_text()))
    except (OSError, ValueError):
        return []


def info(d: Path) -> TemplateInfo:
    """What the store holds at `d`: a template or a saved snapshot, with its names."""
    given = names(d)
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError):
        meta = None
    if meta is not None:
        return TemplateInfo(given[0] if given else "", d.name, "template", meta.get("from", ""),
                            meta.get("created_at", 0.0), meta.get("start"), meta.get("ready"),
                            meta.get("ready_seconds"))
    try:
        saved = json.loads((d / SAVED).read_text())
    except (OSError, ValueError):
        saved = {}
    return TemplateInfo(given[0] if given else "", d.name, "snapshot", str(saved.get("source", "")),
                        (d / SAVED).stat().st_mtime)


def find(name: str) -> Path | None:
    """The saved snapshot a template name, snapshot name or snapshot id names."""
    for d in saved():
        if name == d.name or name in names(d):
            return d
    return None


def ls() -> list[TemplateInfo]:
    return [info(d) for d in saved()]


def rm(name: str) -> TemplateInfo:
    """Remove the template (or saved snapshot) `name` names. Workspaces started from it keep
    running: each loaded its layer into the layer store."""
    d = find(name)
    if d is None:
        raise TemplateNotFound(f"no template or saved snapshot {name!r}; see 'bunshin template ls'")
    gone = info(d)
    shutil.rmtree(d)
    return gone


def name_it(dest: Path, name: str) -> None:
    """Give the saved snapshot at `dest` the name `name`."""
    for d in saved():  # a name names the newest snapshot given it, as E2B's do
        if d != dest and name in names(d):
            (d / NAMES).write_text(json.dumps([n for n in names(d) if n != name]))
    (dest / NAMES).write_text(json.dumps([name]))
