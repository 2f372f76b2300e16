"""A watchdog started with every freeze: the source is never left frozen past its deadline.

The watchdog is `bunshin-init --watchdog` (csrc/watchdog.c), a small static process started
outside the workspace's cgroup in a session of its own, so neither the freeze, a Ctrl-C in
the caller's terminal nor the caller's death stops it. It reads a pipe from the caller: the
caller registers the CRIU processes it starts and says when it has thawed. If the caller dies
first (the pipe's end-of-file) or the `frozen` deadline passes, the watchdog thaws the cgroup
itself, kills what was registered once the deadline has passed, and appends what it did to
`events()` (`/run/bunshin/watchdog.log`), which is how a soak run learns the longest freeze
even of callers it killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .. import state
from ..errors import KernelFeatureError
from ..process.init import INIT_BINARY as BINARY

LOG_NAME = "watchdog.log"


def log_path() -> Path:
    return state.run_root() / LOG_NAME


class Watchdog:
    """One freeze's watchdog process; `register()` CRIU, `done()` once thawed."""

    def __init__(self, freeze_file: Path, deadline: float, label: str) -> None:
        if not BINARY.exists():
            raise KernelFeatureError(f"{BINARY} is missing; reinstall bunshin (scripts/setup.sh)")
        r, self._w = os.pipe2(os.O_CLOEXEC)
        try:
            self._proc = subprocess.Popen(
                [str(BINARY), "--watchdog", str(freeze_file), str(max(1, int(deadline * 1000))),
                 str(log_path()), label],
                stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
        except BaseException:
            os.close(self._w)
            raise
        finally:
            os.close(r)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def register(self, pid: int) -> None:
        """A helper (CRIU) to kill should the deadline pass while it runs."""
        self._send(f"k {pid}\n")

    def done(self) -> None:
        """The caller has thawed the workspace: the watchdog exits without acting."""
        self._send("d\n")
        with contextlib.suppress(OSError):
            os.close(self._w)
        self._w = -1
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _send(self, msg: str) -> None:
        if self._w >= 0:
            # A watchdog that already acted (deadline) has exited: nothing left to tell it.
            with contextlib.suppress(BrokenPipeError):
                os.write(self._w, msg.encode())


@contextlib.contextmanager
def guard(freezer_dir: str, deadline: float, label: str) -> Iterator[Watchdog]:
    """Watch a freeze of the cgroup v2 directory `freezer_dir` for `deadline` seconds. The
    caller must thaw before leaving the block; the watchdog is then told it is done."""
    wd = Watchdog(Path(freezer_dir) / "cgroup.freeze", deadline, label)
    try:
        yield wd
    finally:
        wd.done()


def events(workspace: str | None = None) -> list[dict]:
    """What watchdogs did (thawed a workspace whose caller died or overran), oldest first."""
    try:
        lines = log_path().read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if workspace is None or e.get("workspace") == workspace:
                out.append(e)
    return out
