"""Files that name a workspace inside its own layer: /etc/hostname and /etc/hosts."""

from __future__ import annotations

from pathlib import Path


def write_identity(upper: Path, hostname: str) -> None:
    """/etc/hostname and /etc/hosts naming this workspace (a clone gets its own)."""
    etc = upper / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "hostname").write_text(hostname + "\n")
    (etc / "hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
