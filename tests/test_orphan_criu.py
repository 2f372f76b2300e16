"""A creator SIGKILLed mid-restore leaves no CRIU behind: the restore's CRIU dies with its
caller (PR_SET_PDEATHSIG), and gc ends one that did not (process/sessions.py), so the census
shows no CRIU process and no descriptor on bunshin's state after gc."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import wait_for

from bunshinfork import census, pipeline, state
from bunshinfork.process import criu, sessions
from bunshinfork.process.sessions import alive
from bunshinfork.workspace import Workspace

# The creator forks its workspace and reports CRIU's pid at a restore notification (argv[2]): CRIU
# is then mid-restore, forking tasks and mounting, when the creator is killed. After
# post-setup-namespaces such a CRIU outlived gc (the soak's leak) before gc ended it; earlier
# (pre-restore) it ends on its own, when its socket closes.
CREATOR = textwrap.dedent("""
    import json, sys, time
    from bunshinfork import Workspace
    from bunshinfork.process import criu, restore
    if sys.argv[1] == "without-pdeathsig":  # as before the fix: only gc can end it
        start = criu.Session.__init__
        def no_pdeathsig(self, *a, **k):
            k["die_with_caller"] = False
            start(self, *a, **k)
        criu.Session.__init__ = no_pdeathsig
    ws = Workspace.create()
    print(json.dumps({"source": ws.id}), flush=True)
    def hook(session):
        call, reply, seen = session.call, session._reply_notify, []
        def mid_restore_call(req, on_notify=None, timeout=None):
            def notify(script, pid):
                seen.append(script)
                on_notify(script, pid)
            return call(req, notify, timeout)
        def reply_then_report(ok):
            reply(ok)  # CRIU goes on with the restore: it is not waiting on us when we die
            if seen[-1] == sys.argv[2]:
                print(json.dumps({"criu": session.pid}), flush=True)
        session.call, session._reply_notify = mid_restore_call, reply_then_report
    restore.RESTORE_HOOK = hook
    ws.fork(1, memory="copy")
    time.sleep(3600)
""")


def _settled(before: dict[str, set]) -> dict[str, int]:
    """The census's leak count once the zombies of what gc killed are reaped: their parent, the
    creator, is gone, and pid 1 reaps them when it gets to it (seconds on this VM), as soak.py
    allows for."""
    def settled() -> dict[str, int] | None:
        leaks = census.leaks(before, census.take())
        return None if leaks["processes"] or leaks["host fds"] else leaks
    try:
        return wait_for(settled, timeout=10, interval=0.2)
    except AssertionError:
        return census.leaks(before, census.take())


def _kill_creator_mid_restore(mode: str, at: str) -> tuple[str, int, int | None]:
    """Start a creator, SIGKILL it mid-restore; its source workspace's id and its CRIU."""
    proc = subprocess.Popen([sys.executable, "-c", CREATOR, mode, at], stdout=subprocess.PIPE, text=True)
    try:
        source = json.loads(proc.stdout.readline())["source"]  # type: ignore[union-attr]
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the creator did not reach the restore"
        criu_pid = json.loads(line)["criu"]
        criu_start = state.proc_starttime(criu_pid)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return source, criu_pid, criu_start


@pytest.mark.parametrize("at", ["setup-namespaces", "post-setup-namespaces"])
@pytest.mark.parametrize("mode", ["with-pdeathsig", "without-pdeathsig"])
def test_a_creator_killed_mid_restore_leaves_no_criu_after_gc(mode: str, at: str) -> None:
    pipeline.gc()
    before = census.take()
    source = None
    try:
        if mode == "with-pdeathsig":
            source, criu_pid, criu_start = _kill_creator_mid_restore(mode, at)
            wait_for(lambda: not alive(criu_pid, criu_start), timeout=10, interval=0.05)
            pipeline.gc()
        else:
            # Without the pdeathsig, CRIU ends on its own when it next writes to the dead caller's
            # socket (a notification), which may come before the kill lands or before gc runs:
            # try again until gc is the one that ends it. A CRIU that gc leaves alive fails.
            for _ in range(8):
                source, criu_pid, criu_start = _kill_creator_mid_restore(mode, at)
                caught = alive(criu_pid, criu_start)
                removed = pipeline.gc()
                assert not alive(criu_pid, criu_start), "gc left a CRIU whose caller died"
                if caught and any(f"pid {criu_pid} " in r for r in removed["process"]):
                    break
                Workspace.connect(source).destroy()
                source = None
                pipeline.gc()
            else:
                pytest.skip("CRIU ended on its own (its next notification) before gc, 8 times in a row")
        Workspace.connect(source).destroy()
        source = None
        pipeline.gc()
        leaks = _settled(before)
        assert leaks["processes"] == 0 and leaks["host fds"] == 0, leaks
        # This process's own idle CRIU, started ahead of its next request (prestart.py), aside.
        criu.settle()
        idle = {str(s.pid) for s in criu.PRESTARTED.idle()}  # type: ignore[attr-defined]
        assert not [p for p in census.processes() if p.split()[1] == "criu" and p.split()[0] not in idle]
    finally:
        if source is not None:
            Workspace.connect(source).destroy()
        pipeline.gc()


def _criu_holding(directory: Path) -> subprocess.Popen:
    """A real, stopped `criu` process with `directory` open, as a dump's helper is left when its
    CRIU dies mid-dump (it shares the CRIU's descriptors, the images directory among them)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # swrk waits on its socket for a request: it lives until it is killed.
        proc = subprocess.Popen([criu.binary(), "swrk", str(child.fileno())], pass_fds=(child.fileno(), fd),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        os.close(fd)
        child.close()
    proc._keep = parent  # type: ignore[attr-defined]
    wait_for(lambda: Path(f"/proc/{proc.pid}/comm").read_text().strip() == "criu")
    os.kill(proc.pid, signal.SIGSTOP)
    return proc


def test_a_failed_dumps_left_helpers_are_ended(tmp_path: Path) -> None:
    images, other = tmp_path / "images", tmp_path / "other"
    images.mkdir()
    other.mkdir()
    helper, bystander = _criu_holding(images), _criu_holding(other)
    try:
        assert sessions.end_helpers(sessions.dir_id(images)) == [helper.pid]
        assert helper.wait(timeout=5) == -signal.SIGKILL
        assert bystander.poll() is None  # another dump's CRIU, holding its own images
    finally:
        for p in (helper, bystander):
            p.kill()
            p.wait()


def test_gc_ends_the_helpers_of_a_dump_whose_criu_and_caller_are_gone(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    helper = _criu_holding(images)
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        # The record a dump leaves when its caller is killed: CRIU and caller both gone since.
        path = sessions.record(helper.pid, "dump", 0.0, sessions.dir_id(images))
        assert path is not None
        entry = json.loads(path.read_text())
        entry["criu"], entry["caller"] = [gone.pid, 1], [gone.pid, 1]
        path.write_text(json.dumps(entry))
        assert any(f"helper pid {helper.pid}" in e for e in sessions.gc())
        assert helper.wait(timeout=5) == -signal.SIGKILL
        assert not path.exists()
    finally:
        helper.kill()
        helper.wait()
