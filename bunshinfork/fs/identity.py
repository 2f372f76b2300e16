"""Files every workspace gets in its own private layer: its identity, and a home."""

from __future__ import annotations

import os
from pathlib import Path

from ..state import Rootfs


def seed(upper: Path, hostname: str, root_fs: Rootfs) -> None:
    """A new workspace's layer: /etc/hostname and /etc/hosts, and /root where the rootfs has none."""
    write_identity(upper, hostname)
    # Commands start in /root and relative file paths resolve under it, so a directory rootfs
    # without one would refuse every command; a rootfs that has it keeps its own.
    if not any(os.path.lexists(Path(lower, "root")) for lower in root_fs.lowerdirs):
        (upper / "root").mkdir(mode=0o700)


def write_identity(upper: Path, hostname: str) -> None:
    """/etc/hostname and /etc/hosts naming this workspace (a clone gets its own)."""
    etc = upper / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "hostname").write_text(hostname + "\n")
    (etc / "hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
