"""The server's sandbox registry: E2B's sandbox id -> the workspace behind it (paused to disk
or running), its lifetime, lifecycle, metadata and tokens. Every entry is also a JSON file
under the state directory, so that the next server after a crash (SIGKILL included) finds the
paused sandboxes to keep and the running ones to reap."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..aio import AsyncSandbox
from ..e2b.lifecycle import Lifecycle
from ..workspace import WorkspaceInfo


@dataclass
class Entry:
    sandbox_id: str
    template: str
    metadata: dict[str, str]
    started_at: float
    deadline: float  # wall clock; inf: none
    lifecycle: Lifecycle
    envd_token: str
    traffic_token: str | None  # set when allow_public_traffic is False
    allow_internet_access: bool = False
    workspace_id: str | None = None  # the bunshin workspace behind it (paused to disk, it keeps its id)
    paused: bool = False
    # The resources it got (0: not recorded, the template's by the server's limits apply).
    cpu_count: int = 0
    memory_mb: int = 0
    disk_mb: int = 0
    mask_request_host: str | None = None  # network.maskRequestHost: the Host its port proxy sends in
    sbx: AsyncSandbox | None = field(default=None, repr=False, compare=False)  # None while paused
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False, compare=False)

    def limits_from(self, info: WorkspaceInfo) -> None:
        if info.cpu_limit:
            self.cpu_count = max(1, round(info.cpu_limit))
        self.memory_mb = (info.memory_limit or 0) >> 20
        self.disk_mb = (info.disk_limit or 0) >> 20

    def reported(self) -> dict[str, int]:
        """E2B's cpuCount, memoryMB and diskSizeMB, where recorded."""
        got = {"cpuCount": min(self.cpu_count, os.cpu_count() or 1), "memoryMB": self.memory_mb,
               "diskSizeMB": self.disk_mb}
        return {k: v for k, v in got.items() if v}

    @property
    def state(self) -> str:
        return "paused" if self.paused else "running"

    def to_json(self) -> dict[str, Any]:
        # Not asdict(): it would deep-copy the live objects (the sandbox, its lock, its timer).
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sbx", "lock", "timer")}
        d["lifecycle"] = asdict(self.lifecycle)
        d["metadata"] = dict(self.metadata)
        d["deadline"] = None if self.deadline == float("inf") else self.deadline
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Entry:
        d = dict(d)
        d["lifecycle"] = Lifecycle(**d["lifecycle"])
        d["deadline"] = float("inf") if d["deadline"] is None else d["deadline"]
        return cls(**d)


def new_id() -> str:
    return "i" + secrets.token_hex(10)


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries: dict[str, Entry] = {}
        # The records hold sandboxes' access tokens, paused/ their memory: the server's alone.
        for d in (root, root / "sandboxes", root / "paused", root / "snapshots"):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)  # one made by an older server, or under another umask

    # ---- the snapshots this server saved (the template store is the host's, shared) ----

    def own_snapshot(self, snapshot_id: str) -> None:
        (self.root / "snapshots" / snapshot_id).touch()

    def disown_snapshot(self, snapshot_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / "snapshots" / snapshot_id).unlink()

    def snapshots(self) -> set[str]:
        """The ids of the snapshots this server saved (some may have been removed since)."""
        return {p.name for p in (self.root / "snapshots").iterdir()}

    def paused_dir(self, sandbox_id: str) -> Path:
        return self.root / "paused" / sandbox_id

    def _file(self, sandbox_id: str) -> Path:
        return self.root / "sandboxes" / f"{sandbox_id}.json"

    def save(self, e: Entry) -> None:
        tmp = self._file(e.sandbox_id).with_suffix(".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a torn earlier write keeps no mode of its own
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(e.to_json()))
        os.replace(tmp, self._file(e.sandbox_id))

    def add(self, e: Entry) -> None:
        self.entries[e.sandbox_id] = e
        self.save(e)

    def drop(self, sandbox_id: str) -> Entry | None:
        """Forget a sandbox and remove what it kept on disk (its record, a paused state)."""
        e = self.entries.pop(sandbox_id, None)
        with contextlib.suppress(FileNotFoundError):
            self._file(sandbox_id).unlink()
        shutil.rmtree(self.paused_dir(sandbox_id), ignore_errors=True)
        if e is not None and e.timer is not None:
            e.timer.cancel()
        return e

    def recorded(self) -> list[Entry]:
        """What a previous server left: every record that parses (a torn one is dropped)."""
        out = []
        for f in sorted((self.root / "sandboxes").glob("*.json")):
            try:
                out.append(Entry.from_json(json.loads(f.read_text())))
            except (ValueError, TypeError, KeyError):
                f.unlink(missing_ok=True)
        for partial in (self.root / "paused").glob("*.partial"):
            shutil.rmtree(partial, ignore_errors=True)
        return out
