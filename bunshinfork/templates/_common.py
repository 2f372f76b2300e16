"""Helpers shared by the workspace templates: checked commands, daemons, users, polling."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from ..commands import CommandResult
from ..errors import BunshinError
from ..workspace import Workspace

T = TypeVar("T")

# Chromium's time-zone monitor puts an inotify watch on the directory /etc/localtime points
# into (/usr/share/zoneinfo/Etc). That directory comes from the overlay's lower layer, whose
# file handles cannot be reopened, and CRIU's inode-to-path fallback only scans /etc and a
# few other hint paths, so the dump fails with "fsnotify: Can't dump that handle". With TZ set
# Chromium watches nothing there (time_zone_monitor_linux.cc), and every other program agrees.
BASE_ENV = {"TZ": "UTC"}


class TemplateError(BunshinError):
    """A template could not bring its workspace up; the message carries the failing step's output."""


def run(ws: Workspace, cmd: str | list[str], *, env: Mapping[str, str] | None = None, timeout: float = 60,
        check: bool = True, cwd: str | None = None) -> CommandResult:
    r = ws.commands.run(cmd, env={**BASE_ENV, **(env or {})}, timeout=timeout, cwd=cwd)
    assert isinstance(r, CommandResult)
    if check and r.exit_code != 0:
        shown = cmd if isinstance(cmd, str) else shlex.join(cmd)
        raise TemplateError(f"{shown!r} exited {r.exit_code} in {ws.id}\nstdout: {r.stdout[-2000:]}\n"
                            f"stderr: {r.stderr[-2000:]}")
    return r


def start_daemon(ws: Workspace, cmd: str, log: str, *, env: Mapping[str, str] | None = None,
                 cwd: str = "/root") -> None:
    """Start `cmd` detached in its own session.

    Its own session, because the init kills a foreground command's process group when the
    client that ran it goes away; a daemon must outlive the call that started it.
    """
    run(ws, f"cd {shlex.quote(cwd)} && setsid -f {cmd} > {shlex.quote(log)} 2>&1 < /dev/null", env=env)


def wait_until(probe: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.05,
               error: type[Exception] = TemplateError) -> T:
    """Poll `probe` until it returns something true; `error` once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
        interval = min(interval * 1.5, 0.5)


def add_user(ws: Workspace, name: str, uid: int, home: str, shell: str = "/bin/sh") -> None:
    """Add a system user and its group to the workspace's generated /etc (idempotent).

    The host rootfs's /etc is generated with root, daemon and nobody only; services that
    refuse to run as root (PostgreSQL) need an account of their own.
    """
    passwd = str(ws.files.read("/etc/passwd"))
    if not any(line.split(":", 1)[0] == name for line in passwd.splitlines()):
        ws.files.write("/etc/passwd", passwd.rstrip("\n") + f"\n{name}:x:{uid}:{uid}:{name}:{home}:{shell}\n")
    group = str(ws.files.read("/etc/group"))
    if not any(line.split(":", 1)[0] == name for line in group.splitlines()):
        ws.files.write("/etc/group", group.rstrip("\n") + f"\n{name}:x:{uid}:\n")


def fork_hint(err: Exception) -> Exception:
    """Add what to do to fork errors whose cause is known, keep the rest as they are."""
    text = str(err)
    if "Can't get rlimit" in text:
        return TemplateError(
            f"{text}\nCRIU could not read the resource limits of a process running under another uid "
            "(prlimit needs CAP_SYS_RESOURCE, which this host's capability bounding set lacks). "
            "Rebuild CRIU with criu/patches/0001-dump-rlimits-from-proc.patch: bash scripts/setup.sh"
        )
    return err
