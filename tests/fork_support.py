"""Helpers shared by the fork tests: the agent workload, fork bookkeeping, process trees."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import run_ok, wait_for

from bunshinfork import Snapshot, process, state
from bunshinfork.commands import CommandHandle
from bunshinfork.memory import cow
from bunshinfork.state import snapshot_ids as leftover_snapshots
from bunshinfork.workspace import Workspace

WORKLOADS = Path(__file__).resolve().parent / "workloads"
# The copy-on-write engine needs /dev/bunshin, i.e. the guest kernel: `make test-guest` selects
# these parameters with `-m cow`, and the host run skips them.
COW = pytest.param("cow", marks=[
    pytest.mark.cow,
    pytest.mark.skipif(not cow.available(), reason="needs /dev/bunshin (run `make test-guest`)"),
])

AGENT = "/root/agent.py"
XCLIENT = "/root/xclient.py"


def start_agent(ws: Workspace, mib: int, seed: int = 1, timeout: float = 60.0) -> dict[str, Any]:
    """Copy the agent in, start it in the background and return what it wrote when ready."""
    ws.files.write(AGENT, (WORKLOADS / "agent.py").read_text())
    h = ws.commands.run(f"exec python3 {AGENT} --serve --mib {mib} --seed {seed}", background=True)
    assert isinstance(h, CommandHandle)
    deadline = time.monotonic() + timeout
    while not ws.files.exists("/root/agent.ready"):
        # A crash shows up as an exit status: report its traceback instead of a timeout.
        if ws.files.exists(f"/.bunshin/cmd/{h.cmd_id}/exit"):
            raise AssertionError(f"agent died: {ws.files.read(f'/.bunshin/cmd/{h.cmd_id}/stderr')}")
        assert time.monotonic() < deadline, "agent did not get ready"
        time.sleep(0.05)
    return json.loads(str(ws.files.read("/root/agent.ready")))


def agent(ws: Workspace, op: str, **args: Any) -> Any:
    """One request to the agent, sent by a client process inside the workspace."""
    req = json.dumps({"op": op, **args})
    r = run_ok(ws, ["python3", AGENT, "--op", req], timeout=60)
    reply = json.loads(r.stdout)
    assert reply["ok"], reply
    return reply["result"]


def report(ws: Workspace, sha: bool = False) -> dict[str, Any]:
    if sha:
        # The spelled-out client mode the agent documents; same request as op="report", sha=True.
        reply = json.loads(run_ok(ws, ["python3", AGENT, "--report"], timeout=60).stdout)
        assert reply["ok"], reply
        return dict(reply["result"])
    return dict(agent(ws, "report"))


def forked(results: list[Workspace | Exception]) -> list[Workspace]:
    """The clones of a fork that must have succeeded entirely; a failure destroys the rest."""
    errors = [r for r in results if isinstance(r, Exception)]
    clones = [r for r in results if isinstance(r, Workspace)]
    if errors:
        for c in clones:
            c.destroy()
        raise AssertionError(f"{len(errors)} of {len(results)} clones failed: {errors!r}")
    return clones


@contextlib.contextmanager
def fork_chain(src: Workspace, depth: int, memory: str = "copy") -> Iterator[list[Workspace]]:
    """The source and `depth` forks, each of the one before (a fork of a fork ...); the forks
    are destroyed at the end."""
    family, made = [src], []
    try:
        for _ in range(depth):
            made += forked(family[-1].fork(1, memory))
            family.append(made[-1])
        yield family
    finally:
        for ws in made:
            ws.destroy()


@contextlib.contextmanager
def fork_of(src: Workspace | Snapshot, count: int = 1, memory: str = "copy") -> Iterator[list[Workspace]]:
    clones = forked(src.fork(count, memory))
    try:
        yield clones
    finally:
        for c in clones:
            c.destroy()


def tree(ws: Workspace) -> list[tuple[int, int, int, int, int, str]]:
    """(pid, ppid, sid, pgid, threads, comm) inside the namespace, without idle control shims.

    A shim (an init child serving one control connection) with no children is transient: the
    one answering the fork's readiness ping, or one still exiting after a finished command.
    """
    procs = process.tree(ws._cgroup().pids())
    parents = {p.ppid for p in procs}
    return [(p.pid, p.ppid, p.sid, p.pgid, p.threads, p.comm) for p in procs
            if not (p.comm == "init" and p.pid != 1 and p.pid not in parents)]


def settled_tree(ws: Workspace, timeout: float = 5.0) -> list[tuple[int, int, int, int, int, str]]:
    """The tree once two looks a moment apart agree (threads and shims come and go)."""
    def probe() -> list[tuple[int, int, int, int, int, str]] | None:
        first = tree(ws)
        time.sleep(0.05)
        return first if tree(ws) == first else None

    return wait_for(probe, timeout=timeout)


def host_pid(ws: Workspace, comm: str) -> int:
    procs = [p for p in process.tree(ws._cgroup().pids()) if p.comm == comm]
    assert len(procs) == 1, f"expected one {comm} in {ws.id}, found {procs}"
    return procs[0].host_pid


def own_snapshots() -> set[str]:
    """Retained snapshots this process took (other processes on the host may be forking too)."""
    out = set()
    for name in leftover_snapshots():
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads((state.RUN_ROOT / "snapshots" / name / "snapshot.json").read_text())
            if meta.get("owner_pid") == os.getpid():
                out.add(name)
    return out


def ksm_merging_pages(pid: int) -> int:
    for line in Path(f"/proc/{pid}/ksm_stat").read_text().splitlines():
        if line.startswith("ksm_merging_pages"):
            return int(line.split()[1])
    raise AssertionError(f"no ksm_merging_pages in /proc/{pid}/ksm_stat")
