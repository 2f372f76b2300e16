"""Small polling and inspection helpers shared by the workspace tests (no fixtures: see each module)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from bunshinfork import state
from bunshinfork.commands import CommandResult
from bunshinfork.errors import FileOperationError
from bunshinfork.workspace import Workspace

T = TypeVar("T")


ROOT = Path(__file__).resolve().parent.parent


def load_by_path(name: str, relpath: str, register: bool = False) -> ModuleType:
    """The module at `relpath` (from the repository's root), loaded by its path under `name`:
    benchmarks/ on sys.path would shadow the tests' own `workloads` package, and kernel/ is no
    package. register: put it in sys.modules (dataclasses and pickling look a module up by name)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wait_for(probe: Callable[[], T], timeout: float = 5.0, interval: float = 0.02) -> T:
    """Poll until `probe` returns something truthy; return it, or fail with the last value.

    Processes inside a workspace change state asynchronously (a kill, a reparenting, a
    server binding its port), so tests poll with a deadline instead of sleeping blindly.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value or time.monotonic() > deadline:
            assert value, f"condition not met within {timeout}s (last value {value!r})"
            return value
        time.sleep(interval)


def run_ok(ws: Workspace, cmd: str | list[str], **kw: object) -> CommandResult:
    """Run a foreground command that must succeed; the assertion shows its output when it does not."""
    r = ws.commands.run(cmd, **kw)  # type: ignore[arg-type]
    assert isinstance(r, CommandResult)
    assert r.exit_code == 0, f"{cmd!r} exited {r.exit_code}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r


def read_counter(ws: Workspace, path: str) -> int:
    """The value a background `echo $i > path` loop last wrote.

    The shell truncates before writing, so an empty read is a write in progress: retry it.
    """
    def probe() -> int | None:
        with contextlib.suppress(FileOperationError, ValueError):
            return int(str(ws.files.read(path)).strip())
        return None

    deadline = time.monotonic() + 5
    while (value := probe()) is None:
        assert time.monotonic() < deadline, f"{path} never held a number"
        time.sleep(0.01)
    return value


def ws_processes(ws: Workspace) -> list[str]:
    """Command lines of every process in the workspace, as `ps` inside it shows them."""
    r = run_ok(ws, ["ps", "-eo", "args="])
    return [line.strip() for line in r.stdout.splitlines()]


def host_proc_state(pid: int) -> str | None:
    """The one-letter state of a host pid, or None once it is gone (reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def init_gone(ws: Workspace) -> bool:
    """The workspace's init has exited and been reaped (a recycled pid does not count as it)."""
    return state.proc_starttime(ws.init_pid) != ws._rec.process.starttime


def free_tcp_port() -> int:
    """A port nothing on the host listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_fd_targets(pid: int) -> list[str]:
    out = []
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


# A process that holds 200 MiB and answers SIGUSR1 with how much of it still reads back: what a
# pause to disk must give back to the host and a resume must bring back (E2B's and ours).
HOG = ("python3 -c \"import signal,sys; b=bytearray(b'q')*(200<<20); "
       "signal.signal(signal.SIGUSR1, lambda *a: open('/tmp/ans','w').write(str(b.count(b'q')))); "
       "open('/tmp/ready','w').close(); [signal.pause() for _ in iter(int, 1)]\" memhog")
HOG_READY = "for i in $(seq 400); do [ -e /tmp/ready ] && break; sleep 0.05; done; [ -e /tmp/ready ]"


def ask_hog(sbx: Any) -> str:
    """What the HOG of a sandbox (ours or the e2b SDK's) answers: its memory, as bytes still set."""
    return sbx.commands.run("rm -f /tmp/ans; pkill -USR1 -f '^python3 -c .*memho[g]'; for i in $(seq 200); do "
                            "[ -s /tmp/ans ] && break; sleep 0.05; done; cat /tmp/ans", timeout=30).stdout
