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


def record(criu_pid: int, kind: str, deadline: float) -> Path | None:
    """Record a running CRIU (`kind`: dump, pre_dump or restore) started by this process, whose
    caller would kill it at wall-clock `deadline`. None when there is no state root to record in."""
    start = state.proc_starttime(criu_pid)
    if start is None or not state.RUN_ROOT.is_dir():
        return None
    d = _dir()
    d.mkdir(mode=0o700, exist_ok=True)
    entry = {"criu": [criu_pid, start], "caller": [os.getpid(), state.proc_starttime(os.getpid())],
             "kind": kind, "deadline": deadline}
    path = d / str(criu_pid)
    tmp = d / f".{criu_pid}.tmp"
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, path)
    return path


def forget(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


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
            kind, deadline = entry["kind"], float(entry["deadline"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not alive(pid, start):
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
        forget(path)
    return ended
