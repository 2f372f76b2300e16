"""WorkspaceSpec(userns=True): a workspace in a user namespace of its own, Docker's userns-remap.

Root inside is host uid 100000: its files, its processes and what it may do to the host are
that unprivileged user's, in the workspace, in its forks, and through the files API.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest
from helpers import run_ok
from test_rootfs import _minimal_bash_rootfs

from bunshinfork import idmap, pipeline
from bunshinfork.errors import FileOperationError, SpecError
from bunshinfork.fs import rootfs
from bunshinfork.memory import cow
from bunshinfork.workspace import Snapshot, Workspace

pytestmark = pytest.mark.slow  # the Debian rootfs (debootstrap once, then its shifted copy once)

MAP = f"0 {idmap.BASE} {idmap.SIZE}"


def _host_uids(ws: Workspace) -> set[int]:
    """The real uids, as the host sees them, of every process in the workspace's cgroup."""
    uids = set()
    for pid in ws._cgroup().pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uids.add(int(status.split("Uid:")[1].split()[0]))
    return uids


def _upper(ws: Workspace) -> Path:
    assert ws._rec.fs is not None and ws._rec.fs.layer is not None
    return Path(ws._rec.fs.layer.upper)


def _processes_of(uid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def test_root_inside_is_an_unprivileged_host_user() -> None:
    with Workspace.create(rootfs="debian", userns=True) as ws:
        assert " ".join(run_ok(ws, "cat /proc/self/uid_map").stdout.split()) == MAP
        assert " ".join(run_ok(ws, "cat /proc/self/gid_map").stdout.split()) == MAP
        assert run_ok(ws, "id -u; id -g").stdout == "0\n0\n"
        # Every process of it is uid 100000 on the host.
        run_ok(ws, "sleep 30 >/dev/null 2>&1 &")
        assert _host_uids(ws) == {idmap.BASE}
        # The rootfs is the shifted copy: root's files inside, uid 100000's outside; the Debian
        # cache it was copied from is untouched.
        assert run_ok(ws, "stat -c '%u:%g' /etc/passwd /usr/bin/apt-get /").stdout == "0:0\n0:0\n0:0\n"
        info = ws.info()
        assert info.rootfs_digest.endswith(f"-u{idmap.BASE}")
        cache = rootfs.debian()
        assert os.stat(Path(cache.lowerdirs[0], "etc/passwd")).st_uid == 0
        # What it writes belongs to 100000 in its layer, and to root inside.
        run_ok(ws, "echo hi > /root/made && mkdir /srv/d && chown 1000:1000 /srv/d")
        assert os.stat(_upper(ws) / "root/made").st_uid == idmap.BASE
        assert os.stat(_upper(ws) / "srv/d")[4:6] == (idmap.BASE + 1000, idmap.BASE + 1000)
        # Package-manager style work: root owns /usr inside.
        run_ok(ws, "echo x > /usr/local/bin/tool && chmod 755 /usr/local/bin/tool")
        # The host's own files (the /dev nodes bound in) show as nobody.
        assert run_ok(ws, "stat -c %u /dev/null").stdout == f"{idmap.OVERFLOW}\n"
    assert not _processes_of(idmap.BASE)


def test_privileged_root_in_a_user_namespace_holds_nothing_on_the_host() -> None:
    # privileged=True keeps every capability, over the workspace's own namespaces only.
    with Workspace.create(rootfs="debian", userns=True, privileged=True) as ws:
        assert run_ok(ws, "mkdir -p /mnt/t && mount -t tmpfs none /mnt/t && echo ok").stdout == "ok\n"
        # Devices: mknod needs CAP_MKNOD in the initial namespace.
        r = ws.commands.run("mknod /tmp/mem c 1 1")
        assert r.exit_code != 0 and "Operation not permitted" in r.stderr
        # The host's kernel settings belong to the host's root, not to the namespace's.
        r = ws.commands.run("echo 3 > /proc/sys/vm/drop_caches")
        assert r.exit_code != 0 and ("Permission denied" in r.stderr or "Read-only" in r.stderr), r.stderr
        # Nor can it load modules or set the clock.
        assert ws.commands.run("echo 0 > /proc/sys/kernel/modules_disabled").exit_code != 0
        assert ws.commands.run("date -s @0").exit_code != 0
    # Without userns the same workspace can make the device.
    with Workspace.create(rootfs="debian", privileged=True) as ws:
        run_ok(ws, "mknod /tmp/null c 1 3")


def test_a_fork_keeps_the_map_and_its_state() -> None:
    with Workspace.create(rootfs="debian", userns=True) as ws:
        run_ok(ws, "echo source > /root/mark")
        ws.commands.run("i=0; while :; do i=$((i+1)); echo $i > /tmp/n.tmp; mv /tmp/n.tmp /tmp/n; sleep 0.05; done",
                        background=True)
        deadline = time.monotonic() + 10
        while ws.commands.run("test -s /tmp/n").exit_code and time.monotonic() < deadline:
            time.sleep(0.05)
        clones = ws.fork(2)
        try:
            for i, c in enumerate(clones):
                assert " ".join(run_ok(c, "cat /proc/self/uid_map").stdout.split()) == MAP
                assert _host_uids(c) == {idmap.BASE}
                # The counter kept counting in the clone: its process came along.
                a = int(run_ok(c, "cat /tmp/n").stdout)
                time.sleep(0.3)
                assert int(run_ok(c, "cat /tmp/n").stdout) > a
                assert run_ok(c, "cat /root/mark").stdout == "source\n"
                run_ok(c, f"echo clone{i} > /root/mine")
                assert os.stat(_upper(c) / "root/mine").st_uid == idmap.BASE
                # The clone's root owns what the init keeps: it can still shorten its life.
                assert run_ok(c, "stat -c %u /.bunshin").stdout == "0\n"
            assert [run_ok(c, "cat /root/mine").stdout for c in clones] == ["clone0\n", "clone1\n"]
            assert ws.commands.run("test -e /root/mine").exit_code == 1
            assert _host_uids(ws) == {idmap.BASE}
        finally:
            for c in clones:
                c.destroy()
    assert not _processes_of(idmap.BASE)


def test_a_restored_workspace_dumps_again() -> None:
    """A clone or a resumed workspace is itself snapshotted, forked and paused: CRIU's dump checks
    that the namespaces belong to the user namespace by opening /proc/<init>/ns/* from inside it,
    which the restored init (not dumpable, its memory forked from CRIU's, so owned by the host's
    user namespace) refused: 'Can't open <pid>/ns/net on procfs: Permission denied' on the second
    pause of every sandbox of `bunshin serve` (criu/patches/0006)."""
    with Workspace.create(rootfs="debian", userns=True) as ws:
        run_ok(ws, "echo kept > /root/mark")
        for _ in range(2):
            ws.pause_to_disk()
            ws.resume_from_disk()
        [clone] = ws.fork(1)
        try:
            assert isinstance(clone, Workspace)
            [grandchild] = clone.fork(1)  # a fork of a clone
            try:
                assert isinstance(grandchild, Workspace)
                assert run_ok(grandchild, "cat /root/mark").stdout == "kept\n"
                assert " ".join(run_ok(grandchild, "cat /proc/self/uid_map").stdout.split()) == MAP
            finally:
                grandchild.destroy()
        finally:
            clone.destroy()


def test_a_bridge_network_is_set_up_inside_from_outside() -> None:
    with Workspace.create(rootfs="debian", userns=True, network="bridge") as ws:
        # The veth is in the namespace's network namespace, addressed by the host.
        assert set(run_ok(ws, "ls /sys/class/net").stdout.split()) >= {"lo", "eth0"}
        assert run_ok(ws, "cat /sys/class/net/eth0/operstate").stdout.strip() in ("up", "unknown")
        ip = ws.info().network["ip"]
        ws.commands.run("python3 -c \"import socket; s = socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen(); "
                        "c, _ = s.accept(); c.sendall(b'from inside'); c.close()\"", background=True)
        deadline = time.monotonic() + 15
        while True:
            try:
                with socket.create_connection((ip, 8080), timeout=2) as conn:
                    assert conn.recv(64) == b"from inside"
                    break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.1)


def test_a_saved_snapshot_loads_into_the_same_map(tmp_path: Path) -> None:
    with Workspace.create(rootfs="debian", userns=True) as ws:
        run_ok(ws, "echo kept > /root/kept")
        with ws.snapshot() as snap:
            path = snap.save(tmp_path / "saved").result(timeout=120)
    loaded = Snapshot.load(path)
    try:
        (clone,) = loaded.fork(1)
        with clone:
            assert " ".join(run_ok(clone, "cat /proc/self/uid_map").stdout.split()) == MAP
            assert run_ok(clone, "cat /root/kept; stat -c %u /root/kept").stdout == "kept\n0\n"
    finally:
        loaded.release()


def test_the_files_api_creates_files_as_the_users_inside() -> None:
    with Workspace.create(rootfs="debian", userns=True) as ws:
        run_ok(ws, "useradd -m -u 1000 alice")
        info = ws.files.write("/root/notes/a.txt", "root's")
        assert (info.owner, info.group) == ("root", "root")
        assert os.stat(_upper(ws) / "root/notes").st_uid == idmap.BASE
        assert os.stat(_upper(ws) / "root/notes/a.txt").st_uid == idmap.BASE
        assert run_ok(ws, "stat -c %U:%G /root/notes /root/notes/a.txt").stdout == "root:root\nroot:root\n"
        mine = ws.files.write("/home/alice/b.txt", "alice's", user="alice")
        assert (mine.owner, mine.group) == ("alice", "alice")
        assert os.stat(_upper(ws) / "home/alice/b.txt").st_uid == idmap.BASE + 1000
        assert run_ok(ws, "stat -c %U /home/alice/b.txt").stdout == "alice\n"
        # Alice is alice inside: root's 0700 home stays closed to her.
        with pytest.raises(Exception, match="ermission"):
            ws.files.read("/root/notes/a.txt", user="alice")
        assert ws.files.get_info("/etc/passwd").owner == "root"
        # Inside's own nobody (host uid 165534) is a user like any other, not a host id.
        assert ws.files.write("/tmp/by-nobody", "x", user="nobody").owner == "nobody"
        assert os.stat(f"/proc/{ws.init_pid}/root/tmp/by-nobody").st_uid == idmap.BASE + idmap.OVERFLOW
        # A device is never opened for writing (only regular files are), and keeps its owner:
        # /dev/null is the host's own node.
        before = os.stat("/dev/null")
        with pytest.raises(FileOperationError, match="not a regular file"):
            ws.files.write("/dev/null", "discarded")
        assert os.stat("/dev/null")[4:6] == before[4:6]
        assert ws.files.get_info("/dev/null").owner == "nobody"  # a host id: the overflow id


def test_the_host_rootfs_cannot_be_given_to_a_user_namespace() -> None:
    with pytest.raises(SpecError, match="userns"):
        Workspace.create(userns=True)
    with pytest.raises(SpecError, match="userns must be True or False"):
        Workspace.create(rootfs="debian", userns="yes")  # type: ignore[arg-type]


def test_a_directory_rootfs_copy_goes_with_its_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _minimal_bash_rootfs(root)
    with Workspace.create(rootfs=str(root), userns=True) as ws:
        assert run_ok(ws, "read -r l < /proc/self/uid_map; echo $l").stdout.split() == MAP.split()
        copy = Path(ws._rec.fs.rootfs.lowerdirs[0]).parent
        assert copy.is_dir() and os.stat(copy / "0/bin/bash").st_uid == idmap.BASE
        assert os.stat(root / "bin/bash").st_uid == 0
        # In use: gc keeps it even with its directory gone.
        os.rename(root, tmp_path / "moved")
        pipeline.gc()
        assert copy.is_dir()
    assert any(str(copy) in r for r in pipeline.gc()["fs"])
    assert not copy.exists() and not (copy.parent / f".shift-{copy.name}.lock").exists()


@pytest.mark.cow
@pytest.mark.skipif(not cow.available(), reason="needs /dev/bunshin (run `make test-guest`)")
def test_cow_forks_of_a_user_namespace(tmp_path: Path) -> None:
    # A directory rootfs: the guest has no Debian cache of its own to copy.
    root = tmp_path / "root"
    _minimal_bash_rootfs(root)
    with Workspace.create(rootfs=str(root), userns=True) as ws:
        # 32 MiB of the shell's own heap, which the clones share copy-on-write.
        # bash alone (the rootfs has nothing else): it blocks reading a coprocess that never writes.
        ws.commands.run("x=$(printf '%*s' 33554432 ''); coproc { read -r _; }; echo ready > /tmp/r; "
                        "read -r -u ${COPROC[0]} _", background=True)
        deadline = time.monotonic() + 20
        while ws.commands.run("read -r l < /tmp/r").exit_code and time.monotonic() < deadline:
            time.sleep(0.1)
        with ws.snapshot(memory="cow") as snap:
            assert snap.kind == "cow"
            clones = snap.fork(2)
        try:
            for c in clones:
                assert run_ok(c, "read -r l < /proc/self/uid_map; echo $l").stdout.split() == MAP.split()
                assert _host_uids(c) == {idmap.BASE}
                run_ok(c, "echo mine > /tmp/own")
                assert os.stat(_upper(c) / "..").st_uid == 0  # the layer's own directory stays the host's
        finally:
            for c in clones:
                c.destroy()
        assert ws.commands.run("read -r l < /tmp/own").exit_code != 0
        copy = Path(ws._rec.fs.rootfs.lowerdirs[0]).parent
    _forget(root, copy)


def test_setuid_bits_and_file_capabilities_survive_the_shift(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _minimal_bash_rootfs(root)
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0::/:/bin/bash\nalice:x:1000:1000::/:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\nalice:x:1000:\n")
    shutil.copy2(root / "bin/bash", root / "bin/capbash")
    # cap_net_bind_service, permitted and effective, as setcap writes it on the host (revision 2);
    # one the workspace's bounding set keeps (cap_net_raw is dropped, so it could not be gained).
    v2 = (0x02000001).to_bytes(4, "little") + (1 << 10).to_bytes(4, "little") + bytes(12)
    os.setxattr(root / "bin/capbash", "security.capability", v2)
    shutil.copy2(root / "bin/bash", root / "bin/suidbash")
    os.chmod(root / "bin/suidbash", 0o4755)
    with Workspace.create(rootfs=str(root), userns=True) as ws:
        lower = Path(ws._rec.fs.rootfs.lowerdirs[0])
        assert os.stat(lower / "bin/suidbash").st_mode & 0o7777 == 0o4755
        cap = os.getxattr(lower / "bin/capbash", "security.capability")
        assert cap[:4] == (0x03000001).to_bytes(4, "little") and cap[20:24] == idmap.BASE.to_bytes(4, "little")
        # The kernel honours it inside: alice running it holds cap_net_bind_service.
        show = "while read -r k v; do [ $k = CapEff: ] && echo $v; done < /proc/self/status; :"
        r = run_ok(ws, ["/bin/capbash", "-c", show], user="alice")
        assert int(r.stdout, 16) == 1 << 10
        assert int(run_ok(ws, ["/bin/bash", "-c", show], user="alice").stdout, 16) == 0
    _forget(root, lower.parent)


def _forget(root: Path, copy: Path) -> None:
    """A test's directory rootfs goes, and gc takes its shifted copy with it."""
    shutil.rmtree(root)
    pipeline.gc()
    assert not copy.exists()
