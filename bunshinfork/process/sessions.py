"""The CRIU processes bunshin has running, recorded so that gc can end one whose caller died.

A restore's CRIU is started with PR_SET_PDEATHSIG (criu.Session), so it normally dies with its
caller; this record is the backstop for the moment before the prctl and for a dump's CRIU, which
is let finish on its own (killing it mid-parasite would leave the source changed) until its
deadline passes. Each entry names the CRIU and its caller by pid and start time, so gc never
signals a recycled pid, a CRIU of a live caller, or a CRIU that bunshin did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from pathlib import Path

from .. import state

DIR = ".criu"  # under state.RUN_ROOT: one file per running CRIU, named by its pid


def _dir() -> Path:
    return state.RUN_ROOT / DIR


def record(criu_pid: int, kind: str, deadline: float, images: list[int] | None = None) -> Path | None:
    """Record a running CRIU (`kind`: dump, pre_dump or restore) started by this process, whose
    caller would kill it at wall-clock `deadline`, writing into the directory `images` names
    (dir_id; a dump's). None when there is no state root to record in."""
    start = state.proc_starttime(criu_pid)
    if start is None or not state.RUN_ROOT.is_dir():
        return None
    d = _dir()
    d.mkdir(mode=0o700, exist_ok=True)
    entry = {"criu": [criu_pid, start], "caller": [os.getpid(), state.proc_starttime(os.getpid())],
             "kind": kind, "deadline": deadline, "images": images}
    path = d / str(criu_pid)
    tmp = d / f".{criu_pid}.tmp"
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)
    return path


def forget(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def dir_id(path: Path | str) -> list[int]:
    """What names a directory even once it is moved or removed: its device and inode."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino]


def end_helpers(images: list[int]) -> list[int]:
    """SIGKILL what is left of a dump's CRIU once the CRIU itself is gone: the helpers it forks
    share its descriptor table, so they hold its images directory (`images`: dir_id) open. A
    soak saw one outlive a CRIU killed mid-dump, stopped, reparented to pid 1 and recorded
    nowhere. A dump's images directory is its own: no other CRIU holds it. Returns the pids
    ended."""
    ended = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (d / "comm").read_text().strip() != "criu" or not _holds_dir(d, images):
                continue
            os.kill(int(d.name), signal.SIGKILL)
            ended.append(int(d.name))
    return ended


def _holds_dir(proc: Path, ident: list[int]) -> bool:
    for fd in os.listdir(proc / "fd"):
        with contextlib.suppress(OSError):
            st = os.stat(proc / "fd" / fd)
            if [st.st_dev, st.st_ino] == ident:
                return True
    return False


def alive(pid: int, start: int | None) -> bool:
    """`pid` is still the process started at `start`, and not yet a zombie (whose reaping is
    pid 1's business once its parent, the caller, is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return start is not None and fields[0] not in "ZX" and int(fields[19]) == start


def gc() -> list[str]:
    """End each recorded CRIU whose caller is gone: a restore's at once (its clone is being
    removed anyway), a dump's once its deadline has passed. Returns what was ended."""
    d = _dir()
    ended = []
    for name in sorted(os.listdir(d)) if d.is_dir() else []:
        if not name.isdigit():
            continue
        path = d / name
        try:
            entry = json.loads(path.read_text())
            (pid, start), (caller, caller_start) = entry["criu"], entry["caller"]
            kind, deadline, images = entry["kind"], float(entry["deadline"]), entry.get("images")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not alive(pid, start):
            if images and not alive(caller, caller_start):
                ended += [f"criu helper pid {p} of a {kind}" for p in end_helpers(images)]
            forget(path)
            continue
        if alive(caller, caller_start) or (kind != "restore" and time.time() < deadline):
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            forget(path)
            continue
        try:
            # Checked again through the pidfd: the pid cannot be recycled while it is open.
            if alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                # Gone before gc removes what it was restoring into (its parent, pid 1, reaps it).
                select.select([pidfd], [], [], 5.0)
                ended.append(f"criu {kind} pid {pid} (caller {caller} gone)")
        finally:
            os.close(pidfd)
        if images:
            ended += [f"criu helper pid {p} of a {kind}" for p in end_helpers(images)]
        forget(path)
    return ended
