"""What issue 40 took off the fork path keeps its semantics: CRIU's kerndat cache (criu.py, CRIU
patch 0007) is loaded by every dump and restore, also where /run is no tmpfs, and a killed
CRIU's leftover temporary does not keep it from being written; a workspace on network="none"
is dumped without its network namespace's contents (--empty-ns net, patch 0008) while one on
a bridge keeps them; the dump's cgroup yard; tmpfs contents dumped without gzip (patch 0009)
restore, and so do images an unpatched CRIU wrote with gzip; a tmpfs as its mount made it is
dumped and restored without tar (patch 0010), in a user namespace too, and one whose root was
changed keeps the change."""

from __future__ import annotations

import gzip
import os
import time
from pathlib import Path

import pytest

from bunshinfork import Snapshot, Workspace, WorkspaceSpec
from bunshinfork.process import cgyard, criu


def _one_clone(snap: Snapshot) -> Workspace:
    (c,) = snap.fork(1)
    assert not isinstance(c, Exception), c
    return c


def _assert_a_clone_keeps_the_tmpfs_files(snap: Snapshot) -> None:
    c = _one_clone(snap)
    try:
        assert c.files.read("/tmp/kept.txt") == "in /tmp"
        assert c.files.read("/dev/shm/kept.txt") == "in /dev/shm"
    finally:
        c.destroy()


def test_a_stale_temporary_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    tmp = tmp_path / f"{criu.KDAT_NAME}.tmp"
    assert not criu.unblock_kdat_cache(tmp_path)
    tmp.touch()
    assert not criu.unblock_kdat_cache(tmp_path)  # a CRIU may be writing it now
    assert tmp.exists()
    old = time.time() - criu.KDAT_STALE_S - 1
    os.utime(tmp, (old, old))
    assert criu.unblock_kdat_cache(tmp_path)
    assert not tmp.exists()


def test_dumps_and_restores_load_the_cache_from_the_state_root() -> None:
    cache = criu.kdat_dir() / criu.KDAT_NAME
    # A killed CRIU's leftover, and no cache: the next CRIU removes the one and writes the other.
    cache.unlink(missing_ok=True)
    leftover = cache.with_name(f"{criu.KDAT_NAME}.tmp")
    leftover.touch()
    old = time.time() - criu.KDAT_STALE_S - 1
    os.utime(leftover, (old, old))
    with Workspace.create(WorkspaceSpec()) as ws:
        snap = ws.snapshot("copy")
        try:
            assert cache.is_file() and not leftover.exists()
            c = _one_clone(snap)
            log = (c.record.dir / "criu" / "restore.log").read_text()
            c.destroy()
            assert "Loaded kdat cache from " + str(cache) in log
        finally:
            snap.release()


def test_the_dump_skips_what_no_restore_reads_and_uses_a_yard() -> None:
    with Workspace.create(WorkspaceSpec()) as ws:
        snap = ws.snapshot("copy")
        try:
            images = snap.images_dir
            log = (images / "dump.log").read_text()
            assert not list(images.glob("ifaddr-*.img")) and not list(images.glob("netns-ct-*.img"))
            assert "Running ip addr save" not in log
            # Given to the dump (dump_opts): a name CRIU did not find there would have failed it.
            assert (snap.dir / cgyard.DUMP_YARD).is_dir()
            c = _one_clone(snap)
            try:
                r = c.commands.run("grep -c : /proc/net/dev")
                assert r.exit_code == 0 and r.stdout.strip() == "1", r  # lo alone, as before
            finally:
                c.destroy()
        finally:
            snap.release()


def test_tmpfs_contents_restore_plain_and_gzipped(tmp_path: Path) -> None:
    with Workspace.create(WorkspaceSpec()) as ws:
        ws.files.write("/tmp/kept.txt", "in /tmp")
        ws.files.write("/dev/shm/kept.txt", "in /dev/shm")
        snap = ws.snapshot("copy")
        try:
            tars = list(snap.images_dir.glob("tmpfs-dev-*.tar.gz.img"))
            assert tars and all(t.read_bytes()[:2] != b"\x1f\x8b" for t in tars)  # plain tar now
            _assert_a_clone_keeps_the_tmpfs_files(snap)
            saved = Path(snap.save(tmp_path / "saved").result(timeout=120))
        finally:
            snap.release()
    # What an unpatched CRIU wrote: the same contents, gzipped (an empty image is patch 0010's).
    for t in (saved / Snapshot.layout.images).glob("tmpfs-dev-*.tar.gz.img"):
        if t.stat().st_size:
            t.write_bytes(gzip.compress(t.read_bytes()))
    loaded = Snapshot.load(saved)
    try:
        _assert_a_clone_keeps_the_tmpfs_files(loaded)
    finally:
        loaded.release()


def test_a_bridged_workspace_is_dumped_with_its_network() -> None:
    with Workspace.create(WorkspaceSpec(network="bridge")) as ws:
        snap = ws.snapshot("copy")
        try:
            assert list(snap.images_dir.glob("ifaddr-*.img"))
        finally:
            snap.release()


def _empty_images(snap: Snapshot) -> int:
    return sum(not t.stat().st_size for t in snap.images_dir.glob("tmpfs-dev-*.tar.gz.img"))


USERNS = [pytest.param(False, id="root"), pytest.param(True, id="userns")]


def _spec(userns: bool) -> WorkspaceSpec:
    return WorkspaceSpec(rootfs="debian", userns=True) if userns else WorkspaceSpec()


@pytest.mark.parametrize("userns", USERNS)
def test_a_tmpfs_as_its_mount_made_it_is_dumped_without_tar(userns: bool) -> None:
    """A default workspace's five tmpfs: /dev holds its device nodes; /dev/shm, /tmp and the masked
    /proc/acpi and /sys/firmware are empty with the mode and owner their options give a new one.
    Their images are empty (no tar at the dump, none at the restore), and the clone's mounts are
    as they were: writable where they were, the same modes. In a user namespace the host sees
    their roots owned by the map's first uid, which the options name as 0 inside."""
    with Workspace.create(_spec(userns)) as ws:
        snap = ws.snapshot("copy")
        try:
            assert _empty_images(snap) == 4
            c = _one_clone(snap)
            try:
                r = c.commands.run("stat -c '%a %u %g' /dev/shm /tmp /proc/acpi /sys/firmware"
                                   " && touch /tmp/t /dev/shm/t && ls /dev/null")
                assert r.exit_code == 0, r
                assert r.stdout.split("\n")[:4] == ["1777 0 0", "1777 0 0", "555 0 0", "555 0 0"], r.stdout
            finally:
                c.destroy()
        finally:
            snap.release()


@pytest.mark.parametrize("userns", USERNS)
def test_an_empty_tmpfs_whose_root_changed_keeps_the_change(userns: bool) -> None:
    """Empty but chmod-ed or chown-ed since its mount: tar keeps the root's mode and owner, so it
    goes through tar as before."""
    with Workspace.create(_spec(userns)) as ws:
        r = ws.commands.run("chmod 1770 /dev/shm && chown 1000:1001 /tmp")
        assert r.exit_code == 0, r
        snap = ws.snapshot("copy")
        try:
            assert _empty_images(snap) == 2  # the masked directories alone
            c = _one_clone(snap)
            try:
                r = c.commands.run("stat -c '%a %u %g' /dev/shm /tmp")
                assert r.stdout.split() == ["1770", "0", "0", "1777", "1000", "1001"], r.stdout
            finally:
                c.destroy()
        finally:
            snap.release()
