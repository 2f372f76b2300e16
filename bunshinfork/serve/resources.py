"""What each sandbox of a server gets (issue 36 item 7): CPU, memory, processes and disk, by
default and per template, as the WorkspaceSpec fields that hold it to them and as E2B's
`cpuCount`, `memoryMB` and `diskSizeMB` in its info.

The defaults are E2B's base template's 2 vCPU and 512 MiB, 1024 processes and threads, and
10 GiB of writes. An operator gives a template more or less with `bunshin serve
--template-limits TEMPLATE cpu=4,memory-mb=2048,disk-mb=20480,pids=4096` (TEMPLATE exactly, or
a `*` pattern as `--allow-template` takes). A sandbox started from a saved snapshot keeps the
limits it was saved with: its processes are restored, not started under new ones.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentException

MiB = 1 << 20
# The spellings --template-limits takes, and the field each sets.
KEYS = {"cpu": "cpu_count", "memory-mb": "memory_mb", "disk-mb": "disk_mb", "pids": "pids"}
# Below these a sandbox cannot start its init, shell and envd's command (spec.py's floors).
FLOORS = {"cpu_count": 1, "memory_mb": 64, "disk_mb": 64, "pids": 16}


@dataclass(frozen=True)
class Resources:
    cpu_count: int = 2  # cores of CPU time per period, shared by its processes
    memory_mb: int = 512
    disk_mb: int = 10240  # its writable layer, and each of its tmpfs mounts
    pids: int = 1024

    def spec(self) -> dict[str, Any]:
        """The WorkspaceSpec fields that hold a sandbox to these (its cgroup, its layer's quota)."""
        return {"cpu_limit": float(self.cpu_count), "memory_limit": self.memory_mb * MiB,
                "disk_limit": self.disk_mb * MiB, "pids_limit": self.pids}

    def reported(self) -> dict[str, int]:
        """E2B's fields; cpuCount as many as the host has at most, since a quota past the host's
        cores gives no more."""
        return {"cpuCount": min(self.cpu_count, os.cpu_count() or 1), "memoryMB": self.memory_mb,
                "diskSizeMB": self.disk_mb}


def parse_override(template: str, text: str) -> tuple[str, dict[str, int]]:
    """`--template-limits TEMPLATE KEY=N[,KEY=N]`: (the template or pattern, the fields it sets)."""
    if not template or template != template.strip():
        raise InvalidArgumentException(f"--template-limits: {template!r} names no template")
    out: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in KEYS:
            raise InvalidArgumentException(
                f"--template-limits {template}: {item!r} is not KEY=N with KEY one of {', '.join(KEYS)}")
        name = KEYS[key]
        if not value.isdigit() or int(value) < FLOORS[name]:
            raise InvalidArgumentException(
                f"--template-limits {template}: {key} must be a whole number of at least {FLOORS[name]}")
        out[name] = int(value)
    return template, out


def for_template(default: Resources, overrides: tuple[tuple[str, dict[str, int]], ...],
                 template: str) -> Resources:
    """`default` with the first override whose template or pattern matches `template`."""
    for pattern, fields in overrides:
        if template == pattern or fnmatch.fnmatchcase(template, pattern):
            return dataclasses.replace(default, **fields)
    return default


__all__ = ["KEYS", "Resources", "for_template", "parse_override"]
