"""bunshinfork.hosts: this process's host and a named host's teardown, public (issue 37: a pool of
hosts, bunshinrl.cluster, tears its hosts down through these, not through bunshinfork's core)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bunshinfork
from bunshinfork import HostConfig, HostError, HostInUse, current_host, teardown_host
from bunshinfork.host import named_hosts
from bunshinfork.hosts import state_root, tree_bytes

NAME = "thost"


def test_this_process_is_the_default_host_which_is_never_torn_down() -> None:
    assert current_host() == HostConfig.from_env() and state_root() == current_host().run_root
    assert state_root().is_dir()
    with pytest.raises(HostError, match="default host"):
        teardown_host()
    assert state_root().is_dir()
    assert issubclass(HostInUse, HostError) and issubclass(HostError, bunshinfork.BunshinError)


def test_tree_bytes_sums_the_files_under_a_directory(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y" * 5)
    assert tree_bytes(tmp_path) == 15 and tree_bytes(str(tmp_path / "d")) == 5
    assert tree_bytes(tmp_path / "missing") == 0


# Run as host NAME (its environment), in processes of their own: a creator that dies without
# destroying its workspace, then a host that reaps it and leaves the machine.
_ORPHAN = """
import os
from bunshinfork import Workspace
ws = Workspace.create()
print(ws.id, flush=True)
os._exit(0)  # no destroy: the workspace outlives its creator
"""

_TEARDOWN = """
import json, os
from bunshinfork import HostInUse, Workspace, current_host, reap_orphans, teardown_host
out = {"host": str(current_host().run_root)}
mine = Workspace.create()
try:
    teardown_host()
except HostInUse as e:
    out["in_use"] = str(e)
out["reaped"] = reap_orphans()["reaped"]  # the orphan; never this process's own workspace
out["mine_alive"] = mine.is_running()
mine.destroy()
out["left"] = sorted(n for n in os.listdir(current_host().run_root) if n.startswith("ws-"))
out["removed"] = teardown_host()
print(json.dumps(out))
"""


def _as_host(code: str) -> str:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **HostConfig.named(NAME).env()}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_a_named_host_reaps_its_orphans_then_leaves_the_machine() -> None:
    cfg = HostConfig.named(NAME)
    try:
        orphan = _as_host(_ORPHAN).strip()
        out = json.loads(_as_host(_TEARDOWN))
        assert out["host"] == str(cfg.run_root)
        assert orphan in out["in_use"] and "still holds" in out["in_use"]
        assert out["mine_alive"] and out["left"] == []
        # The orphan was destroyed by reap_orphans, or gone already when its init ended with its
        # creator; either way nothing of it is left, and the host went with it.
        assert set(out["reaped"]) <= {orphan}
        assert str(cfg.run_root) in out["removed"] and not cfg.run_root.exists()
        assert cfg not in named_hosts()
    finally:
        if cfg.run_root.exists():  # a failed run: the host's own teardown
            _as_host("from bunshinfork import reap_orphans, teardown_host; reap_orphans(); teardown_host()")
