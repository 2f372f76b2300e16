"""E2B's own state of a sandbox (its metadata, the template it came from, its lifecycle and,
where the lifecycle pauses it, its deadline, whether internet access was asked), in a file of
its own beside the workspace's record: destroy() removes it with the record, a pause to disk
keeps it, and the core record knows nothing of E2B."""

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
    on_timeout: str = "kill"
    auto_resume: bool = False
    # Wall clock, for a lifecycle that pauses at the deadline (a kill is the init's: its record
    # keeps that deadline); inf: none.
    deadline: float = float("inf")
    allow_internet_access: bool = True  # as asked (E2B reports it apart from its rules)


def load(ws: Workspace) -> Meta:
    """What the sandbox's file says now (another process may have written it); empty if none."""
    with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
        raw = json.loads((ws.state_dir / FILE).read_text())
        deadline = raw.get("deadline")
        return Meta(dict(raw.get("metadata") or {}), str(raw.get("template") or ""),
                    str(raw.get("on_timeout") or "kill"), bool(raw.get("auto_resume")),
                    float("inf") if deadline is None else float(deadline),
                    raw.get("allow_internet_access") is not False)
    return Meta()


def save(ws: Workspace, meta: Meta) -> None:
    path = ws.state_dir / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}")
    raw = asdict(meta)
    raw["deadline"] = None if meta.deadline == float("inf") else meta.deadline
    tmp.write_text(json.dumps(raw))
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one
