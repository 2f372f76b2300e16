"""The cow dump path on this host (no module needed): CRIU with the bunshin patch writes no
anonymous private pages, holders keep them, and materialize puts them back so that a saved
cow snapshot holds exactly the pages a plain dump would."""

from __future__ import annotations

from pathlib import Path

import pycriu.images as criu_images

from bunshinfork import Workspace, process
from bunshinfork.memory import cow, holders, materialize
from bunshinfork.process import criu

PATTERN = (
    "python3 -c \"import hashlib, time; b = bytearray(hashlib.shake_256(b'x').digest(16 << 20)); "
    "open('/tmp/ready', 'w').close(); time.sleep(1e6)\""
)


def anon_pages(images: Path) -> dict[tuple[int, int], bytes]:
    """(pid, vaddr) -> page for every non-zero page of an anonymous private VMA."""
    out = {}
    for mm_path in images.glob("mm-*.img"):
        pid = int(mm_path.stem.split("-")[1])
        with open(mm_path, "rb") as f:
            vmas = criu_images.load(f)["entries"][0]["vmas"]
        anon = [(v["start"], v["end"]) for v in vmas if v["status"] & materialize.VMA_ANON_PRIVATE
                and not v["status"] & materialize.SPECIAL and v["end"] <= materialize.TASK_SIZE]
        with open(images / f"pagemap-{pid}.img", "rb") as f:
            head, *entries = criu_images.load(f)["entries"]
        with open(images / f"pages-{head['pages_id']}.img", "rb") as f:
            for e in entries:
                if not e["flags"] & materialize.PE_PRESENT:
                    continue
                for i in range(e["nr_pages"]):
                    page = f.read(4096)
                    va = e["vaddr"] + i * 4096
                    if any(s <= va < end for s, end in anon) and page != bytes(4096):
                        out[(pid, va)] = page
    return out


def test_cow_dump_plus_holders_equals_a_plain_dump(tmp_path: Path) -> None:
    with Workspace.create() as ws:
        ws.commands.run(PATTERN, background=True)
        while not ws.files.exists("/tmp/ready"):
            pass
        cg = ws._cgroup()
        freezer = cg.freezer_dir
        plain, cow_images = tmp_path / "plain", tmp_path / "cow"
        plain.mkdir()
        cow_images.mkdir()
        cg.freeze()
        hs: dict[int, holders.Holder] = {}
        try:
            # Both dumps and the holders see one frozen instant: CRIU keeps a frozen cgroup frozen.
            criu.request("dump", process.dump_opts(ws.init_pid, plain, freezer), log=plain / "dump.log")
            criu.request("dump", process.dump_opts(ws.init_pid, cow_images, freezer), log=cow_images / "dump.log",
                         env=cow.DUMP_ENV)
            hs = holders.capture_tree(cg.pids(), cg.freeze, cg.thaw)
        finally:
            cg.thaw()
        try:
            plain_pages = anon_pages(plain)
            assert len(plain_pages) * 4096 >= 16 << 20
            assert anon_pages(cow_images) == {}, "the patched dump must write no anonymous private pages"
            materialize.complete_images(cow_images, tmp_path / "complete", hs)
            complete = anon_pages(tmp_path / "complete")
            assert complete.keys() == plain_pages.keys()
            differing = {k: [i for i in range(4096) if complete[k][i] != plain_pages[k][i]]
                         for k in plain_pages if complete[k] != plain_pages[k]}
            # The only writes between the dump and the holders are the kernel's rseq cpu_id
            # updates (8 bytes in each thread's TLS) when the tasks pass through user mode to
            # take the injected fork; restore re-registers rseq and the kernel rewrites them.
            assert len(differing) <= len({pid for pid, _ in plain_pages})
            assert all(v[-1] - v[0] < 8 for v in differing.values()), differing
        finally:
            parents = [h.parent for h in hs.values()]
            tids = holders.seize_all(parents)
            holders.wait_all(tids)
            try:
                for h in hs.values():
                    h.release()
            finally:
                holders.detach_all(tids)
        assert ws.commands.run("echo alive").stdout == "alive\n"
