"""Tools and a task for the bunshinrl tests: a counter held in a live server process
(state that only a whole-workspace fork carries), files, background processes."""

from __future__ import annotations

import asyncio
import itertools
import os
import shlex
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from bunshinfork import Workspace
from bunshinrl import (
    FinalAnswer,
    RolloutCore,
    RolloutEngine,
    SampleContext,
    SnapshotBackend,
    Step,
    Task,
    Tool,
    ToolCall,
    ToolPrefixCache,
)
from bunshinrl.calls.policy import Action
from bunshinrl.calls.tools import command_observation

SERVER = textwrap.dedent('''
    import http.server, urllib.parse
    state = {"value": 0}
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            u = urllib.parse.urlparse(self.path)
            if u.path == "/bump":
                state["value"] += int(urllib.parse.parse_qs(u.query)["n"][0])
            body = str(state["value"]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer(("127.0.0.1", 9000), H).serve_forever()
''')


def _sh(ws: Workspace, cmd: str) -> str:
    r = ws.commands.run(cmd, timeout=30)
    return command_observation(r.stdout, r.stderr, r.exit_code)  # type: ignore[union-attr]


def setup(ws: Workspace) -> None:
    ws.files.write("/root/server.py", SERVER)
    ws.commands.run("python3 /root/server.py", background=True)
    deadline = time.monotonic() + 15
    while _sh(ws, "curl -sf http://127.0.0.1:9000/value") != "0":
        assert time.monotonic() < deadline, "counter server did not start"
        time.sleep(0.05)


def bump(ws: Workspace, args: dict[str, Any]) -> str:
    n = int(args["n"])
    return _sh(ws, f"curl -s 'http://127.0.0.1:9000/bump?n={n}' && echo {n} >> /root/bumps.log")


def touch(ws: Workspace, args: dict[str, Any]) -> str:
    name = shlex.quote(str(args["name"]))
    return _sh(ws, f"mkdir -p /root/files && echo {name} > /root/files/{name} && ls /root/files")


def sleeper(ws: Workspace, args: dict[str, Any]) -> str:
    ws.commands.run(f"exec -a sleeper-{int(args['id'])} sleep 1000", background=True)
    return f"started sleeper-{int(args['id'])}"


def slow(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, f"sleep {float(args['s'])} && echo slept >> /root/slow.log && wc -l < /root/slow.log")


def state(ws: Workspace, args: dict[str, Any] | None = None) -> str:
    """Everything the tests compare: server memory, files, running processes."""
    return _sh(ws, "curl -s http://127.0.0.1:9000/value; echo; cat /root/bumps.log 2>/dev/null; "
                   "ls /root/files 2>/dev/null; ps -eo args= | awk '$1 ~ /^sleeper-/ {print $1}' | sort")


_counter = itertools.count()


def uuid(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, "cat /proc/sys/kernel/random/uuid")


def liar(ws: Workspace, args: dict[str, Any]) -> str:
    # Claims to be deterministic, but observes something different every time.
    return f"tick {next(_counter)}"


def tools() -> list[Tool]:
    return [Tool("bump", bump), Tool("touch", touch), Tool("sleeper", sleeper), Tool("slow", slow),
            Tool("state", state), Tool("uuid", uuid, deterministic=False), Tool("liar", liar)]


def counter_task(task_id: str = "task") -> Task:
    return Task(task_id, "Bump the counter.", tools(), setup, fingerprint="rl-test-counter-v1")


def my_snapshots() -> set[str]:
    """Retained snapshots this test process owns (other processes on the host may hold theirs)."""
    import json
    import os

    from bunshinfork.state import snapshot_ids as leftover_snapshots
    from bunshinfork.state import snapshots_root

    mine = set()
    for name in leftover_snapshots():
        try:
            meta = json.loads((snapshots_root() / name / "snapshot.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("owner_pid") == os.getpid():
            mine.add(name)
    return mine


def my_workspaces() -> set[str]:
    """Live workspaces this test process created."""
    import os

    from bunshinfork import state

    mine = set()
    for rec in state.records():
        if rec.creator_pid == os.getpid() and rec.status != "destroyed":
            mine.add(rec.id)
    return mine


@pytest.fixture(autouse=False)
def no_own_leaks() -> Iterator[None]:
    """Like conftest's leak check, but only for this process's own workspaces and snapshots, so
    it also holds while other processes on the host create and destroy theirs."""
    ws_before, snaps_before = my_workspaces(), my_snapshots()
    yield
    deadline = time.monotonic() + 5
    while my_workspaces() - ws_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert my_workspaces() - ws_before == set(), "workspaces left running"
    assert my_snapshots() - snaps_before == set(), "snapshots left retained"


def serve_vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, max_num_seqs: int) -> Iterator[Any]:
    """A vLLM api_server serving model_dir, for a module-scoped fixture: skipped with the reason
    when the vLLM venv is missing, except under BUNSHIN_REQUIRE_VLLM=1 (make test)."""
    from bunshinrl.grpo import BackendUnavailable, VLLMServer

    try:
        srv = VLLMServer(model_dir, max_num_seqs=max_num_seqs, log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    except BackendUnavailable as e:
        if os.environ.get("BUNSHIN_REQUIRE_VLLM") == "1":
            pytest.fail(str(e))
        pytest.skip(str(e))
    with srv:
        yield srv
    # The engine core runs as a child process: nothing of the server may outlive it.
    assert srv.proc is None and not srv.running()


class PlanPolicy:
    """Sample s of epoch e follows plans(e, s), one call per decision keyed by the step (as the
    benchmark's agent draws by step: a rewound sample decides again what it decided before),
    then answers. think: seconds each decision takes; asked: (epoch, history length) per
    decision."""

    def __init__(self, plans: Callable[[int, int], Sequence[ToolCall]], think: float = 0.0) -> None:
        self.plans = plans
        self.think = think
        self.asked: list[tuple[int, int]] = []

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        self.asked.append((ctx.epoch, len(history)))
        if self.think:
            await asyncio.sleep(self.think)
        calls = self.plans(ctx.epoch, ctx.sample)
        return calls[len(history)] if len(history) < len(calls) else FinalAnswer("done")


def root_only_cache() -> ToolPrefixCache:
    """A prefix cache that captures only the root: every state below it is rebuilt by replaying
    the plan's calls (what the invariant tests need to meet a replay's divergence)."""
    return ToolPrefixCache(SnapshotBackend(), 1 << 40, snapshot_every=100, background=False)


def two_epochs(policy: Any, task: Task, prefetch: bool) -> list[Any]:
    """Epochs 0 and 1 of one sample of `task` through a RolloutEngine on a root_only_cache():
    epoch 0 records, epoch 1 is served from the recording. The engine and cache are closed."""
    cache = root_only_cache()
    engine = RolloutEngine(policy, core=RolloutCore(cache=cache, prefetch=prefetch, critical_path_captures=False))

    async def main() -> list[Any]:
        try:
            return [await engine.run_epoch([task], group_size=1, epoch=e) for e in (0, 1)]
        finally:
            await engine.close()
            cache.close()

    return asyncio.run(main())

