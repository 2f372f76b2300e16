"""Disk quotas (WorkspaceSpec.disk_limit): a workspace that fills its quota gets EDQUOT (btrfs
layer) or ENOSPC (tmpfs: its /tmp, /dev/shm, or a layer on the state root's tmpfs) inside; its
source, its sibling forks and the host keep writing; destroying it leaves no qgroup behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import run_ok

from bunshinfork.cli import main
from bunshinfork.errors import SpecError
from bunshinfork.fs import btrfs, quota, store
from bunshinfork.spec import WorkspaceSpec
from bunshinfork.workspace import Workspace

IMAGE = "/var/tmp/bunshin-quota-test.img"
MOUNT = "/var/tmp/bunshin-quota-test"
MiB = 1 << 20


@pytest.fixture(scope="module")
def qdir():
    """A btrfs storage_dir of this module's own, so that enabling quotas on it changes nothing
    for the other tests (nor for the layer store)."""
    if not os.path.exists("/dev/loop-control"):
        pytest.skip("needs loop devices for a btrfs storage_dir")
    if not quota.simple_available():
        pytest.skip("the kernel has no btrfs simple quotas")
    mp = btrfs.setup_btrfs_loop(IMAGE, MOUNT, size=1 << 30)
    yield mp
    btrfs.teardown_btrfs_loop(mp, remove_image=IMAGE)


def _write(ws: Workspace, path: str, mib: int) -> tuple[int, str]:
    """Write `mib` MiB to `path` inside the workspace (synced, so btrfs charges it now); the exit
    status and stderr."""
    r = ws.commands.run(f"head -c {mib}M /dev/zero > {path} && sync {path}", timeout=60)
    return r.exit_code, r.stderr


def _sizes(ws: Workspace, path: str) -> int:
    return int(run_ok(ws, f"stat -c %s {path}").stdout)


def _qgroups(mp: str) -> set[str]:
    d = Path("/sys/fs/btrfs", btrfs.fsid(mp) or "-", "qgroups")
    return {q for q in os.listdir(d) if q.startswith("0_")} - {"0_5"} if d.is_dir() else set()


@pytest.mark.parametrize("bad", ["lots", "-1M", 0, -5, True, 1.5, "512K", 1 << 61, [1]])
def test_bad_disk_limit_is_a_spec_error(bad):
    with pytest.raises(SpecError, match="disk_limit"):
        WorkspaceSpec(disk_limit=bad).validate()
    assert WorkspaceSpec(disk_limit="16M").validate().disk_limit == 16 * MiB


def test_cli_disk_flag_names_itself_in_its_error(capsys):
    assert main(["create", "--disk", "lots"]) == 125
    err = capsys.readouterr().err
    assert err.startswith("bunshin: error: ") and "--disk" in err and "lots" in err


def test_cli_disk_flag_sets_the_limit(capsys, qdir):
    assert main(["create", "--disk", "8M", "--storage-dir", qdir]) == 0
    ws = Workspace.connect(capsys.readouterr().out.strip())
    try:
        assert ws.info().disk_limit == 8 * MiB
        code, err = _write(ws, "/root/fill", 16)
        assert code != 0 and "Disk quota exceeded" in err, err
    finally:
        ws.destroy()


def test_disk_limit_on_storage_that_cannot_bound_it_is_a_spec_error(tmp_path):
    # /var/tmp is neither btrfs nor tmpfs here: nothing can hold a layer to a size there.
    if store.fs_magic(tmp_path) == store.TMPFS_MAGIC or btrfs.is_btrfs(tmp_path):
        pytest.skip("tmp_path lies on btrfs or tmpfs")
    with pytest.raises(SpecError, match="disk_limit needs layers on btrfs or tmpfs"):
        Workspace.create(storage_dir=str(tmp_path), disk_limit="16M")


def test_btrfs_quota_holds_a_clone_and_spares_its_sibling_source_and_host(qdir):
    ws = Workspace.create(storage_dir=qdir, disk_limit="24M")
    try:
        # 12 MiB before the fork: in the clones' frozen lower, which their quota does not count.
        assert _write(ws, "/root/before", 12) == (0, "")
        a, b = ws.fork(2)
        assert isinstance(a, Workspace) and isinstance(b, Workspace), (a, b)
        try:
            # Appending to a file of the lower copies it up by reflink: its 12 MiB stay the
            # frozen layer's extents, and 12 + 16 > 24 still fits.
            run_ok(a, "echo x >> /root/before && sync /root/before")
            assert _write(a, "/root/mine", 16) == (0, "")
            code, err = _write(a, "/root/more", 32)
            assert code != 0 and "Disk quota exceeded" in err, err
            assert _sizes(a, "/root/more") < 24 * MiB
            # Its sibling, its source and the host are not held by what the clone wrote.
            assert _write(b, "/root/mine", 16) == (0, "")
            assert _write(ws, "/root/after", 8) == (0, "")
            with open(Path(qdir, "host-file"), "wb") as f:
                f.write(bytes(32 * MiB))
            os.unlink(Path(qdir, "host-file"))
            # The clone's own quota is still full after a fork of it: a fork inherits the limit
            # on what it writes, and starts with its own empty layer.
            (aa,) = a.fork()
            assert isinstance(aa, Workspace), aa
            try:
                assert _sizes(aa, "/root/mine") == 16 * MiB
                code, err = _write(aa, "/root/big", 32)
                assert code != 0 and "Disk quota exceeded" in err, err
            finally:
                aa.destroy()
        finally:
            a.destroy()
            b.destroy()
    finally:
        ws.destroy()
    # The kernel drops each qgroup with its subvolume; the source's outlived it while the
    # fork's snapshot shared its extents, and is swept once that is dropped (as gc does).
    quota.settle(qdir)
    assert _qgroups(qdir) == set(), quota.stale(qdir)


def test_tmpfs_mounts_are_held_to_the_limit_in_the_workspace_and_its_fork(qdir):
    ws = Workspace.create(storage_dir=qdir, disk_limit="8M")
    try:
        for where in ("/tmp", "/dev/shm"):
            code, err = _write(ws, f"{where}/fill", 16)
            assert code != 0 and "No space left on device" in err, (where, err)
        run_ok(ws, "rm /tmp/fill /dev/shm/fill")
        (clone,) = ws.fork()
        assert isinstance(clone, Workspace), clone
        try:
            code, err = _write(clone, "/tmp/fill", 16)
            assert code != 0 and "No space left on device" in err, err
            assert _write(ws, "/tmp/ok", 4) == (0, "")  # the clone's full /tmp is its own
        finally:
            clone.destroy()
    finally:
        ws.destroy()


def test_layer_on_the_state_root_tmpfs_is_held_to_the_limit(no_store):
    ws = Workspace.create(disk_limit="8M")
    try:
        code, err = _write(ws, "/root/fill", 16)
        assert code != 0 and "No space left on device" in err, err
        with Workspace.create() as other:  # an unlimited neighbour on the same tmpfs still writes
            assert _write(other, "/root/fill", 16) == (0, "")
    finally:
        ws.destroy()
