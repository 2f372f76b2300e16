"""The bunshin kernel module, exercised for real. These run in the guest kernel
(`make test-guest` boots Debian's 6.1 or 6.12 under qemu and loads bunshin.ko built for it); on a host
without /dev/bunshin they are skipped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bunshinfork.memory import cow, holders

pytestmark = [
    pytest.mark.cow,
    pytest.mark.skipif(not cow.available(), reason="needs /dev/bunshin (run `make test-guest`)"),
]
PROG = str(Path(__file__).parent / "progs" / "cowproc.py")
SIZE = 64 << 20


class Proc:
    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen([sys.executable, PROG, *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        first = self.p.stdout.readline().split()
        if first == ["collision"]:
            raise FileExistsError("target address range is taken")
        self.addr, self.size = int(first[0]), int(first[1])

    @property
    def pid(self) -> int:
        return self.p.pid

    def ask(self, line: str) -> str:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def wait_stopped(pid: int) -> None:
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        pass


def snapshot_of(src: Proc) -> holders.Holder:
    tids = holders.seize_all([src.pid])
    holders.wait_all(tids)
    try:
        (h,) = holders.take([src.pid])
    finally:
        holders.detach_all(tids)
    assert h.fd is not None and h.child == 0, "the module turns the holder into a descriptor"
    return h


def clone_into_target(h: holders.Holder, src: Proc) -> Proc:
    t = Proc("target", str(src.addr), str(src.addr + src.size))
    wait_stopped(t.pid)
    vmas, _ = cow.share(h.fd, t.pid, src.addr, src.addr + src.size)
    assert vmas == 1
    os.kill(t.pid, 18)  # SIGCONT
    return t


def kpagecount(pfn: int) -> int:
    with open("/proc/kpagecount", "rb") as f:
        f.seek(pfn * 8)
        return int.from_bytes(f.read(8), "little")


@pytest.fixture
def source():
    s = Proc("source", str(SIZE))
    yield s
    s.close()


def test_share_maps_the_same_frames(source):
    want = source.ask("hash")
    h = snapshot_of(source)
    t = clone_into_target(h, source)
    try:
        assert t.ask("hash") == want
        src_pfns = [int(x) for x in source.ask("pfns").split()]
        dst_pfns = [int(x) for x in t.ask("pfns").split()]
        assert src_pfns == dst_pfns and all(p > 0 for p in src_pfns)
        # source, snapshot and clone: three mappings of one frame, no new anonymous pages.
        assert all(kpagecount(p) >= 3 for p in src_pfns[:64])
    finally:
        t.close()
        h.release()


def test_writes_are_isolated_in_every_direction(source):
    h = snapshot_of(source)
    t1, t2 = clone_into_target(h, source), clone_into_target(h, source)
    try:
        base = t1.ask("read 0 8")
        assert t1.ask("write 0 clone-one") == "ok"
        assert t2.ask("read 0 8") == base and source.ask("read 0 8") == base
        assert source.ask("write 4096 src-later") == "ok"  # the source writes after the snapshot
        assert t1.ask("read 4096 9") == t2.ask("read 4096 9") != source.ask("read 4096 9")
        assert os.pread(h.fd, 8, source.addr) == bytes.fromhex(base)
        pages, private = h.stats()
        assert pages >= SIZE // 4096 and private >= 1
    finally:
        t1.close()
        t2.close()
        h.release()


def test_data_survives_compaction(source):
    want = source.ask("hash")
    h = snapshot_of(source)
    clones = [clone_into_target(h, source) for _ in range(2)]
    try:
        for _ in range(3):
            Path("/proc/sys/vm/compact_memory").write_text("1")
        assert all(c.ask("hash") == want for c in clones)
        assert source.ask("hash") == want
    finally:
        for c in clones:
            c.close()
        h.release()


def test_sixteen_clones_from_one_snapshot(source):
    want = source.ask("hash")
    h = snapshot_of(source)
    clones = []
    try:
        for _ in range(16):
            clones.append(clone_into_target(h, source))
        assert {c.ask("hash") for c in clones} == {want}
    finally:
        for c in clones:
            c.close()
        h.release()


def test_refusals_have_clear_errnos(source):
    h = snapshot_of(source)
    try:
        running = Proc("source", str(4096))
        try:  # a running target could fault pages in while they are mapped
            with pytest.raises(OSError) as e:
                cow.share(h.fd, running.pid, source.addr, source.addr + source.size)
            assert e.value.errno == 16  # EBUSY
        finally:
            running.close()
        t = clone_into_target(h, source)
        try:  # a target whose VMA already has pages is not pristine
            os.kill(t.pid, 19)
            wait_stopped(t.pid)
            with pytest.raises(OSError) as e:
                cow.share(h.fd, t.pid, source.addr, source.addr + source.size)
            assert e.value.errno == 16
            os.kill(t.pid, 18)
        finally:
            t.close()
    finally:
        h.release()


def kernel_bugs() -> list[str]:
    log = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
    return re.findall(r".*\b(?:BUG|WARNING):.*", log)


def test_huge_pages_shared_over_leftover_page_tables(source):
    """A target range that already holds (empty) page tables, as a restored clone's can: the
    source's transparent huge pages must not be mapped over them (that leaked one table per
    huge page: "BUG: non-zero pgtables_bytes on freeing mm" once the clone exited)."""
    smaps = Path(f"/proc/{source.pid}/smaps_rollup").read_text()
    huge = int(re.search(r"AnonHugePages:\s+(\d+) kB", smaps).group(1))
    assert huge > 0, "the source has no transparent huge pages: this test needs THP (always)"
    want = source.ask("hash")
    bugs = kernel_bugs()
    h = snapshot_of(source)
    try:
        t = Proc("target", str(source.addr), str(source.addr + source.size), "used")
        try:
            wait_stopped(t.pid)
            vmas, _ = cow.share(h.fd, t.pid, source.addr, source.addr + source.size, reset=True)
            assert vmas == 1
            os.kill(t.pid, 18)
            assert t.ask("hash") == want
        finally:
            t.close()
    finally:
        h.release()
    assert kernel_bugs() == bugs


@pytest.mark.parametrize("advice", ["wipeonfork", "dontfork"])
def test_fork_advice_is_honoured(advice: str) -> None:
    """A snapshot is what fork() would give: a MADV_WIPEONFORK range starts empty in a clone and
    a MADV_DONTFORK range is not in the snapshot at all; neither is shared."""
    src = Proc("source", str(SIZE), advice)
    try:
        h = snapshot_of(src)
        try:
            t = Proc("target", str(src.addr), str(src.addr + src.size))
            try:
                wait_stopped(t.pid)
                vmas, skipped = cow.share(h.fd, t.pid, src.addr, src.addr + src.size)
                assert vmas == 0 and skipped == (1 if advice == "wipeonfork" else 0)
                os.kill(t.pid, 18)
                assert t.ask("read 0 16") == "00" * 16
                assert t.ask(f"read {SIZE - 16} 16") == "00" * 16
            finally:
                t.close()
        finally:
            h.release()
        assert src.ask("read 0 16") != "00" * 16, "the source kept its pattern"
    finally:
        src.close()


FILE_SIZE = 4 << 20


@pytest.fixture
def file_source(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(FILE_SIZE))
    s = Proc("source", str(FILE_SIZE), f"file={path}")
    yield s, path
    s.close()


def share_file_into(h: holders.Holder, src: Proc, spec: str, files: bool) -> tuple[Proc, int, int]:
    t = Proc("target", str(src.addr), str(src.addr + src.size), f"file={spec}")
    wait_stopped(t.pid)
    vmas, skipped = cow.share(h.fd, t.pid, src.addr, src.addr + src.size, reset=True, files=files)
    os.kill(t.pid, 18)
    return t, vmas, skipped


def test_private_file_pages_shared_where_the_target_maps_the_same_inode(file_source):
    """A library's written pages (relocations, .data) are anonymous pages in a private file
    mapping: a clone that maps the same file takes them copy-on-write too, not as copies."""
    source, path = file_source
    want = source.ask("hash")
    half = FILE_SIZE // 4096 // 2
    h = snapshot_of(source)
    try:
        t, vmas, _ = share_file_into(h, source, str(path), files=True)
        try:
            assert vmas == 1
            # The marker the target wrote was discarded: it now has the source's pages.
            assert t.ask("hash") == want
            src_pfns = [int(x) for x in source.ask("pfns").split()]
            assert [int(x) for x in t.ask("pfns").split()] == src_pfns
            # The written half: source, snapshot and clone map one anonymous frame.
            assert all(kpagecount(p) >= 3 for p in src_pfns[:half])
            assert t.ask("write 0 clone") == "ok" and t.ask("read 0 5") != source.ask("read 0 5")
            assert source.ask(f"write {FILE_SIZE - 4096} src-later") == "ok"
            assert t.ask(f"read {FILE_SIZE - 4096} 9") != source.ask(f"read {FILE_SIZE - 4096} 9")
            # A page-cache page written in the clone becomes its own copy: the file and the
            # source still have the file's bytes.
            off = half << 12
            assert t.ask(f"write {off} clone") == "ok"
            assert source.ask(f"read {off} 5") == path.read_bytes()[off:off + 5].hex() != b"clone".hex()
        finally:
            t.close()
    finally:
        h.release()


@pytest.mark.parametrize("other", ["copy", "offset", "flag off"])
def test_private_file_pages_never_shared_into_another_mapping(file_source, other):
    """Another inode (an upper-layer copy of the file), another offset, or no BUNSHIN_SHARE_FILES:
    the target's VMA is skipped and keeps its own content, even with a reset."""
    source, path = file_source
    spec = str(path)
    if other == "copy":
        spec = str(path.with_name("copy"))
        Path(spec).write_bytes(path.read_bytes())
    elif other == "offset":
        spec = f"{path}@1"
    h = snapshot_of(source)
    try:
        t, vmas, skipped = share_file_into(h, source, spec, files=other != "flag off")
        try:
            assert (vmas, skipped) == (0, 1)
            assert bytes.fromhex(t.ask("read 0 12")) == b"target's own"
            assert t.ask("read 4096 16") != source.ask("read 4096 16")
        finally:
            t.close()
    finally:
        h.release()


def test_no_bug_or_warn_in_dmesg():
    log = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
    assert not re.search(r"\b(BUG|WARNING):", log), log[-3000:]
