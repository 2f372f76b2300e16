"""The layer store as the set-up step makes it on a fresh host (`bunshin storage setup`, which
scripts/setup.sh runs), mounts it again after a reboot, and reports it; and the loud report
where there can be none. Each test uses a store of its own, beside the real one, and leaves
no image, mount or loop device behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshinfork import KernelFeatureError, Workspace, doctor, native
from bunshinfork.fs import btrfs, frozen, store
from bunshinfork.state import FsState, Layer, Rootfs

BUNSHIN = Path(sys.executable).with_name("bunshin")


@pytest.fixture
def fresh_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """STORE and IMAGE moved to a directory on the host's disk where nothing exists yet."""
    base = Path(f"/var/tmp/bunshin-store-test-{os.getpid()}")
    mp = base / "layers"
    monkeypatch.setattr(store, "STORE", mp)
    monkeypatch.setattr(store, "IMAGE", mp.with_name("layers.img"))
    try:
        yield mp
    finally:
        btrfs.teardown_btrfs_loop(str(mp), remove_image=str(store.IMAGE))
        assert not os.path.ismount(mp)
        assert btrfs.loop_devices_for(str(store.IMAGE)) == []
        shutil.rmtree(base)


def _loop_of(image: Path) -> str:
    (dev,) = btrfs.loop_devices_for(str(image))
    return dev


def test_setup_makes_the_store_on_a_fresh_host(fresh_store: Path) -> None:
    before = store.check_store()
    assert before.level == "WARN" and "does not exist" in before.detail and "copies" in before.detail
    proc = subprocess.run([str(BUNSHIN), "storage", "setup", "--size", "1G"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "BUNSHIN_LAYERS": str(fresh_store)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK") and str(fresh_store) in proc.stdout
    assert store.mounted()
    image = store.IMAGE
    assert image.stat().st_size == 1 << 30 and image.stat().st_blocks * 512 < 256 << 20, "the image is not sparse"
    dev = _loop_of(image)
    # Direct I/O: the store's blocks are not cached twice, and its commits do not fsync the image.
    assert Path(f"/sys/block/{Path(dev).name}/loop/dio").read_text().strip() == "1"
    limit = btrfs.dirty_limit(str(fresh_store))
    assert limit is not None and abs(limit - btrfs.DIRTY_LIMIT) < btrfs.DIRTY_LIMIT // 4
    assert store.setup() == fresh_store and _loop_of(image) == dev, "setup is not idempotent"
    assert doctor.format_checks([store.check_store()]).startswith("OK")

    # After a reboot the image is there but not mounted: the first workspace mounts it again.
    native.umount2(str(fresh_store), 0)
    assert not store.mounted() and btrfs.loop_devices_for(str(image)) == []
    with Workspace.create() as ws:
        assert store.mounted() and ws.info().storage == "btrfs"
        assert Path(ws._rec.fs.layer.path).parent == fresh_store


def test_no_store_on_memory_backed_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """An image on tmpfs (or the qemu guest's 9p root) cannot back a direct-I/O loop device:
    setup refuses with a typed error, and doctor warns that every snapshot copies its layer."""
    mp = Path(f"/dev/shm/bunshin-store-test-{os.getpid()}/layers")
    monkeypatch.setattr(store, "STORE", mp)
    monkeypatch.setattr(store, "IMAGE", mp.with_name("layers.img"))
    with pytest.raises(KernelFeatureError, match="tmpfs"):
        store.setup()
    assert store.ensure() is None and store.default_root() == store.fallback_root()
    (check,) = [c for c in doctor.run_checks() if c.name == "layer store"]
    assert check.level == "WARN" and "tmpfs" in check.detail and "copies its workspace's layer once" in check.detail
    assert not mp.parent.exists()


def test_stack_depth_and_option_bounds() -> None:
    """A snapshot flattens when a clone would stack more than MAX_STACK frozen layers, or when
    its overlay options would pass MAX_OPTIONS (one page for mount(2), CRIU's mountinfo lines)."""
    root = Path("/var/lib/bunshin/layers")
    rootfs = Rootfs("host", ("/run/bunshin/layers/host-0123456789ab", "/"), "d", "host")
    frozen_at = [Layer("btrfs", str(root / "snapshots" / f"snap-{i:012x}")) for i in range(frozen.MAX_STACK + 1)]
    top, below = frozen_at[0], tuple(frozen_at[1:])
    assert not frozen.too_deep(FsState(rootfs, top, below[:-1]), root)  # a clone stacks MAX_STACK
    assert frozen.too_deep(FsState(rootfs, top, below), root)           # ... or one more
    deep = root / ("d" * 200)
    long = [Layer("btrfs", str(deep / f"snap-{i:012x}")) for i in range(14)]
    fs = FsState(rootfs, long[0], tuple(long[1:]))
    assert len(fs.lowers) + 1 < frozen.MAX_STACK and frozen.too_deep(fs, root)
