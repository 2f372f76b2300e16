"""expected_failures.txt: the tests of E2B's suite that cannot pass against `bunshin serve`, one
a line, `node id | modes | category | evidence`. Modes are `http` (E2B_API_URL = E2B_SANDBOX_URL),
`domain` (E2B_DOMAIN over TLS) or both, comma-separated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODES = ("http", "domain")
# Why a test may be excused: it needs the public internet (never reached from here), one of
# E2B's cloud templates or cloud-only services, or it fails against E2B's own cloud with the
# pinned SDK; `plain-http` is a test that needs `<port>-<id>.<domain>` names and TLS, which the
# domain mode runs.
CATEGORIES = ("internet", "cloud-template", "sdk-version", "plain-http", "rootfs-fs")


@dataclass(frozen=True)
class Entry:
    node_id: str
    modes: tuple[str, ...]
    category: str
    evidence: str


def load(path: Path) -> list[Entry]:
    entries = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) != 4 or not all(parts):
            raise ValueError(f"{path}:{n}: want 'node id | modes | category | evidence': {raw!r}")
        node_id, modes, category, evidence = parts
        mode_list = tuple(m.strip() for m in modes.split(","))
        if not set(mode_list) <= set(MODES) or category not in CATEGORIES:
            raise ValueError(f"{path}:{n}: modes must be of {MODES}, the category one of {CATEGORIES}: {raw!r}")
        entries.append(Entry(node_id, mode_list, category, evidence))
    ids = [e.node_id for e in entries]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{path}: a node id is listed twice")
    return entries
