"""The init's control protocol leaves nothing connected: a snapshot right after any call succeeds.

A call returns only once the shim serving it has closed its end, so CRIU never finds a socket
inside the workspace whose peer is this process (it refuses to dump one).
"""

from __future__ import annotations

import pytest

from bunshinfork import Workspace
from bunshinfork.commands import CommandHandle
from bunshinfork.errors import CommandError, CommandTimeout
from bunshinfork.process import control

ROUNDS = 6


def _background(ws: Workspace) -> CommandHandle:
    h = ws.commands.run("exec sleep 100", background=True)
    assert isinstance(h, CommandHandle)
    return h


def _calls(ws: Workspace) -> dict[str, object]:
    """Every kind of call into the init, each leaving at once when it returns or raises."""
    exited = _background(ws)
    exited.kill()
    exited.wait(timeout=10)

    def failing_exec() -> None:
        with pytest.raises(CommandError):
            ws.commands.run(["/no/such/program"])

    def timing_out() -> None:
        with pytest.raises(CommandTimeout):
            ws.commands.run("exec sleep 30", timeout=0.05)

    def kill_running() -> None:
        assert _background(ws).kill() is True

    return {
        "foreground": lambda: ws.commands.run("echo hi"),
        "foreground with output after exit": lambda: ws.commands.run("(sleep 0.01; echo late) & echo now"),
        "exec failure": failing_exec,
        "timeout": timing_out,
        "background": lambda: _background(ws),
        "kill": kill_running,
        "kill of an exited command": lambda: exited.kill(),
        "ping": lambda: control.ping(ws.init_pid),
    }


@pytest.mark.timeout(300)
def test_a_snapshot_right_after_any_call_succeeds(ws: Workspace) -> None:
    for name, call in _calls(ws).items():
        for i in range(ROUNDS):
            call()
            try:
                snap = ws.snapshot("copy")
            except Exception as e:
                raise AssertionError(f"snapshot right after {name!r} (round {i}) failed: {e}") from e
            snap.release()
    assert ws.commands.run("echo alive").stdout == "alive\n"
