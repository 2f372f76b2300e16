"""Shared fixtures. Every test runs under a leak check: after it, no workspace mount,
cgroup, state directory, veth or process may remain that was not there before."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshinfork import state
from bunshinfork.cgroups import leftover_cgroups
from bunshinfork.fs import btrfs as storage
from bunshinfork.memory import ksm
from bunshinfork.workspace import Workspace

BTRFS_IMAGE = "/var/tmp/bunshin-test-btrfs.img"
BTRFS_MOUNT = "/var/tmp/bunshin-test-btrfs"


def _mounts() -> set[str]:
    out = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mp = fields[4]
        if "/ws-" in mp or ("overlay" in line.split(" - ")[1] and "bunshin" in line):
            out.add(mp)
    return out


def _init_processes() -> set[int]:
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() in ("bunshin-init", "init"):
                    exe = os.readlink(d / "exe")
                    if exe.endswith("/.bunshin/init") or "bunshin-init" in exe:
                        pids.add(int(d.name))
            except OSError:
                continue
    return pids


def _interfaces() -> set[str]:
    return {n for n in os.listdir("/sys/class/net") if n.startswith("bn")}


def _ws_dirs() -> set[str]:
    return set(state.all_ids())


def snapshot() -> dict[str, set]:
    return {
        "mounts": _mounts(),
        "cgroups": set(leftover_cgroups()),
        "state dirs": _ws_dirs(),
        "init processes": _init_processes(),
        "interfaces": _interfaces(),
    }


def leaks(before: dict[str, set], timeout: float = 5.0) -> dict[str, set]:
    deadline = time.monotonic() + timeout
    while True:
        after = snapshot()
        found = {k: after[k] - before[k] for k in after if after[k] - before[k]}
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture(scope="session", autouse=True)
def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.exit("the bunshin test suite needs root (namespaces, mounts, cgroups)", returncode=2)
    state.run_root()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    before = snapshot()
    yield
    found = leaks(before)
    if found:
        pytest.fail(f"test leaked: {found}")


@pytest.fixture(scope="session", autouse=True)
def ksm_knobs_restored() -> Iterator[None]:
    """ksmd's knobs are host state: boosts during the suite must all be undone at its end."""
    if not ksm.available():
        yield
        return
    before = ksm.knobs()
    yield
    ksm.tuner.relax_now()
    after = ksm.knobs()
    assert after == before, f"ksmd knobs left changed: {before} -> {after}"
    assert not (state.RUN_ROOT / ksm.BOOST_FILE).exists()


@pytest.fixture
def ws() -> Iterator[Workspace]:
    """A default workspace for one test, destroyed after it."""
    w = Workspace.create()
    try:
        yield w
    finally:
        w.destroy()


@pytest.fixture(scope="session")
def btrfs_dir():
    """A loop-file btrfs storage directory for the whole session, removed at the end."""
    mp = storage.setup_btrfs_loop(BTRFS_IMAGE, BTRFS_MOUNT, size=4 << 30)
    yield mp
    storage.teardown_btrfs_loop(mp, remove_image=BTRFS_IMAGE)
    assert not os.path.ismount(mp)
    assert storage.loop_devices_for(BTRFS_IMAGE) == []
