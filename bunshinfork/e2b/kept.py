"""Saved snapshots kept loaded between starts, for a process that starts many sandboxes from
the same few (bunshin serve).

Workspace.from_saved loads the snapshot at every start (its meta read, its layer imported into
the layer store) and releases it after the one fork: 4-5 ms of each sandbox's create. A server
keeps what it loaded instead, each clone still restored after the call that asks for it. An
entry is keyed by its directory and the identity of its snapshot.json, so a snapshot saved
again under the same directory, or deleted, is loaded afresh or not found, never served stale.
Entries are released when evicted (LRU, no fork in flight), forgotten, or at close().
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..errors import BunshinError, TemplateNotFound, WarmTemplateError
from ..workspace import Snapshot, Workspace

CAPACITY = 8  # loaded snapshots kept; each holds a reflinked copy of its layer, and keeps nothing open


@dataclass
class _Entry:
    key: tuple[str, int, int]
    snap: Snapshot
    users: int = 0
    dropped: bool = False  # out of the table: released by whoever ends the last fork


class Kept:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # directory -> entry, oldest first

    def fork_one(self, directory: Path, name: str, timeout: float | None) -> Workspace:
        """One running clone of the snapshot saved at `directory` (the store's `name`), as
        Workspace.from_template makes it."""
        try:
            entry = self._take(directory)
            try:
                (clone,) = entry.snap.fork(1, timeout=timeout)
            finally:
                self._put_back(entry)
            if isinstance(clone, BaseException):
                raise clone
        except FileNotFoundError:
            raise TemplateNotFound(f"no template or saved snapshot {name!r}") from None
        except BunshinError as e:
            raise WarmTemplateError(f"starting from template {name!r} failed: {e}") from e
        return clone

    def forget(self, directory: Path) -> None:
        """Stop keeping `directory`'s snapshot (it is about to be deleted)."""
        with self._lock:
            entry = self._entries.pop(str(directory), None)
            doomed = self._drop(entry)
        _release(doomed)

    def close(self) -> None:
        with self._lock:
            doomed = [e for e in (self._drop(e) for e in self._entries.values()) if e is not None]
            self._entries.clear()
        for e in doomed:
            _release(e)

    def __len__(self) -> int:
        return len(self._entries)

    # ---- the table ----

    def _take(self, directory: Path) -> _Entry:
        st = os.stat(directory / Snapshot.layout.meta)  # FileNotFoundError: deleted since it was found
        key = (str(directory), st.st_ino, st.st_mtime_ns)
        doomed: list[_Entry] = []
        with self._lock:
            entry = self._entries.get(key[0])
            if entry is not None and entry.key != key:  # saved again in the same place
                del self._entries[key[0]]
                doomed.append(self._drop(entry))  # type: ignore[arg-type]
                entry = None
            if entry is not None:
                self._entries.move_to_end(key[0])
                entry.users += 1
        for e in doomed:
            _release(e)
        if entry is not None:
            return entry
        # Loaded outside the lock (a few ms); two first starts of one snapshot both load, and
        # the one that comes second is released with its fork.
        fresh = _Entry(key, Snapshot.load(directory), users=1)
        with self._lock:
            if key[0] in self._entries:
                fresh.dropped = True
                return fresh
            self._entries[key[0]] = fresh
            while len(self._entries) > self.capacity:
                _, old = self._entries.popitem(last=False)
                doomed.append(self._drop(old))  # type: ignore[arg-type]
        for e in doomed:
            _release(e)
        return fresh

    def _put_back(self, entry: _Entry) -> None:
        with self._lock:
            entry.users -= 1
            last = entry.dropped and entry.users == 0
        if last:
            entry.snap.release()

    def _drop(self, entry: _Entry | None) -> _Entry | None:
        """Mark `entry` out of the table (lock held); it, where nobody forks from it now."""
        if entry is None:
            return None
        entry.dropped = True
        return entry if entry.users == 0 else None


def _release(entry: _Entry | None) -> None:
    if entry is not None:
        entry.snap.release()
