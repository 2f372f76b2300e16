"""E2B's own state of a sandbox (its metadata, the template it came from, whether internet
access was asked), in a file of its own beside the workspace's record: destroy() removes it
with the record, and the core record knows nothing of E2B."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field

from ..workspace import Workspace

FILE = "e2b.json"


@dataclass(frozen=True)
class Meta:
    metadata: dict[str, str] = field(default_factory=dict)
    template: str = ""
    allow_internet_access: bool = True  # as asked (E2B reports it apart from its rules)


def load(ws: Workspace) -> Meta:
    """What the sandbox's file says now (another process may have written it); empty if none."""
    with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
        raw = json.loads((ws.state_dir / FILE).read_text())
        return Meta(dict(raw.get("metadata") or {}), str(raw.get("template") or ""),
                    raw.get("allow_internet_access") is not False)
    return Meta()


def save(ws: Workspace, meta: Meta) -> None:
    path = ws.state_dir / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(asdict(meta)))
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one
