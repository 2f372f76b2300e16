"""E2B's file entry types (FileType, WriteInfo, EntryInfo), shared by files and watch."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import StrEnum


class FileType(StrEnum):
    """A file-system object's kind. A str, so `entry.type == "file"` holds as well."""

    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"


@dataclass
class WriteInfo:
    name: str
    type: FileType | None
    path: str
    metadata: dict[str, str] | None = field(default=None, kw_only=True)


@dataclass
class EntryInfo(WriteInfo):
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: datetime.datetime
    symlink_target: str | None = None

    @property
    def mtime(self) -> float:
        return self.modified_time.timestamp()
