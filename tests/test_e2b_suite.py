"""`bunshin serve` judged by E2B's own tests and SDKs.

- E2B's Python SDK suite (../shared/e2b-python-sdk-tests, unchanged, its own pytest.ini, no
  reruns), by tests/e2b_suite/run.py: in full over plain HTTP, and the files that need
  `<port>-<id>.<domain>` names over E2B_DOMAIN with TLS and a CA made for the run. What cannot
  pass here is tests/e2b_suite/expected_failures.txt, run as strict xfail.
- The npm e2b SDK, pinned in tests/e2b_js/package-lock.json, through E2B's flows
  (tests/e2b_js/flows.mjs), in both modes. Missing Node or a missing package fails the test: scripts/setup.sh
  installs both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from e2b_suite import run as suite

JS = Path(__file__).parent / "e2b_js"
NODE_NEEDED = (20, 18, 1)  # npm e2b 2.51's engines


@pytest.mark.slow
@pytest.mark.timeout(suite.RUN_TIMEOUT_S + 300)
@pytest.mark.parametrize("mode", ["http", "domain"])
def test_e2b_python_suite(mode: str, tmp_path: Path) -> None:
    assert (suite.SUITE / "pytest.ini").is_file(), f"E2B's suite is not at {suite.SUITE} (BUNSHIN_E2B_SUITE)"
    out = suite.run_mode(mode, junit_dir=tmp_path)
    print(f"[e2b-suite] {mode}: {out.summary} ({out.seconds:.0f} s)")
    assert out.rc == 0, out.log[-30000:]


def _pinned() -> str:
    return json.loads((JS / "package.json").read_text())["dependencies"]["e2b"]


def _node() -> str:
    """Node and the pinned package, or the test fails: CI must not pass without them."""
    node = shutil.which("node")
    assert node is not None, "Node is not installed: scripts/setup.sh installs it"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    have = tuple(int(x) for x in version.strip().lstrip("v").split("."))
    assert have >= NODE_NEEDED, f"npm e2b {_pinned()} needs Node >= 20.18.1, this host has {version}"
    installed = JS / "node_modules" / "e2b" / "package.json"
    assert installed.is_file(), f"npm e2b is not installed in {JS}: run scripts/setup.sh (npm ci there)"
    got = json.loads(installed.read_text())["version"]
    assert got == _pinned(), f"{JS}/node_modules has e2b {got}, package.json pins {_pinned()}: run npm ci"
    return node


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["http", "domain"])
def test_e2b_js_flows(mode: str, tmp_path: Path) -> None:
    """The flows over plain HTTP, and with only E2B_DOMAIN and the test CA (NODE_EXTRA_CA_CERTS)."""
    node = _node()
    with suite.server(mode, tmp_path) as (served, extra_env):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("E2B_")}, **served.env, **extra_env}
        run = subprocess.run([node, "flows.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=360)
        assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:] + "".join(served.log[-50:])
        out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {
        "create": {"running": True, "metadata": "main"},
        "commands": {
            "stdout": "line1\nline2\nline3\n", "streamed": "line1\nline2\nline3\n", "stderr": "oops\n",
            "exitCode": 3, "timedOut": "TimeoutError", "timeoutWithin10s": True,
            "backgroundListed": True, "backgroundKilled": True,
        },
        "files": {
            # envd lowercases metadata keys; an overwrite without metadata clears it, a rename keeps it.
            "writtenMetadata": {"owner": "js", "run": "1"}, "infoMetadata": {"owner": "js", "run": "1"},
            "listedMetadata": {"owner": "js", "run": "1"}, "renamedMetadata": {"owner": "js", "run": "1"},
            "overwrittenMetadata": None, "gzipRoundTrip": True, "gzipSize": True,
        },
        "watch": {"created": True, "entry": {"name": "new.txt", "path": "/tmp/watched/new.txt", "file": True}},
        "pty": {"echoed": True, "resized": True, "exitCode": 0},
        "fork": {
            "children": [{"read": "child 0", "processLives": True}, {"read": "child 1", "processLives": True}],
            "parentUnchanged": "before fork", "childrenKilled": [True, True],
        },
        "pauseResume": {"paused": True, "stateWhilePaused": "paused", "stateAfterConnect": "running",
                        "file": "kept", "processLives": True},
        "list": {"pageSizes": [2, 1], "allListed": True, "newestFirst": True, "killed": [True, True, True]},
        "killed": True,
    }
