"""A content-addressed blob store: every blob is stored once, under its sha256."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StoreStats:
    blobs_written: int
    bytes_written: int
    bytes_deduplicated: int  # bytes put() was asked to store that were already there


class BlobStore:
    """Blobs under root/ab/cdef...; put() of existing content writes nothing.

    Writes go through a temporary name and a rename, so a crash leaves either no blob or a
    complete one, and concurrent writers of the same content cannot interleave.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._known: set[str] = set()  # avoids a stat per block for content seen this run
        self._lock = threading.Lock()
        self._written = 0
        self._bytes = 0
        self._dedup = 0

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest[2:]

    def has(self, digest: str) -> bool:
        return digest in self._known or self.path(digest).exists()

    def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if self.has(digest):
            with self._lock:
                self._known.add(digest)
                self._dedup += len(data)
            return digest
        p = self.path(digest)
        p.parent.mkdir(exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        with self._lock:
            self._known.add(digest)
            self._written += 1
            self._bytes += len(data)
        return digest

    def get(self, digest: str) -> bytes:
        try:
            return self.path(digest).read_bytes()
        except FileNotFoundError:
            raise KeyError(f"blob {digest} is not in the store at {self.root}") from None

    def put_json(self, obj: Any) -> str:
        return self.put(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())

    def get_json(self, digest: str) -> Any:
        return json.loads(self.get(digest))

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._written, self._bytes, self._dedup)

    def disk_bytes(self) -> int:
        """Bytes of all blobs on disk (also those written by earlier runs)."""
        total = 0
        for d in self.root.iterdir():
            if d.is_dir():
                total += sum(f.stat().st_size for f in d.iterdir() if not f.name.startswith("."))
        return total
