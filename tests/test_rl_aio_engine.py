"""The engine's workspace operations go through bunshinfork's AsyncWorkspace: a shell tool's
commands and an async task setup run on the event loop, with no worker thread per call; only
what bunshinfork has no asynchronous primitive for (create, snapshot, fork, destroy: CRIU,
mounts, cgroups) runs on bunshinfork's own pool."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from rl_support import no_own_leaks  # noqa: F401 (fixture, used by name)

import bunshinfork.aio.pool
import bunshinrl._async
from bunshinfork import AsyncWorkspace, Workspace
from bunshinfork.commands import Commands
from bunshinrl import FinalAnswer, RolloutEngine, SampleContext, Step, Task, ToolCall
from bunshinrl.calls.policy import Action
from bunshinrl.calls.tools import shell_tool

pytestmark = pytest.mark.usefixtures("no_own_leaks")

SCRIPT = [ToolCall("add", {"n": "2"}), ToolCall("add", {"n": "3"}), ToolCall("show", {})]


class Recorder:
    """An executor that records the name of every callable it is given, then runs it."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.names: list[str] = []

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        target = getattr(fn, "args", (fn,))[0]  # the partial(ctx.run, target, ...) of run_blocking
        self.names.append(getattr(target, "__qualname__", repr(target)))
        return self.pool.submit(fn, *args, **kwargs)


class Scripted:
    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        return SCRIPT[len(history)] if len(history) < len(SCRIPT) else FinalAnswer("done")


async def setup(ws: Workspace) -> None:
    await AsyncWorkspace(ws).commands.run("echo 0 > /root/n")


def task() -> Task:
    tools = [shell_tool("add", lambda a: f"echo $(( $(cat /root/n) + {int(a['n'])} )) > /root/n && cat /root/n"),
             shell_tool("show", lambda a: "cat /root/n")]
    return Task("aio", "Add.", tools, setup, fingerprint="rl-test-aio-v1")


def test_engine_commands_run_on_the_loop_without_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    rl_pool = Recorder(bunshinrl._async._POOL)
    fork_pool = Recorder(bunshinfork.aio.pool.POOL)
    monkeypatch.setattr(bunshinrl._async, "_POOL", rl_pool)
    monkeypatch.setattr(bunshinfork.aio.pool, "POOL", fork_pool)

    def no_thread(*a: Any, **k: Any) -> Any:
        raise AssertionError("asyncio.to_thread called")

    def no_sync_command(*a: Any, **k: Any) -> Any:
        raise AssertionError("a workspace command ran through the synchronous Commands.run")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    monkeypatch.setattr(Commands, "run", no_sync_command)
    command_threads: set[str] = set()
    run = bunshinfork.aio.AsyncCommands.run

    async def recording_run(self: Any, *a: Any, **k: Any) -> Any:
        command_threads.add(threading.current_thread().name)
        return await run(self, *a, **k)

    monkeypatch.setattr(bunshinfork.aio.AsyncCommands, "run", recording_run)

    async def main() -> Any:
        return await RolloutEngine(Scripted(), memory_interval=0.1).run_epoch([task()], group_size=2, epoch=0)

    result = asyncio.run(main())
    assert all(not s.errors for s in result.samples), [s.errors for s in result.samples]
    assert list(result.observations().values()) == [["2\n", "5\n", "5\n"]] * 2
    # Setup and the six tool calls ran their commands on the loop's own thread.
    assert command_threads == {threading.main_thread().name}
    # bunshinfork's pool ran only its workspace-lifecycle calls, never a command or a tool.
    assert fork_pool.names and set(fork_pool.names) <= {
        "Workspace.create", "Workspace.snapshot", "Snapshot.fork", "Snapshot.release", "Workspace.destroy"}, \
        fork_pool.names
    # bunshinrl's pool ran no workspace operation and no tool: only the rootfs digest and the
    # memory sampler's byte count (file-system walks).
    assert set(rl_pool.names) <= {"rootfs_digest", "workspace_bytes"}, rl_pool.names
