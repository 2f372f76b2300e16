"""Forks with memory="cow" (the bunshin module): run in the guest kernel by `make test-guest`."""

from __future__ import annotations

from pathlib import Path

import pytest
from fork_support import host_pid

from bunshinfork import Snapshot, Workspace
from bunshinfork import memory as engines
from bunshinfork.errors import KernelFeatureError
from bunshinfork.memory import cow, ksm

pytestmark = [
    pytest.mark.cow,
    pytest.mark.skipif(not cow.available(), reason="needs /dev/bunshin (run `make test-guest`)"),
]
WORKER = """
import hashlib, os


def publish(path, text):
    # Written aside and renamed, so a reader never sees a half-written file.
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


b = bytearray(hashlib.shake_256(b"x").digest(32 << 20))
publish("/root/ready", hashlib.sha256(b).hexdigest())
while True:
    # Reopened per request: the fifo has a new writer for every command.
    for line in open("/root/cmd"):
        if line.strip() == "write":
            b[0:4] = b"mine"
        elif line.strip() == "scribble":
            # One byte in every page: the whole pattern stops being shared with a snapshot.
            for i in range(0, len(b), 4096):
                b[i] ^= 0xFF
        publish("/root/hash", hashlib.sha256(b).hexdigest())
"""


def ask(ws: Workspace, request: str) -> str:
    if ws.files.exists("/root/hash"):
        ws.files.remove("/root/hash")
    ws.commands.run(f"echo {request} > /root/cmd", timeout=60)
    return wait_for(ws, "/root/hash")


def wait_for(ws: Workspace, path: str) -> str:
    while not ws.files.exists(path):
        pass
    text = str(ws.files.read(path))
    assert len(text) == 64, text
    return text


def test_cow_clones_share_memory_and_stay_isolated(tmp_path: Path) -> None:
    with Workspace.create() as ws:
        ws.commands.run("mkfifo /root/cmd")
        ws.files.write("/root/worker.py", WORKER)
        ws.commands.run("python3 /root/worker.py", background=True)
        want = wait_for(ws, "/root/ready")
        ws.files.write("/root/file", "source")
        snap = ws.snapshot(memory="cow")
        clones: list[Workspace | Exception] = []
        try:
            assert snap.kind == "cow"
            # No anonymous pages were written to the image: the holders keep them.
            assert snap.image_bytes() < 8 << 20
            clones = snap.fork(2)
            saved = snap.save(tmp_path / "saved").result(timeout=300)
        except BaseException:
            for c in clones:
                if isinstance(c, Workspace):
                    c.destroy()
            raise
        finally:
            snap.release()
        try:
            assert all(isinstance(c, Workspace) for c in clones), clones
            a, b = clones
            for c in clones:
                m = c.memory()
                # The 32 MiB pattern is mapped, not copied: almost nothing is private to a clone.
                assert m.rss > 32 << 20 and m.uss < 16 << 20, m
                assert c.files.read("/root/file") == "source"
                assert ask(c, "hash") == want
            # A clone's write is private to it: its sibling and the source still see the pattern.
            assert ask(a, "write") != want
            assert ask(b, "hash") == want
            assert ask(ws, "hash") == want
            a.files.write("/root/file", "clone a")
            assert ws.files.read("/root/file") == "source" and b.files.read("/root/file") == "source"
            # The durable save read the holders' memory into complete images: a copy fork of it
            # has the pattern as it was at the snapshot.
            loaded = Snapshot.load(saved)
            try:
                (c,) = loaded.fork(1, memory="copy")
                try:
                    assert isinstance(c, Workspace), c
                    assert ask(c, "hash") == want
                finally:
                    if isinstance(c, Workspace):
                        c.destroy()
            finally:
                loaded.release()  # its layer, imported into the storage, goes with it
        finally:
            for c in clones:
                if isinstance(c, Workspace):
                    c.destroy()


def file_backed_dirty_kib(pid: int) -> tuple[int, int]:
    """(private, shared) dirty KiB in a process's file mappings: a library's written pages
    (relocations, .data). Shared means another process maps the same frame."""
    private = shared = 0
    file_backed = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: dev, inode, path
            file_backed = fields[4] != "0"
        elif file_backed and fields[0] == "Private_Dirty:":
            private += int(fields[1])
        elif file_backed and fields[0] == "Shared_Dirty:":
            shared += int(fields[1])
    return private, shared


def test_clones_share_the_written_pages_of_libraries() -> None:
    """The private pages of file mappings (a library's relocations and data) are dumped by CRIU
    and restored as copies; where the clone maps the same lower-layer file, the module replaces
    those copies with the snapshot's pages, so each clone does not pay for them again."""
    with Workspace.create() as ws:
        ws.commands.run("mkfifo /root/cmd")
        ws.files.write("/root/worker.py", WORKER)
        ws.commands.run("python3 /root/worker.py", background=True)
        want = wait_for(ws, "/root/ready")
        src_private, src_shared = file_backed_dirty_kib(host_pid(ws, "python3"))
        source_dirty = src_private + src_shared
        assert source_dirty > 256, (src_private, src_shared)
        with ws.snapshot(memory="cow") as snap:
            (c,) = snap.fork(1)
        assert isinstance(c, Workspace), c
        try:
            private, shared = file_backed_dirty_kib(host_pid(c, "python3"))
            # A copy per clone would be Private_Dirty: about all of the source's.
            assert private < source_dirty // 4 and shared >= source_dirty // 2, (private, shared, source_dirty)
            assert ask(c, "write") != want and ask(ws, "hash") == want
        finally:
            c.destroy()


def test_retained_snapshot_costs_what_the_source_writes() -> None:
    """The prefix cache's bound: a retained cow snapshot costs the pages written after it."""
    with Workspace.create() as ws:
        ws.commands.run("mkfifo /root/cmd")
        ws.files.write("/root/worker.py", WORKER)
        ws.commands.run("python3 /root/worker.py", background=True)
        want = wait_for(ws, "/root/ready")
        with ws.snapshot(memory="cow") as snap:
            fresh = snap.retained_bytes()
            # Shared with the running source, the 32 MiB pattern costs the snapshot nothing yet.
            assert fresh < snap.image_bytes() + (8 << 20), (fresh, snap.image_bytes())
            assert ask(ws, "scribble") != want
            grown = snap.retained_bytes()
            assert grown - fresh >= 31 << 20, (fresh, grown)
            # ... and what it retains is the pattern as it was.
            (c,) = snap.fork(1)
            assert isinstance(c, Workspace), c
            try:
                assert ask(c, "hash") == want
            finally:
                c.destroy()


def test_engines_on_a_kernel_without_process_wide_ksm() -> None:
    """Debian 12's 6.1 has no PR_SET_MEMORY_MERGE: "ksm" is a clear error before anything is
    frozen, and "auto" never picks it (a dead CRIU helper is all it used to get)."""
    if ksm.merge_supported():
        pytest.skip("this kernel lets processes opt into KSM as a whole")
    assert engines.resolve("auto") == "cow"
    with Workspace.create() as ws:
        ws.commands.run("exec sleep 1000", background=True)
        with pytest.raises(KernelFeatureError, match="PR_GET_MEMORY_MERGE"):
            ws.fork(1, memory="ksm")
        (c,) = ws.fork(1, memory="copy")
        assert isinstance(c, Workspace), c
        c.destroy()
        assert ws.commands.run("echo alive").stdout == "alive\n"
