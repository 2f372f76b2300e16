"""The file system of a fork (paper §4.5): a frozen layer per snapshot, stacked under clones.

A snapshot freezes its source's upper (a read-only btrfs snapshot in the layer store; a copy,
once, where storage cannot copy-on-write); every clone stacks it over the source's own stack
under an empty upper. These tests cover what a clone must see (whiteouts, opaque directories,
renames, at every depth, after flattening), that nothing is copied per clone, that siblings
read the same inodes (one page cache), that inotify watches survive a fork, and that frozen
layers live exactly as long as something stacks them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import btrfsutil  # type: ignore[import-not-found]
import pytest
from fork_support import fork_of, forked
from helpers import run_ok, wait_for

from bunshinfork import StorageWarning, Workspace, accounting, state
from bunshinfork.fs import frozen, store
from bunshinfork.workspace import gc

# A tree exercising every way an upper layer records a change to what lies below it.
SETUP = """set -e
mkdir -p /root/proj/sub /root/gone-dir; echo keep > /root/keep.txt; echo sub > /root/proj/sub/f
echo doomed > /root/gone-dir/x; echo w > /root/w.txt
for i in $(seq 50); do echo $i > /root/proj/n$i; done
rm /etc/os-release                                  # whiteout over the generated skeleton
rm -rf /etc/ssl; mkdir /etc/ssl; echo only > /etc/ssl/only   # opaque directory over the skeleton
rm -rf /usr/share/doc/adduser; mkdir /usr/share/doc/adduser; echo new > /usr/share/doc/adduser/new
mv /etc/X11 /etc/X11moved                           # a lower directory renamed (copied, then whited out)
rm -f /usr/share/doc/apt/copyright                   # whiteout over the host's own /
"""
# Every path SETUP and the levels below touch, and what is there (or "-" when nothing is).
PATHS = ("/root/keep.txt", "/root/w.txt", "/root/proj/sub/f", "/root/proj/sub/g", "/root/gone-dir/x",
         "/root/proj/n7", "/etc/os-release", "/etc/ssl/only", "/usr/share/doc/adduser/new",
         "/etc/X11", "/etc/X11moved/Xsession", "/usr/share/doc/apt/copyright", "/root/level")
LISTED = ("/etc/ssl", "/usr/share/doc/adduser", "/root/proj/sub", "/root")


def view(ws: Workspace) -> dict[str, str]:
    """What the workspace shows at PATHS (content of a file, "dir", or "-") and in LISTED."""
    script = "; ".join(
        f'if [ -d {p} ]; then echo "{p}=dir"; elif [ -e {p} ]; then echo "{p}=$(head -c 64 {p} | tr -d \'\\n\')"; '
        f'else echo "{p}=-"; fi' for p in PATHS)
    script += "; " + "; ".join(f'echo "{d}/=$(ls -A {d} | tr \'\\n\' \' \')"' for d in LISTED)
    out = run_ok(ws, script).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def expected_after_setup() -> dict[str, str]:
    return {
        "/root/keep.txt": "keep", "/root/w.txt": "w", "/root/proj/sub/f": "sub", "/root/proj/sub/g": "-",
        "/root/gone-dir/x": "doomed", "/root/proj/n7": "7", "/etc/os-release": "-", "/etc/ssl/only": "only",
        "/usr/share/doc/adduser/new": "new", "/etc/X11": "-",
        "/etc/X11moved/Xsession": Path("/etc/X11/Xsession").read_bytes()[:64].decode().replace("\n", ""),
        "/usr/share/doc/apt/copyright": "-", "/root/level": "-",
    }


# Each level of a fork chain deletes something an ancestor's frozen layer holds (a whiteout
# over a frozen lower), replaces a directory of it (opaque), and writes a file.
LEVELS = [
    ("rm /root/w.txt; rm -rf /root/proj/sub; mkdir /root/proj/sub; echo g1 > /root/proj/sub/g; echo 1 > /root/level",
     {"/root/w.txt": "-", "/root/proj/sub/f": "-", "/root/proj/sub/g": "g1", "/root/level": "1"}),
    ("echo w2 > /root/w.txt; rm -rf /root/gone-dir; echo g2 > /root/proj/sub/g; echo 2 > /root/level; "
     "echo keep2 > /root/keep.txt",
     {"/root/w.txt": "w2", "/root/gone-dir/x": "-", "/root/proj/sub/g": "g2", "/root/level": "2",
      "/root/keep.txt": "keep2"}),
    ("rm /root/proj/n7; mkdir /root/gone-dir; echo back > /root/gone-dir/x; rm -rf /etc/ssl; echo 3 > /root/level",
     {"/root/proj/n7": "-", "/root/gone-dir/x": "back", "/etc/ssl/only": "-", "/root/level": "3"}),
    ("rm /root/level; echo again > /root/proj/sub/f", {"/root/level": "-", "/root/proj/sub/f": "again"}),
]


def _compare(ws: Workspace, paths: dict[str, str]) -> None:
    seen = view(ws)
    assert {p: seen[p] for p in paths} == paths, ws.id


@pytest.fixture(params=["store", "fallback", "btrfs storage_dir"])
def storage(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Workspace.create() keywords for each place layers can live."""
    if request.param == "store":
        if not store.mounted():
            pytest.skip("no btrfs layer store on this host (bunshin storage setup)")
        yield {}
    elif request.param == "fallback":
        request.getfixturevalue("no_store")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StorageWarning)
            yield {}
    else:
        yield {"storage_dir": request.getfixturevalue("btrfs_dir")}


def test_whiteouts_opaque_dirs_and_renames_at_every_depth(storage: dict[str, Any]) -> None:
    """A fork of a fork of a fork (and one more): each level deletes, replaces and writes what
    its ancestors' frozen layers hold, and every clone shows exactly its own history."""
    with Workspace.create(**storage) as src:
        run_ok(src, SETUP)
        want = expected_after_setup()
        _compare(src, want)
        listing = {k: v for k, v in view(src).items() if k.endswith("/")}
        chain: list[Workspace] = []
        parent = src
        try:
            for depth, (script, changes) in enumerate(LEVELS, 1):
                a, b = forked(parent.fork(2, memory="copy"))
                chain += [a, b]
                assert len(a._rec.fs.lowers) == depth, "a clone stacks one frozen layer per ancestor"
                _compare(a, want)
                _compare(b, want)
                if depth == 1:
                    assert {k: v for k, v in view(a).items() if k.endswith("/")} == listing
                run_ok(a, script)
                mine = {**want, **changes}
                _compare(a, mine)
                _compare(b, want)  # a sibling sees none of it ...
                _compare(parent, want)  # ... nor does the parent
                want, parent = mine, a
            _compare(src, expected_after_setup())
        finally:
            for c in chain:
                c.destroy()


def test_stack_flattens_past_its_limit(storage: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_STACK frozen layers a snapshot folds its stack into one layer after the source
    resumed: clones of it stack one layer again and see the same files."""
    monkeypatch.setattr(frozen, "MAX_STACK", 2)
    with Workspace.create(**storage) as src:
        run_ok(src, SETUP)
        want = expected_after_setup()
        parent, chain = src, []
        try:
            for script, changes in LEVELS:
                (c,) = forked(parent.fork(1, memory="copy"))
                chain.append(c)
                assert 1 <= len(c._rec.fs.lowers) <= 2
                _compare(c, want)
                run_ok(c, script)
                want = {**want, **changes}
                parent = c
            depths = [len(c._rec.fs.lowers) for c in chain]
            assert depths == [1, 2, 1, 2], depths
            flat = chain[2]._rec.fs.lowers[0]
            assert not Path(flat.path + ".flat").exists()
            if flat.kind == "btrfs":
                assert btrfsutil.get_subvolume_read_only(flat.path)
            (last,) = forked(parent.fork(1, memory="copy"))
            chain.append(last)
            _compare(last, want)
        finally:
            for c in chain:
                c.destroy()


def _upper_bytes(ws: Workspace) -> int:
    return state.tree_bytes(ws._rec.fs.layer.upper)


def test_clones_copy_nothing_on_the_store(btrfs_dir: str) -> None:
    """On btrfs the snapshot is a read-only subvolume snapshot and every clone's upper starts
    with nothing but its identity files, whatever the source wrote."""
    with Workspace.create(storage_dir=btrfs_dir) as src:
        run_ok(src, "head -c 32M /dev/urandom > /root/data; sync")
        with warnings.catch_warnings():
            warnings.simplefilter("error", StorageWarning)
            snap = src.snapshot("copy")
        try:
            lay = snap._snap.meta.fs.layer
            assert lay.kind == "btrfs" and btrfsutil.get_subvolume_read_only(lay.path)
            with fork_of(snap, 4) as clones:
                for c in clones:
                    assert c._rec.fs.lowers[0] == lay
                    assert _upper_bytes(c) < 4096, "a clone's upper holds more than its identity"
                    assert run_ok(c, "stat -c %s /root/data").stdout.strip() == str(32 << 20)
        finally:
            snap.release()


def test_without_cow_a_snapshot_copies_once(no_store: None) -> None:
    """Where storage cannot copy-on-write, a snapshot copies the layer once and says so; its
    clones stack that copy and copy nothing."""
    with Workspace.create() as src:
        run_ok(src, "head -c 4M /dev/urandom > /root/data")
        with pytest.warns(StorageWarning, match="copied") as warned:
            snap = src.snapshot("copy")
        assert len(warned) == 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", StorageWarning)
                with fork_of(snap, 3) as clones:
                    for c in clones:
                        assert _upper_bytes(c) < 4096
                        assert c._rec.fs.lowers[0] == snap._snap.meta.fs.layer
        finally:
            snap.release()


def test_siblings_share_one_page_cache(btrfs_dir: str) -> None:
    """Clones read a file written before the fork through the same inode of the frozen layer: the
    first reader is charged its pages, the others nothing."""
    mib = 48
    with Workspace.create(storage_dir=btrfs_dir) as src:
        run_ok(src, f"head -c {mib}M /dev/urandom > /root/data")
        with fork_of(src, 2) as (a, b):
            frozen_file = Path(a._rec.fs.lowers[0].upper, "root/data")
            # The overlay reports the inode of the layer a file comes from.
            ino = {int(run_ok(c, "stat -c %i /root/data").stdout) for c in (a, b)}
            assert ino == {frozen_file.stat().st_ino}
            Path("/proc/sys/vm/drop_caches").write_text("1")
            charged = []
            for c in (a, b):
                before = accounting.of_cgroup(c._rec.cgroups).page_cache
                run_ok(c, "cat /root/data > /dev/null")
                charged.append(accounting.of_cgroup(c._rec.cgroups).page_cache - before)
            assert charged[0] >= (mib - 4) << 20, charged
            assert charged[1] < 2 << 20, f"the second clone paid for its own copy: {charged}"


WATCHER = r'''
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
wds = {}
for p, m in (("/root/watched.txt", 0x2 | 0x8), ("/root/wdir", 0x100), ("/etc/passwd", 0x2)):
    wds[libc.inotify_add_watch(fd, p.encode(), m)] = p
assert all(w > 0 for w in wds), wds
open("/tmp/watch-ready", "w").close()
while True:
    buf = os.read(fd, 4096)
    off = 0
    while off < len(buf):
        wd, mask, cookie, ln = struct.unpack_from("iIII", buf, off)
        off += 16 + ln
        with open("/tmp/events", "a") as f:
            f.write(wds[wd] + "\n")
'''
POKE = "echo x >> /root/watched.txt; touch /root/wdir/new-$RANDOM; echo '#' >> /etc/passwd"


def _fired(ws: Workspace) -> set[str]:
    run_ok(ws, "rm -f /tmp/events; " + POKE)
    want = {"/root/watched.txt", "/root/wdir", "/etc/passwd"}

    def seen() -> set[str] | None:
        got = set(str(ws.files.read("/tmp/events")).split()) if ws.files.exists("/tmp/events") else set()
        return got if got >= want else None

    return wait_for(seen, timeout=10)


def test_inotify_watches_survive_a_fork() -> None:
    """A watch on a file of the workspace's own layer, on a directory and on a file of a lower
    layer dumps and restores: it fires in the clone, in a fork of that clone, and still in
    the source. (Editors and file watchers need no configuration.)"""
    with Workspace.create() as src:
        run_ok(src, "echo hello > /root/watched.txt; mkdir /root/wdir")
        src.files.write("/root/watcher.py", WATCHER)
        src.commands.run("exec python3 /root/watcher.py", background=True)
        wait_for(lambda: src.files.exists("/tmp/watch-ready"))
        with fork_of(src) as (c,):
            assert _fired(c)
            with fork_of(c) as (g,):
                assert _fired(g)
            assert _fired(src)


def test_deleted_lower_file_held_open_forks() -> None:
    """A process keeps a file from a frozen lower open and mapped after it is deleted (as editors,
    pip and sqlite do): the fork carries it (CRIU ghost file) and its contents survive."""
    holder = textwrap.dedent('''
        import hashlib, mmap, os, signal, time
        f = open("/root/big.bin", "rb")
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        def report(*_):
            open("/tmp/sum", "w").write(hashlib.sha256(m[:]).hexdigest() + " " + hashlib.sha256(f.read()).hexdigest())
            f.seek(0)
        signal.signal(signal.SIGUSR1, report)
        open("/tmp/holder-ready", "w").close()
        while True:
            time.sleep(1)
    ''')
    with Workspace.create() as src:
        run_ok(src, "head -c 1M /dev/urandom > /root/big.bin")
        digest = run_ok(src, "sha256sum /root/big.bin").stdout.split()[0]
        with fork_of(src) as (c,):  # /root/big.bin now comes from c's frozen lower
            c.files.write("/root/holder.py", holder)
            c.commands.run("exec python3 /root/holder.py", background=True)
            wait_for(lambda: c.files.exists("/tmp/holder-ready"))
            run_ok(c, "rm /root/big.bin")
            with fork_of(c) as (g,):
                assert not g.files.exists("/root/big.bin")
                run_ok(g, "rm -f /tmp/sum; pkill -USR1 -f holder.py")
                sums = wait_for(lambda: g.files.exists("/tmp/sum") and str(g.files.read("/tmp/sum")).split())
                assert sums == [digest, digest]


def test_frozen_layer_lives_while_clones_stack_it() -> None:
    """A released snapshot's frozen layer stays while a clone stacks it, and goes with the last."""
    with Workspace.create() as src:
        run_ok(src, "echo v > /root/v")
        snap = src.snapshot("copy")
        path = snap._snap.meta.fs.layer.path
        a, b = forked(snap.fork(2))
        snap.release()
        assert os.path.isdir(path)
        Path("/proc/sys/vm/drop_caches").write_text("2")  # fresh lookups through the lower
        assert str(a.files.read("/root/v")) == "v\n"
        a.destroy()
        assert os.path.isdir(path) and str(b.files.read("/root/v")) == "v\n"
        b.destroy()
        assert not os.path.exists(path)


def test_frozen_layer_goes_when_its_snapshot_and_clones_go_together() -> None:
    """A snapshot released while its clones are destroyed in other threads (as a rollout does):
    neither keeps the frozen layer for the other, so it goes."""
    with Workspace.create() as src:
        run_ok(src, "echo v > /root/v")
        for _ in range(3):
            snap = src.snapshot("copy")
            path = snap._snap.meta.fs.layer.path
            clones = forked(snap.fork(2))
            with ThreadPoolExecutor(3) as pool:
                for f in [pool.submit(snap.release), *(pool.submit(c.destroy) for c in clones)]:
                    f.result()
            assert not os.path.exists(path)


def test_a_released_clone_whose_directory_goes_mid_check_keeps_no_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind the test above, made certain: a clone whose release is done (marked) has
    its state directory removed just as the last user's release reads its record. That record
    must not count as a user (read the marker after the record and it does, and the frozen layer
    outlives everyone)."""
    with Workspace.create() as src:
        snap = src.snapshot("copy")
        path = snap._snap.meta.fs.layer.path
        a, b = forked(snap.fork(2))
        snap.release()
        assert os.path.exists(path)  # its clones stack it
        remove_dir = state.remove_dir
        with monkeypatch.context() as m:
            m.setattr(state, "remove_dir", lambda d: None)  # a's release stops short of it
            a.destroy()
        assert (state.RUN_ROOT / a.id / state.RELEASED).exists()
        load = state.Record.load

        def load_then_remove(ws_id: str) -> state.Record:
            rec = load(ws_id)
            if ws_id == a.id:
                remove_dir(rec.dir)
            return rec

        monkeypatch.setattr(state.Record, "load", staticmethod(load_then_remove))
        try:
            b.destroy()
        finally:
            remove_dir(state.RUN_ROOT / a.id)  # where b's release never read a's record
        assert not os.path.exists(path)


CRASHER = """
import os, sys
from bunshinfork import Workspace
ws = Workspace.create()
ws.commands.run("echo crash > /root/f")
snap = ws.snapshot("copy")
(c,) = snap.fork(1)
print(ws.id, c.id, snap._snap.meta.fs.layer.path, c._rec.fs.layer.path, flush=True)
os._exit(0)
"""


def test_gc_removes_what_a_crashed_process_left() -> None:
    """A process that died holding a workspace, a snapshot and a clone leaves their layers and the
    frozen layer; once the inits are gone too, gc removes every one of them."""
    out = subprocess.run([sys.executable, "-c", CRASHER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ws_id, clone_id, frozen_path, clone_layer = out.stdout.split()
    for wid in (ws_id, clone_id):
        rec = state.Record.load(wid)
        assert rec.process is not None
        os.kill(rec.process.pid, signal.SIGKILL)
        wait_for(lambda r=rec: not r.init_alive(), timeout=10)
    assert os.path.exists(frozen_path) and os.path.exists(clone_layer)
    removed = gc()
    assert {ws_id, clone_id} <= set(removed["workspaces"]), removed
    assert not os.path.exists(frozen_path) and not os.path.exists(clone_layer)
