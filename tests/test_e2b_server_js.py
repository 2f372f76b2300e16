"""The unmodified npm e2b SDK (2.51, installed with `npm ci` from tests/js/package-lock.json)
under Node drives `bunshin serve`: tests/js/client.mjs runs commands, files, fork, pause and
connect, and kill."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import e2b_server_support as support
import pytest

from bunshinfork import state

JS = Path(__file__).parent / "js"
NEEDED = (20, 18, 1)  # npm e2b 2.51's engines


def _node() -> tuple[str, tuple[int, ...]] | None:
    node = shutil.which("node")
    if node is None:
        return None
    text = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return node, tuple(int(x) for x in text.lstrip("v").split("."))


@pytest.fixture(scope="module")
def node_modules() -> Iterator[str]:
    found = _node()
    if found is None or found[1] < NEEDED or shutil.which("npm") is None:
        pytest.skip(f"npm e2b 2.51 needs Node >= 20.18.1 and npm; this host has {found}")
    if not (JS / "node_modules" / "e2b").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=JS, check=True, timeout=300,
                       capture_output=True)
    yield found[0]


@pytest.mark.timeout(300)
def test_js_client(node_modules: str, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("js-key-" + os.urandom(8).hex())
    served = support.start(tmp_path / "state", key)
    try:
        run = subprocess.run([node_modules, "client.mjs"], cwd=JS, env={**os.environ, **served.env},
                             capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr + "".join(served.log)
        out = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        assert served.stop() == 0
    assert out == {
        "stdout": "Hello from E2B!\nuser\n", "exitError": 7, "read": "from js", "listed": True,
        "forks": ["from js", "from js"], "forkKilled": True, "paused": True, "stateWhilePaused": "paused",
        "afterConnect": "from js", "killed": True, "runningAfterKill": False, "killUnknown": False,
    }
    assert not [i for i in state.all_ids() if state.Record.load(i).creator_pid == served.proc.pid]
