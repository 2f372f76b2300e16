"""Shared fixtures. Every test runs under a leak check: after it, no workspace mount,
cgroup, state directory, veth, process, layer or frozen layer may remain that was not there
before, and the layer store's loop device is the one it had."""

from __future__ import annotations

import contextlib
import os

# Ray (the cluster tests' local cluster, and what verl imports) keeps to loopback and reports no
# usage: read when ray is first imported, so set before any test module imports it.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshinfork import census, state
from bunshinfork.cgroups import leftover_cgroups
from bunshinfork.fs import btrfs as storage
from bunshinfork.fs import layers, store
from bunshinfork.host import HOSTS_RUN_ROOT, named_hosts
from bunshinfork.images import store as image_store
from bunshinfork.memory import ksm
from bunshinfork.workspace import Workspace

BTRFS_IMAGE = "/var/tmp/bunshin-test-btrfs.img"
BTRFS_MOUNT = "/var/tmp/bunshin-test-btrfs"


def _ws_dirs() -> set[str]:
    """This host's workspace records, and those of every named host on the machine (the nodes of
    a local pool, bunshinrl.cluster)."""
    out = census.ws_dirs()
    for h in named_hosts():
        with contextlib.suppress(FileNotFoundError):
            out |= {str(h.run_root / n) for n in os.listdir(h.run_root) if n.startswith("ws-")}
    return out


def _cgroups() -> set[str]:
    return set(leftover_cgroups()) | {d for h in named_hosts() for d in leftover_cgroups(parent=h.cgroup_parent)}


def _host_roots() -> set[str]:
    return set(os.listdir(HOSTS_RUN_ROOT)) if HOSTS_RUN_ROOT.is_dir() else set()


def _layers() -> set[str]:
    """Workspaces' layers and frozen layers in the default storage roots (the layer store, and
    the state root's tmpfs where layers fall back), this host's and every named host's."""
    out = set()
    hosts = [(store.STORE, state.RUN_ROOT)] + [(h.layer_store, h.run_root) for h in named_hosts()]
    for layer_store, run_root in hosts:
        for root in (layer_store, run_root / "layers" / "ws"):
            for d in (root, root / layers.SNAPSHOTS):
                if d.is_dir():
                    out |= {str(d / n) for n in os.listdir(d)
                            if n != layers.SNAPSHOTS and not _held(d, n, run_root / state.SNAPSHOTS)}
    return out


def _held(d: Path, name: str, snapshots: Path) -> bool:
    """A frozen layer of a snapshot that is still retained belongs to that snapshot, not to the
    test that happened to take it first (a session fixture's, a process-wide prefix cache's), as
    its images do; it must go when the snapshot is released, which the release tests check."""
    snap = snapshots / name
    return d.name == layers.SNAPSHOTS and (snap / "snapshot.json").is_file() and not (snap / state.RELEASED).exists()


def snapshot() -> dict[str, set]:
    return {
        "mounts": census.mounts(),
        "cgroups": _cgroups(),
        "state dirs": _ws_dirs(),
        "named hosts' state roots": _host_roots(),
        "init processes": census.init_processes(),
        "interfaces": census.interfaces(),
        "layers": _layers(),
        "store loop devices": census.store_loops(),
        # Image layers are a content-addressed cache (like the Debian rootfs), not a workspace's:
        # only an unpack that did not finish (a temporary) is a leak.
        "image layer unpacks": image_store.temporaries(),
        "nft rules": census.nft_rules(),
        "ip rules": census.ip_rules(),
        "published ports": census.published_ports(),
        "egress proxies": census.egress_proxies(),
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
    # A run killed before its boost relaxed (or its Ray hosts, killed at shutdown) leaves dead
    # holders: what the host's knobs are is what they are once those are pruned.
    ksm.prune()
    before = ksm.knobs()
    yield
    ksm.tuner.relax_now()
    after = ksm.knobs()
    assert after == before, f"ksmd knobs left changed: {before} -> {after}"
    assert not ksm.BOOST_PATH.exists()


@pytest.fixture
def ws() -> Iterator[Workspace]:
    """A default workspace for one test, destroyed after it."""
    w = Workspace.create()
    try:
        yield w
    finally:
        w.destroy()


@pytest.fixture
def no_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without the btrfs layer store: layers fall back to directories on the state
    root's tmpfs, and snapshots copy them."""
    missing = Path(f"/var/tmp/bunshin-no-store-{os.getpid()}/layers")
    monkeypatch.setattr(store, "STORE", missing)
    monkeypatch.setattr(store, "IMAGE", missing.with_name("layers.img"))
    assert not store.mounted() and store.default_root() == store.fallback_root()


@pytest.fixture(scope="session")
def btrfs_dir():
    """A loop-file btrfs storage directory for the whole session, removed at the end."""
    if not os.path.exists("/dev/loop-control"):
        # The qemu guest's minimal /dev has no loop devices: the btrfs cases run on the host.
        pytest.skip("needs loop devices for a btrfs storage_dir (none in this kernel's /dev)")
    mp = storage.setup_btrfs_loop(BTRFS_IMAGE, BTRFS_MOUNT, size=4 << 30)
    yield mp
    storage.teardown_btrfs_loop(mp, remove_image=BTRFS_IMAGE)
    assert not os.path.ismount(mp)
    assert storage.loop_devices_for(BTRFS_IMAGE) == []
