"""E2B's own examples, run unchanged against bunshinfork.

Each example below is copied verbatim from the installed e2b package (README or docstring;
the source is named next to it), and the test first checks that the installed package still
has it, word for word. It then runs with `from e2b import` read as `from bunshinfork import`
(the only change, and only where the example imports) and checks what the example's comments
promise. Fragments that use a name they do not define (`path` in the stream examples) get it
from the test; nothing else is added.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import e2b
import pytest

import bunshinfork
from bunshinfork import state
from bunshinfork.workspace import Workspace

E2B_DIR = Path(e2b.__file__).parent


def _installed(source: str, example: str) -> None:
    """The example is in the installed e2b, verbatim (indentation aside)."""
    if source == "README":
        text = metadata.distribution("e2b").read_text("METADATA") or ""
    else:
        text = (E2B_DIR / source).read_text()
    lines = text.splitlines()
    want = example.rstrip("\n").splitlines()
    for i, line in enumerate(lines):
        if line.strip() == want[0].strip() and textwrap.dedent("\n".join(lines[i:i + len(want)])) == "\n".join(want):
            return
    raise AssertionError(f"the installed e2b's {source} no longer has this example:\n{example}")


def _as_bunshinfork(example: str) -> str:
    return example.replace("from e2b import", "from bunshinfork import")


@pytest.fixture
def cleanup() -> Iterator[None]:
    """Examples leave sandboxes running (E2B's would end after 300 s): remove what they made."""
    before = set(state.all_ids())
    yield
    for ws_id in set(state.all_ids()) - before:
        with contextlib.suppress(bunshinfork.BunshinError, FileNotFoundError):
            rec = state.Record.load(ws_id)
            if rec.creator_pid == os.getpid():
                Workspace(rec).destroy()


def run_sync(example: str, **names: Any) -> dict[str, Any]:
    ns: dict[str, Any] = {"Sandbox": bunshinfork.Sandbox, **names}
    exec(compile(_as_bunshinfork(example), "<e2b example>", "exec"), ns)
    return ns


def run_async(example: str, **names: Any) -> dict[str, Any]:
    ns: dict[str, Any] = {"AsyncSandbox": bunshinfork.AsyncSandbox, **names}
    code = compile(_as_bunshinfork(example), "<e2b example>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)

    async def main() -> None:
        result = eval(code, ns)
        if result is not None:
            await result

    asyncio.run(main())
    return ns


# ---- the quickstart ----

QUICKSTART = '''\
from e2b import Sandbox

with Sandbox.create() as sandbox:
    result = sandbox.commands.run('echo "Hello from E2B!"')
    print(result.stdout)  # Hello from E2B!
'''  # README ("Run your first Sandbox", 3. Start a sandbox and run commands)


def test_quickstart(capsys: pytest.CaptureFixture[str], cleanup: None) -> None:
    _installed("README", QUICKSTART)
    ns = run_sync(QUICKSTART)
    assert capsys.readouterr().out == "Hello from E2B!\n\n"  # stdout's newline, then print's
    assert not ns["sandbox"].is_running()  # the with block killed it


CREATE = '''\
from e2b import Sandbox

sandbox = Sandbox.create()
'''  # sandbox_sync/main.py, Sandbox's docstring; also e2b/__init__.py

ASYNC_CREATE = '''\
from e2b import AsyncSandbox

sandbox = await AsyncSandbox.create()
'''  # sandbox_async/main.py, AsyncSandbox's docstring; also e2b/__init__.py


def test_create(cleanup: None) -> None:
    _installed("sandbox_sync/main.py", CREATE)
    _installed("__init__.py", "from e2b import Sandbox\n")
    sbx = run_sync(CREATE)["sandbox"]
    assert sbx.is_running() and sbx.get_info().end_at > sbx.get_info().started_at


def test_async_create(cleanup: None) -> None:
    _installed("sandbox_async/main.py", ASYNC_CREATE)
    sbx = run_async(ASYNC_CREATE)["sandbox"]
    assert isinstance(sbx, bunshinfork.AsyncSandbox) and sbx.sandbox.is_running()


# ---- is_running, kill ----

IS_RUNNING = '''\
sandbox = Sandbox.create()
sandbox.is_running() # Returns True

sandbox.kill()
sandbox.is_running() # Returns False
'''  # sandbox_sync/main.py, Sandbox.is_running

ASYNC_IS_RUNNING = '''\
sandbox = await AsyncSandbox.create()
await sandbox.is_running() # Returns True

await sandbox.kill()
await sandbox.is_running() # Returns False
'''  # sandbox_async/main.py, AsyncSandbox.is_running


def test_is_running_and_kill(cleanup: None) -> None:
    _installed("sandbox_sync/main.py", IS_RUNNING)
    lines = IS_RUNNING.splitlines()
    ns = run_sync("\n".join(lines[:2]))
    assert ns["sandbox"].is_running() is True
    ns = run_sync("\n".join(lines[2:]), sandbox=ns["sandbox"])
    assert ns["sandbox"].is_running() is False


def test_async_is_running_and_kill(cleanup: None) -> None:
    _installed("sandbox_async/main.py", ASYNC_IS_RUNNING)
    ns = run_async(ASYNC_IS_RUNNING)
    assert ns["sandbox"].sandbox.is_running() is False


# ---- pause and connect ----

CONNECT = '''\
sandbox = Sandbox.create()
sandbox.pause()

# Another code block
same_sandbox = sandbox.connect()
'''  # sandbox_sync/main.py, Sandbox.connect

CONNECT_BY_ID = '''\
sandbox = Sandbox.create()
Sandbox.pause(sandbox.sandbox_id)

# Another code block
same_sandbox = Sandbox.connect(sandbox.sandbox_id)
'''  # sandbox_sync/main.py, Sandbox.connect (the sandbox_id overload)

ASYNC_CONNECT = '''\
sandbox = await AsyncSandbox.create()
await sandbox.pause()

# Another code block
same_sandbox = await sandbox.connect()
'''  # sandbox_async/main.py, AsyncSandbox.connect


@pytest.mark.parametrize("example", [CONNECT, CONNECT_BY_ID], ids=["instance", "by-id"])
def test_pause_and_connect(example: str, cleanup: None) -> None:
    _installed("sandbox_sync/main.py", example)
    lines = example.splitlines()
    ns = run_sync("\n".join(lines[:2]))
    assert ns["sandbox"].get_info().state == "paused"
    same = run_sync("\n".join(lines[2:]), sandbox=ns["sandbox"])["same_sandbox"]
    assert same.sandbox_id == ns["sandbox"].sandbox_id and same.get_info().state == "running"
    assert same.commands.run("echo back").stdout == "back\n"


def test_async_pause_and_connect(cleanup: None) -> None:
    _installed("sandbox_async/main.py", ASYNC_CONNECT)
    ns = run_async(ASYNC_CONNECT)
    same = ns["same_sandbox"].sandbox
    assert same.get_info().state == "running" and same.commands.run("echo back").stdout == "back\n"


# ---- fork ----

FORK = '''\
sandbox = Sandbox.create()

fork1, fork2 = sandbox.fork(count=2)
'''  # sandbox_sync/main.py, Sandbox.fork

FORK_BY_ID = '''\
sandbox = Sandbox.create()

fork1, fork2 = Sandbox.fork(sandbox.sandbox_id, count=2)
'''  # sandbox_sync/main.py, Sandbox.fork (the sandbox_id overload)

ASYNC_FORK = '''\
sandbox = await AsyncSandbox.create()

fork1, fork2 = await sandbox.fork(count=2)
'''  # sandbox_async/main.py, AsyncSandbox.fork

ASYNC_FORK_BY_ID = '''\
sandbox = await AsyncSandbox.create()

fork1, fork2 = await AsyncSandbox.fork(sandbox.sandbox_id, count=2)
'''  # sandbox_async/main.py, AsyncSandbox.fork (the sandbox_id overload)


def _check_forks(src: bunshinfork.Sandbox, forks: list[bunshinfork.Sandbox]) -> None:
    """Three running sandboxes, and what one fork writes stays in it."""
    assert len({src.sandbox_id, *(f.sandbox_id for f in forks)}) == 3
    assert all(isinstance(f, bunshinfork.Sandbox) and f.is_running() for f in forks)
    forks[0].files.write("only-here", "fork 1")
    assert forks[0].commands.run("cat only-here").stdout == "fork 1"
    assert not src.files.exists("only-here") and not forks[1].files.exists("only-here")
    assert forks[1].get_info().end_at > forks[1].get_info().started_at  # E2B's default lifetime, its own


@pytest.mark.parametrize("example", [FORK, FORK_BY_ID], ids=["instance", "by-id"])
def test_fork(example: str, cleanup: None) -> None:
    _installed("sandbox_sync/main.py", example)
    ns = run_sync(example)
    _check_forks(ns["sandbox"], [ns["fork1"], ns["fork2"]])


@pytest.mark.parametrize("example", [ASYNC_FORK, ASYNC_FORK_BY_ID], ids=["instance", "by-id"])
def test_async_fork(example: str, cleanup: None) -> None:
    _installed("sandbox_async/main.py", example)
    ns = run_async(example)
    assert all(isinstance(ns[n], bunshinfork.AsyncSandbox) for n in ("sandbox", "fork1", "fork2"))
    _check_forks(ns["sandbox"].sandbox, [ns["fork1"].sandbox, ns["fork2"].sandbox])


# ---- listing ----

LIST = '''\
paginator = Sandbox.list()

while paginator.has_next:
    sandboxes = paginator.next_items()
    print(sandboxes)
'''  # sandbox_sync/paginator.py, SandboxPaginator

ASYNC_LIST = '''\
paginator = AsyncSandbox.list()

while paginator.has_next:
    sandboxes = await paginator.next_items()
    print(sandboxes)
'''  # sandbox_async/paginator.py, AsyncSandboxPaginator


def test_list(capsys: pytest.CaptureFixture[str], cleanup: None) -> None:
    _installed("sandbox_sync/paginator.py", LIST)
    _installed("sandbox_async/paginator.py", ASYNC_LIST)
    with bunshinfork.Sandbox.create(metadata={"example": "list"}) as sbx:
        run_sync(LIST)
        assert sbx.sandbox_id in capsys.readouterr().out
        run_async(ASYNC_LIST)
        assert sbx.sandbox_id in capsys.readouterr().out


# ---- files ----

STREAM = '''\
with sandbox.files.read(path, format="stream") as stream:
    for chunk in stream:
        ...
'''  # sandbox/filesystem/filesystem.py, FileStreamReader

ASYNC_STREAM = '''\
async with await sandbox.files.read(path, format="stream") as stream:
    async for chunk in stream:
        ...
'''  # sandbox/filesystem/filesystem.py, AsyncFileStreamReader


def test_stream_read(cleanup: None) -> None:
    _installed("sandbox/filesystem/filesystem.py", STREAM)
    _installed("sandbox/filesystem/filesystem.py", ASYNC_STREAM)
    blob = os.urandom(3 << 20)
    with bunshinfork.Sandbox.create() as sbx:
        sbx.files.write("big.bin", blob)
        # The loop body is `...`: what is left to check is the last chunk and the closed stream.
        ns = run_sync(STREAM, sandbox=sbx, path="big.bin")
        assert blob.endswith(ns["chunk"]) and len(ns["chunk"]) < len(blob)
        assert list(ns["stream"]) == []
        ns = run_async(ASYNC_STREAM, sandbox=bunshinfork.AsyncSandbox(sbx), path="big.bin")
        assert blob.endswith(ns["chunk"]) and len(ns["chunk"]) < len(blob)
