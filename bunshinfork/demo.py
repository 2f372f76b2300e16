"""`make demo`: a real workspace on the built-in host root file system, forked 8 ways, and what
the host pays for it and its clones (`ws.memory().host`: anonymous memory, tmpfs and shared
memory, page cache and kernel memory charged to each workspace's cgroup), PSS beside it."""

from __future__ import annotations

import time

from . import Workspace
from .memory import ksm


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> int:
    t0 = time.monotonic()
    with Workspace.create(hostname="demo") as ws:
        print(f"created {ws.id} in {time.monotonic() - t0:.3f}s")
        for cmd in ("uname -sr", "hostname", "python3 -c 'import sys; print(sys.version.split()[0])'",
                    "ls / | tr '\\n' ' '"):
            r = ws.commands.run(cmd)
            print(f"$ {cmd}\n{r.stdout.rstrip()}")
        ws.files.write("/root/notes.txt", "written before the fork\n")
        # State that must survive the fork: a 64 MiB heap and a counter process.
        ws.commands.run(
            "python3 -c 'import time, random; x = random.Random(1).randbytes(64 << 20); time.sleep(1e9)'",
            background=True,
        )
        ws.commands.run("(i=0; while :; do i=$((i+1)); echo $i > /root/counter; sleep 0.1; done) "
                        ">/dev/null 2>&1", background=True)
        time.sleep(1.0)
        info = ws.info()
        print(f"info: state={info.state} rootfs={info.rootfs} ({info.rootfs_digest}) cgroup={info.cgroup_version}")
        m = ws.memory()
        source_host = m.host.total
        print(f"memory: the host pays {mib(source_host)} MiB (anon {mib(m.host.anon)}, tmpfs/shmem "
              f"{mib(m.host.shmem)}, page cache {mib(m.host.page_cache)}, kernel {mib(m.host.kernel)}); "
              f"pss={mib(m.pss)} MiB over {m.processes} processes")

        t1 = time.monotonic()
        snap = ws.snapshot()
        clones = snap.fork(8, memory="auto")
        elapsed = time.monotonic() - t1
        print(f"\nforked 8 clones in {elapsed:.2f}s (source frozen {snap.timing.frozen_seconds:.2f}s)")
        snap.release()
        ok = [c for c in clones if isinstance(c, Workspace)]
        for c in clones:
            if not isinstance(c, Workspace):
                print(f"  a clone failed: {c}")
        try:
            for i, c in enumerate(ok):
                c.files.write("/root/notes.txt", f"clone {i} was here\n")
            if ksm.available():
                print("waiting for KSM to merge the clones' identical pages ...")
                p = ksm.tuner.wait_settled(timeout=60)
                print(f"KSM: pages_sharing={p.pages_sharing} (saves {p.saved_bytes / 2**20:.0f} MiB), "
                      f"full_scans={p.full_scans}")
            print(f"\n{'workspace':<18}{'host MiB':>10}{'pss MiB':>10}{'rss MiB':>10}  counter  notes")
            total_host = total_pss = 0
            for w in [ws, *ok]:
                mm = w.memory()
                total_host += mm.host.total
                total_pss += mm.pss
                counter = w.files.read("/root/counter").strip()
                notes = w.files.read("/root/notes.txt").strip()
                print(f"{w.id:<18}{mib(mm.host.total):>10}{mib(mm.pss):>10}{mib(mm.rss):>10}  {counter:>7}  {notes}")
            print(f"{'total':<18}{mib(total_host):>10}{mib(total_pss):>10}")
            print(f"the host pays {total_host / max(source_host, 1):.2f}x the source's memory for the source and "
                  f"{len(ok)} clones (each clone's counter keeps counting on its own)")
            if ksm.available():
                print("(KSM keeps one copy of each merged page, charged to one workspace of the family: the "
                      "family's total is what the host pays)")
        finally:
            for c in ok:
                c.destroy()
    print(f"\ndestroyed everything; demo took {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
