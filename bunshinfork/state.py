"""Where workspaces live on the host: /run/bunshin/<id>, like runc, so no daemon is needed.

A workspace's record (state.json) is the single source of truth that lets a
second process connect to, or garbage-collect, a workspace another process made.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import native

RUN_ROOT = Path(os.environ.get("BUNSHIN_RUN_ROOT", "/run/bunshin"))


def run_root() -> Path:
    """The state root, on its own tmpfs when it would otherwise share the host root's file system.

    Overlayfs refuses a layer that lies inside another layer on the same file system, and the
    host rootfs uses the host's `/` as its bottom layer; a separate tmpfs keeps the generated
    layers and default upper directories out of it.
    """
    RUN_ROOT.mkdir(parents=True, exist_ok=True, mode=0o711)
    if os.stat(RUN_ROOT).st_dev == os.stat("/").st_dev:
        with lock("mount-run-root", root=Path("/run")):
            if os.stat(RUN_ROOT).st_dev == os.stat("/").st_dev:
                native.mount("bunshin", str(RUN_ROOT), "tmpfs", native.MS_NOSUID | native.MS_NODEV, "mode=711")
    return RUN_ROOT


@contextlib.contextmanager
def lock(name: str, root: Path | None = None) -> Iterator[None]:
    """A host-wide advisory lock (flock), held across processes."""
    d = root or RUN_ROOT
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / f".{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def new_id() -> str:
    return "ws-" + secrets.token_hex(6)


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat: tells a live process from a recycled pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _running(pid: int, starttime: int) -> bool:
    """The process is the one recorded and has not exited (a zombie awaiting its reaper has)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == starttime


@dataclass
class Record:
    id: str
    status: str  # creating | running | destroyed
    creator_pid: int
    created_at: float
    hostname: str
    init_pid: int = 0
    init_starttime: int = 0
    rootfs: dict = field(default_factory=dict)
    storage: dict = field(default_factory=dict)
    cgroup: dict = field(default_factory=dict)
    network: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    parent: str | None = None
    # Lifetime (see lifetime.py): wall-clock deadline and creator lease in seconds, 0 for none.
    deadline: float = 0.0
    lease: float = 0.0
    # E2B's sandbox metadata and the template it was created from.
    metadata: dict = field(default_factory=dict)
    template: str = ""

    @property
    def dir(self) -> Path:
        return RUN_ROOT / self.id

    def save(self) -> None:
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1, sort_keys=True))
        os.replace(tmp, self.dir / "state.json")

    @classmethod
    def load(cls, ws_id: str) -> Record:
        data = json.loads((RUN_ROOT / ws_id / "state.json").read_text())
        return cls(**data)

    def init_alive(self) -> bool:
        return bool(self.init_pid) and _running(self.init_pid, self.init_starttime)

    def creator_alive(self) -> bool:
        return proc_starttime(self.creator_pid) is not None


def all_ids() -> list[str]:
    if not RUN_ROOT.is_dir():
        return []
    return sorted(n for n in os.listdir(RUN_ROOT) if n.startswith("ws-") and (RUN_ROOT / n).is_dir())
