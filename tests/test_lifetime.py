"""Workspace lifetimes: the init ends a workspace at its deadline (or when its creator's lease
lapses), even when the creator was killed; the next bunshin operation or gc removes what is
left on the host. Bounds are generous: these are functional tests, not timing targets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import snapshot as host_snapshot
from fork_support import forked
from helpers import run_ok, wait_for

from bunshinfork import pipeline, state
from bunshinfork.cgroups import leftover_cgroups
from bunshinfork.errors import InvalidArgumentException
from bunshinfork.process import lifetime
from bunshinfork.workspace import Workspace

GENEROUS = 60.0


def ended(ws: Workspace) -> bool:
    return not ws.is_running()


def gone(ws_id: str) -> bool:
    return not (state.RUN_ROOT / ws_id).exists() and not any(ws_id in c for c in leftover_cgroups())


def test_deadline_ends_the_workspace_and_the_next_operation_cleans_up() -> None:
    ws = Workspace.create(timeout=2)
    assert ws.commands.run("echo alive").stdout == "alive\n"
    assert 0 < lifetime.remaining(ws._rec) <= 2  # type: ignore[operator]
    rec = state.Record.load(ws.id)
    assert rec.lifetime.deadline == pytest.approx(time.time() + 2, abs=1)  # recorded in the workspace's state
    wait_for(lambda: ended(ws), timeout=GENEROUS, interval=0.1)
    # No daemon took the host side apart; the next bunshin operation does.
    assert (state.RUN_ROOT / ws.id).exists()
    assert ws.id not in {w.id for w in Workspace.list()}
    assert gone(ws.id)
    ws.destroy()  # the owner's destroy after that is a no-op, not an error


def test_set_timeout_shortens_extends_and_clears() -> None:
    with Workspace.create(timeout=300) as ws:
        ws.set_timeout(1)
        wait_for(lambda: ended(ws), timeout=GENEROUS, interval=0.1)
    with Workspace.create(timeout=1) as ws:
        ws.set_timeout(0)  # no deadline any more
        deadline = time.time() + 2.5
        while time.time() < deadline:  # past the first deadline, and then some
            assert ws.is_running()
            time.sleep(0.2)
        assert state.Record.load(ws.id).lifetime.deadline == 0
        with pytest.raises(InvalidArgumentException):
            ws.set_timeout(-1)


def test_no_lifetime_unless_asked(ws: Workspace) -> None:
    assert ws._rec.lifetime.deadline == 0 and ws._rec.lifetime.lease == 0
    # Nothing of it in the workspace's file system: the init holds it (containment tests).
    assert "lifetime" not in run_ok(ws, "ls -A /.bunshin").stdout.split()


def test_a_clone_has_its_own_lifetime() -> None:
    with Workspace.create(timeout=300) as src:
        (short,) = forked(src.fork(1, memory="copy", timeout=1))
        (plain,) = forked(src.fork(1, memory="copy"))
        try:
            wait_for(lambda: ended(short), timeout=GENEROUS, interval=0.1)
            assert src.is_running() and plain.is_running()
            assert plain._rec.lifetime.deadline == 0  # not its source's deadline
        finally:
            short.destroy()
            plain.destroy()


def test_the_host_enforces_a_deadline_its_init_did_not() -> None:
    """The recorded deadline holds from the host's side too, at the next bunshin operation,
    should the init not enforce it (here the host itself gave the init no deadline)."""
    ws = Workspace.create(timeout=2)
    try:
        init = ws._rec.process
        assert init is not None
        lifetime.install(init.pid, init.starttime, state.Lifetime())
        deadline = ws._rec.lifetime.deadline
        time.sleep(max(0.0, deadline - time.time()) + 0.5)  # past the deadline the init no longer knows
        assert ws.is_running()
        assert ws.id not in {w.id for w in Workspace.list()}  # the next operation ends it
        assert not ws.is_running() and gone(ws.id)
    finally:
        ws.destroy()


def test_a_paused_workspace_waits_for_its_resume() -> None:
    with Workspace.create(timeout=1) as ws:
        ws.pause()
        time.sleep(2)
        Workspace.list()  # a frozen workspace is not collected...
        assert ws.is_running()
        ws.set_timeout(30)  # ...and a new deadline set while paused holds after the resume
        ws.resume()
        assert ws.commands.run("echo resumed").stdout == "resumed\n"


CREATOR = textwrap.dedent("""
    import json, sys, time
    from bunshinfork import Sandbox, Workspace
    timed = Workspace.create(timeout=3)
    leased = Workspace.create(die_with_creator=True)
    sbx = Sandbox.create(timeout=3).workspace
    clone, = timed.fork(1, memory="copy", die_with_creator=True)
    print(json.dumps({w.id: w.init_pid for w in (timed, leased, sbx, clone)}), flush=True)
    time.sleep(3600)
""")


def test_a_killed_creators_workspaces_stop_and_gc_leaves_nothing() -> None:
    before = host_snapshot()
    proc = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the creator did not start its workspaces"
        inits: dict[str, int] = json.loads(line)
        os.kill(proc.pid, signal.SIGKILL)  # no destroy, no atexit, no finally
        proc.wait(timeout=30)

        def all_stopped() -> bool:
            return all(not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
                       == "Z" for pid in inits.values())

        # Deadlines of 3 s, and a lease of lifetime.LEASE_SECONDS, enforced by each init itself.
        wait_for(all_stopped, timeout=GENEROUS + lifetime.LEASE_SECONDS, interval=0.2)
        assert all(ws_id in state.all_ids() for ws_id in inits)  # the host side is still there...
        pipeline.gc()  # ...until gc (or any later bunshin operation) removes it
        assert not any(ws_id in state.all_ids() for ws_id in inits)
        after = host_snapshot()
        assert {k: after[k] - before[k] for k in after if after[k] - before[k]} == {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pipeline.gc()
