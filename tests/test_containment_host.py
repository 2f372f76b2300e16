"""Containment against the host (issue 36): what a sandbox writes or an image ships never reaches
the host's devices or gives a local user of the host root. Each attack runs against a created
workspace, a clone and a resumed one: CRIU restores mounts, and a cgroup's device program is
not CRIU's to restore.

- Devices: a block node for a loop device the test made (over a file the test made), placed
  where an image layer would put it (the root overlay's layer) and in the sandbox's own /dev
  tmpfs (which is not nodev), opens for neither reading nor writing: the root overlay is nodev
  and the workspace's cgroup admits only the standard nodes. Image unpacking drops the node.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fork_support import fork_of
from helpers import run_ok

from bunshinfork.images import store as image_store
from bunshinfork.images import unpack
from bunshinfork.workspace import Workspace

SECRET = b"host-block-device-secret"
# Opens a node for reading and for writing; prints what each got: the first bytes or the errno name.
PROBE = """
import errno, sys
for path in sys.argv[1:]:
    for mode in ("rb", "r+b"):
        try:
            with open(path, mode) as f:
                print(path, mode, f.read(24).decode(errors="replace"))
        except OSError as e:
            print(path, mode, errno.errorcode[e.errno])
"""


@contextlib.contextmanager
def _loop_device(tmp: Path) -> Iterator[tuple[str, int, int]]:
    """A loop device over a file of this test's, holding SECRET: (device, major, minor)."""
    backing = tmp / "disk.img"
    backing.write_bytes(SECRET + bytes(1 << 20))
    dev = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True,
                         check=True, timeout=30).stdout.strip()
    try:
        rdev = os.stat(dev).st_rdev
        yield dev, os.major(rdev), os.minor(rdev)
    finally:
        subprocess.run(["losetup", "-d", dev], check=True, timeout=30)


def _in_ws_mntns(ws: Workspace, *cmd: str) -> None:
    """Run a host-root command in the workspace's mount namespace (what only the host can do)."""
    subprocess.run(["nsenter", "-t", str(ws.init_pid), "-m", *cmd], check=True, timeout=30)


@contextlib.contextmanager
def _subject(kind: str, major: int, minor: int) -> Iterator[Workspace]:
    """A workspace of `kind` whose root layer and /dev hold a block node for major:minor."""
    with Workspace.create() as src:
        # Where an image's layer put it (the attack's path: a node in a lower or the upper
        # layer, seen through the root overlay) ...
        layer = src.layer_dir
        assert layer is not None
        os.mknod(layer / "upper" / "blk", stat.S_IFBLK | 0o666, os.makedev(major, minor))
        with contextlib.ExitStack() as stack:
            ws = src
            if kind == "clone":
                ws = stack.enter_context(fork_of(src, 1))[0]
            elif kind == "resumed":
                src.pause_to_disk()
                src.resume_from_disk()
            # ... and in the sandbox's /dev, a tmpfs that must allow nodes: only the device
            # cgroup stands between it and the host's disk. (Made in the subject itself: CRIU
            # could not make it again in a clone's /dev, under that cgroup.)
            _in_ws_mntns(ws, "sh", "-c", f"umask 0 && mknod /dev/blk b {major} {minor}")
            yield ws


@pytest.mark.parametrize("kind", ["created", "clone", "resumed"])
def test_a_block_node_does_not_reach_the_host_device(tmp_path: Path, kind: str) -> None:
    with _loop_device(tmp_path) as (dev, major, minor), _subject(kind, major, minor) as ws:
        # CRIU remounts a clone's and a resumed workspace's root: nodev must come back with it.
        root = [ln.split() for ln in Path(f"/proc/{ws.init_pid}/mountinfo").read_text().splitlines()
                if ln.split()[4] == "/"]
        assert len(root) == 1 and "nodev" in root[0][5].split(","), root
        ws.files.write("/root/probe.py", PROBE)
        got = run_ok(ws, ["python3", "/root/probe.py", "/blk", "/dev/blk"]).stdout.split("\n")
        # nodev on the root overlay: EACCES; the device cgroup: EPERM. Never the disk's bytes.
        assert got[:4] == ["/blk rb EACCES", "/blk r+b EACCES", "/dev/blk rb EPERM", "/dev/blk r+b EPERM"], got
        # Root inside cannot make a node of its own either (no CAP_MKNOD).
        r = ws.commands.run(f"mknod /tmp/b2 b {major} {minor}")
        assert r.exit_code != 0 and "Operation not permitted" in r.stderr
        # The standard nodes keep working, a pty among them.
        out = run_ok(ws, ["python3", "-c", "import os, pty; m, s = pty.openpty(); os.write(m, b'x\\n'); "
                          "print(len(open('/dev/urandom','rb').read(4)), open('/dev/zero','rb').read(2), "
                          "open('/dev/null','w').write('z'), os.read(s, 2))"]).stdout.strip()
        assert out == "4 b'\\x00\\x00' 1 b'x\\n'"
        assert Path(dev).read_bytes()[:len(SECRET)] == SECRET


def test_image_layers_keep_no_device_nodes(tmp_path: Path) -> None:
    """Unpacking keeps 0:0 character devices (overlay whiteouts) and FIFOs, and drops every
    other device node, saying which: a layer's node would be the host's device."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, kind, major, minor in (("dev/sda", tarfile.BLKTYPE, 8, 0), ("dev/mem", tarfile.CHRTYPE, 1, 1),
                                         ("etc/gone", tarfile.CHRTYPE, 0, 0), ("run/fifo", tarfile.FIFOTYPE, 0, 0)):
            ti = tarfile.TarInfo(name)
            ti.type, ti.devmajor, ti.devminor, ti.mode = kind, major, minor, 0o666
            tf.addfile(ti)
    out = unpack.unpack(io.BytesIO(buf.getvalue()), tmp_path)
    assert [s.split(":")[0] for s in out.skipped] == ["dev/sda", "dev/mem"]
    assert not os.path.lexists(tmp_path / "dev/sda") and not os.path.lexists(tmp_path / "dev/mem")
    wh = os.lstat(tmp_path / "etc/gone")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert stat.S_ISFIFO(os.lstat(tmp_path / "run/fifo").st_mode)


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    # Through a shell: setpriv itself keeps its capabilities up to its own exec.
    return subprocess.run([*NOBODY, "sh", "-c", 'exec "$@"', "sh", *cmd], capture_output=True, text=True,
                          timeout=30)


def _unreachable(path: Path) -> None:
    """A local user of the host can neither run `path` as root nor reach it."""
    assert path.is_file(), path
    r = _as_nobody(str(path), "-u")
    assert r.returncode != 0 and r.stdout.strip() != "0", (path, r.stdout, r.stderr)
    assert "Permission denied" in r.stderr, (path, r.stderr)
    assert _as_nobody("ls", str(path.parent)).returncode != 0, path


def test_a_setuid_file_written_inside_is_no_host_root() -> None:
    """Root inside writes a setuid-root `id`: it works inside (sudo must), and gives a local user
    of the host nothing where the host keeps it: the workspace's layer, a snapshot's frozen
    layer, a workspace paused to disk. The stores are nosuid,nodev, their roots 0711, each
    workspace's layer 0700 (its upper/ stays 0755: it is the sandbox's /)."""
    with Workspace.create() as ws:
        run_ok(ws, "cp /usr/bin/id /suid-id && chmod 4755 /suid-id")
        assert run_ok(ws, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/suid-id", "-u"]
                      ).stdout.strip() == "0"
        layer = ws.layer_dir
        assert layer is not None
        _unreachable(layer / "upper" / "suid-id")
        assert stat.S_IMODE(os.stat(layer).st_mode) == 0o700 and stat.S_IMODE(os.stat(layer / "upper").st_mode) == 0o755
        assert stat.S_IMODE(os.stat(layer.parent).st_mode) == 0o711
        flags = os.statvfs(layer).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV, layer
        with fork_of(ws, 1) as clones:
            fs = clones[0].record.fs
            assert fs is not None and fs.lowers
            _unreachable(Path(fs.lowers[0].upper) / "suid-id")
        ws.pause_to_disk()
        saved = Path(str(ws.record.saved))
        _unreachable(next(saved.rglob("suid-id")))
        ws.resume_from_disk()


def test_an_image_layers_setuid_file_is_no_host_root() -> None:
    """An image's setuid-root file, unpacked into the image store, is as out of a local user's
    reach as a sandbox's: the store's mount is nosuid,nodev, its layers 0700."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tf.gettarinfo("/usr/bin/id", arcname="suid-id")
        ti.uid = ti.gid = 0
        ti.mode = 0o4755
        with open("/usr/bin/id", "rb") as f:
            tf.addfile(ti, f)
    raw = buf.getvalue()
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    try:
        assert image_store.add(diff_id, lambda: io.BytesIO(raw)) == []
        layer = image_store.path(diff_id)
        assert stat.S_IMODE(os.stat(layer / "suid-id").st_mode) == 0o4755
        _unreachable(layer / "suid-id")
        flags = os.statvfs(layer).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV
        assert stat.S_IMODE(os.stat(image_store.ROOT).st_mode) == 0o711
    finally:
        shutil.rmtree(image_store.path(diff_id), ignore_errors=True)


# Docker's masked paths (moby's oci/defaults.go, with /proc/interrupts as Docker 28 and
# Kubernetes mask it): a file reads empty, a directory is an empty read-only tmpfs.
MASKED_FILES = ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                "/proc/latency_stats", "/proc/sysrq-trigger", "/proc/interrupts")
MASKED_DIRS = ("/proc/acpi", "/proc/scsi", "/proc/asound", "/sys/firmware", "/sys/devices/virtual/powercap")
MASK_PROBE = """
import json, os, sys
out = {}
for p in json.loads(sys.argv[1]):
    if os.path.isdir(p):
        st = os.statvfs(p)
        out[p] = ["dir", sorted(os.listdir(p)), bool(st.f_flag & os.ST_RDONLY)]
    else:
        with open(p, "rb") as f:
            out[p] = ["file", len(f.read(4096))]
print(json.dumps(out))
"""


def test_dockers_masked_paths_are_masked_in_a_workspace_and_its_clone() -> None:
    present = [p for p in (*MASKED_FILES, *MASKED_DIRS) if os.path.exists(p)]
    assert "/sys/firmware" in present and "/proc/acpi" in present  # this host has both to hide
    with Workspace.create() as ws, fork_of(ws, 1) as clones:
        for w in (ws, clones[0]):
            w.files.write("/root/masks.py", MASK_PROBE)
            got = json.loads(run_ok(w, ["python3", "/root/masks.py", json.dumps(present)]).stdout)
            want = {p: ["dir", [], True] if os.path.isdir(p) else ["file", 0] for p in present}
            assert got == want
