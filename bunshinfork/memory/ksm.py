"""Kernel samepage merging: tune ksmd up during a fork burst, relax it once merging settles.

Only processes that opted in (prctl PR_SET_MEMORY_MERGE, inherited by everything a workspace
starts and by CRIU-restored clones) are scanned, so merging stays within fork families that
asked for it. Cross-tenant KSM is a timing side channel: do not mix tenants' workspaces
with ksm enabled on one host.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

KSM = Path("/sys/kernel/mm/ksm")
BOOST = {"run": "1", "pages_to_scan": "4000", "sleep_millisecs": "5"}
KNOBS = ("run", "pages_to_scan", "sleep_millisecs")


def available() -> bool:
    return (KSM / "run").exists()


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


class _Tuner:
    """Reference-counted boost: the first burst saves the knobs, the last restores them
    once two full scans in a row merged nothing new."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bursts = 0
        self._saved: dict[str, str] | None = None
        self._relaxer: threading.Thread | None = None

    def boost(self) -> None:
        if not available():
            return
        with self._lock:
            self._bursts += 1
            if self._saved is None:
                self._saved = {k: (KSM / k).read_text().strip() for k in KNOBS}
                for k, v in BOOST.items():
                    (KSM / k).write_text(v)

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
        quiet = 0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = progress()
            if now.full_scans > last.full_scans:
                quiet = quiet + 1 if now.pages_sharing <= last.pages_sharing else 0
                last = now
                if quiet >= quiet_scans and now.full_scans - first.full_scans >= min_scans:
                    break
        return last

    def _relax_when_settled(self) -> None:
        self.wait_settled()
        with self._lock:
            if self._bursts == 0 and self._saved is not None:
                for k in ("pages_to_scan", "sleep_millisecs", "run"):
                    with contextlib.suppress(OSError):
                        (KSM / k).write_text(self._saved[k])
                self._saved = None

    def boosted(self) -> bool:
        return self._saved is not None


tuner = _Tuner()
