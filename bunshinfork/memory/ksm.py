"""Kernel samepage merging: tune ksmd up during a fork burst, relax it once merging settles.

Only processes that opted in (prctl PR_SET_MEMORY_MERGE, inherited by everything a workspace
starts and by CRIU-restored clones) are scanned, so merging stays within fork families that
asked for it. Cross-tenant KSM is a timing side channel: do not mix tenants' workspaces
with ksm enabled on one host.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import native, state
from ..contract import Check

KSM = Path("/sys/kernel/mm/ksm")
BOOST = {"run": "1", "pages_to_scan": "4000", "sleep_millisecs": "5"}
KNOBS = ("pages_to_scan", "sleep_millisecs", "run")  # written in this order: run last
# ksmd's knobs are the machine's, whichever bunshin host (state root) boosts them, so the boost
# record and its lock are the machine's too: a host of a local pool that boosts and dies is then
# pruned by any other host, and the knobs come back.
BOOST_PATH = Path("/run/bunshin-ksm/boost.json")
IDLE_AFTER = 5.0


def available() -> bool:
    """ksmd exists (its knobs and counters); see merge_supported() for the fork engine."""
    return (KSM / "run").exists()


def knobs() -> dict[str, str]:
    """The ksmd tunables this module changes, as their files read now."""
    return {k: (KSM / k).read_text().strip() for k in KNOBS}


def set_knobs(values: dict[str, str], ignore_errors: bool = False) -> None:
    """Write the given knobs, `run` last, so that ksmd starts (or stops) at its new rate."""
    for k in KNOBS:
        if k in values:
            try:
                (KSM / k).write_text(values[k])
            except OSError:
                if not ignore_errors:
                    raise


def merge_supported() -> bool:
    """Whether processes can opt in as a whole (PR_SET_MEMORY_MERGE, Linux 6.4): the ksm engine."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    if not available():
        return "the kernel has no KSM (/sys/kernel/mm/ksm is absent)"
    try:
        native.prctl(native.PR_GET_MEMORY_MERGE)
    except OSError as e:
        why = "Linux < 6.4" if e.errno == errno.EINVAL else os.strerror(e.errno or 0)
        return f"prctl(PR_GET_MEMORY_MERGE) fails ({why}): processes cannot opt into KSM as a whole"
    return None


def check_ksm() -> Check:
    """doctor's probe: whether ksmd runs, and whether processes can opt in (the ksm engine, spec.ksm)."""
    run_file = KSM / "run"
    if not run_file.exists():
        return Check("ksm", False, "/sys/kernel/mm/ksm is absent (kernel without CONFIG_KSM)", required=False)
    try:
        run = run_file.read_text().strip()
    except OSError as e:
        run = f"unreadable ({e.strerror})"
    meaning = {"0": "stopped", "1": "running", "2": "unmerging"}.get(run, "")
    detail = f"run={run}" + (f" ({meaning})" if meaning else "")
    if why := unavailable_reason():
        return Check("ksm", False, f"{detail}; {why}, so memory='ksm' and ksm=True are unavailable",
                     required=False)
    return Check("ksm", True, f"{detail}; prctl(PR_GET_MEMORY_MERGE) works", required=False)


def _read(name: str) -> int:
    return int((KSM / name).read_text().split()[0])


@dataclass(frozen=True)
class Progress:
    pages_shared: int
    pages_sharing: int
    pages_unshared: int
    full_scans: int
    general_profit: int

    @property
    def saved_bytes(self) -> int:
        return self.pages_sharing * 4096


def progress() -> Progress:
    return Progress(
        pages_shared=_read("pages_shared"), pages_sharing=_read("pages_sharing"),
        pages_unshared=_read("pages_unshared"), full_scans=_read("full_scans"),
        general_profit=_read("general_profit") if (KSM / "general_profit").exists() else 0,
    )


def _pages_scanned() -> int | None:
    # Absent before 6.4; then only the rmap counters tell that nothing is left to scan.
    return _read("pages_scanned") if (KSM / "pages_scanned").exists() else None


def _nothing_in_scope() -> bool:
    return all(_read(n) == 0 for n in ("pages_shared", "pages_unshared", "pages_volatile"))


class _Tuner:
    """A host-wide, crash-safe boost of ksmd.

    Each process counts its own bursts. The first process to boost saves the knobs in a file
    under the state root and lists itself there as a holder; later boosters only add
    themselves. A process leaves the list once merging settles after its last burst, or at
    exit; whoever leaves it empty restores the saved knobs. A holder that died without
    leaving (SIGKILL) is pruned by the next process to touch the file and by `gc()`, so ksmd
    never stays boosted for a process that is gone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bursts = 0
        self._registered = False
        self._relaxer: threading.Thread | None = None
        atexit.register(self._leave)

    def boost(self) -> None:
        if not available():
            return
        with self._lock:
            self._bursts += 1
            if not self._registered:
                with _shared() as record:
                    if not record.get("saved"):
                        record["saved"] = knobs()
                    record["holders"][str(os.getpid())] = state.proc_starttime(os.getpid())
                    # A later booster re-asserts the boost: an admin may have changed the knobs in between.
                    set_knobs(BOOST)
                self._registered = True

    def release(self) -> None:
        """End a burst; ksmd stays boosted in the background until merging settles."""
        if not available():
            return
        with self._lock:
            self._bursts -= 1
            if self._bursts == 0 and (self._relaxer is None or not self._relaxer.is_alive()):
                self._relaxer = threading.Thread(target=self._relax_when_settled, daemon=True,
                                                 name="bunshin-ksm-relax")
                self._relaxer.start()

    def wait_settled(self, timeout: float = 120.0, quiet_scans: int = 2, min_scans: int = 4) -> Progress:
        """Block until `quiet_scans` full scans pass without new merges (or the timeout).

        ksmd merges a page only on the scan after it first saw it unchanged, so the first scans
        after a fork merge nothing yet: at least `min_scans` full scans must pass as well.
        """
        deadline = time.monotonic() + timeout
        first = last = progress()
        scanned, scanned_at = _pages_scanned(), time.monotonic()
        quiet = 0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = progress()
            if now.full_scans > last.full_scans:
                quiet = quiet + 1 if now.pages_sharing <= last.pages_sharing else 0
                last = now
                if quiet >= quiet_scans and now.full_scans - first.full_scans >= min_scans:
                    break
            if (n := _pages_scanned()) != scanned:
                scanned, scanned_at = n, time.monotonic()
            elif time.monotonic() - scanned_at > IDLE_AFTER and _nothing_in_scope():
                # ksmd sleeps, scanning nothing, once no process that opted in is left. A ksmd
                # merely starved of CPU on a loaded host still scans some pages every few seconds.
                break
        return last

    def _relax_when_settled(self) -> None:
        self.wait_settled()
        with self._lock:
            if self._bursts == 0:
                self._leave_locked()

    def _leave(self) -> None:
        with self._lock:
            self._leave_locked()

    def _leave_locked(self) -> None:
        if not self._registered:
            return
        with contextlib.suppress(OSError), _shared() as record:
            record["holders"].pop(str(os.getpid()), None)
        self._registered = False

    def relax_now(self) -> None:
        """Leave the boost at once instead of after merging settles (no-op during a burst)."""
        with self._lock:
            if self._bursts == 0:
                self._leave_locked()

    def boosted(self) -> bool:
        return self._registered


def prune() -> list[int]:
    """Drop holders that died without leaving, restoring the knobs when none is left; returns their pids."""
    if not available() or not BOOST_PATH.exists():
        return []
    with _shared() as record:
        listed = set(record["holders"])
    return sorted(int(pid) for pid in listed - set(record["holders"]))


def reconcile() -> bool:
    """prune(); returns whether ksmd is still boosted by a live process."""
    prune()
    return BOOST_PATH.exists()


@contextlib.contextmanager
def _shared() -> Iterator[dict[str, Any]]:
    """The boost record under a host-wide lock; on the way out, dead holders are pruned and the
    saved knobs restored (and the record removed) once no holder is left."""
    path = BOOST_PATH
    with state.lock("ksm-boost", root=path.parent):
        try:
            record = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            record = {}
        record.setdefault("holders", {})
        yield record
        record["holders"] = {pid: start for pid, start in record["holders"].items()
                             if start is not None and state.proc_starttime(int(pid)) == start}
        if record["holders"]:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
            return
        set_knobs(record.get("saved", {}), ignore_errors=True)
        path.unlink(missing_ok=True)


tuner = _Tuner()
