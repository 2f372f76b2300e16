"""The file system of a fork: latency, freeze and host memory against the bytes a workspace wrote.

python benchmarks/fork_fs.py --written-mib 0,64,512,2048 --clones 1,4,16 --out DIR [--quick]

For every written size and clone count a fresh source workspace writes that many MiB of files
(4 MiB each, as a checkout, a venv or a database would) just before the fork, without sync, so
that whatever the fork has to flush is counted. It is snapshotted and forked, then each clone
reads every file, one clone after the other. Two layouts run side by side, interleaved over
--reps:

- stacked: today's file system (bunshinfork.fs): the layer store, a frozen btrfs snapshot
  written back before the freeze, stacked under every clone's empty upper;
- copy: the layout before it, reproduced here (CopyPerClone): layers on the state root's
  tmpfs, copied (cp -a) into the snapshot inside the freeze and again into every clone. It
  runs only where its copies fit in memory; the rows say where it stops.

Reported per row: fork latency (snapshot + restores), the source's frozen time, and what the
host pays in memory (bunshinfork.accounting.host(): anon, shmem/tmpfs, page cache, kernel)
for the snapshot, per clone restored, and per clone's reads. Per additional clone is a clone's
restore plus its reads, for the second clone on; "for files" subtracts the same figure with
nothing written. Targets (printed, never asserted): host memory and page cache per additional
clone for files written before the fork at most 1% of the bytes written; fork latency and
frozen time with 2 GiB written within 1.1x of those with nothing written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from bunshinfork import StorageWarning, Workspace, accounting, host_memory, native, pipeline, state
from bunshinfork.contract import Build, Capture, Held, Mount
from bunshinfork.fs import FsPart, identity, layers, rootfs, store
from bunshinfork.state import FsState, Layer

MiB = 1 << 20
FILE_MIB = 4
WRITER = """
import os, sys
total, size = int(sys.argv[1]), int(sys.argv[2])
os.makedirs("/root/data", exist_ok=True)
block = bytearray(os.urandom(1 << 20))
for i in range(total // size):
    with open(f"/root/data/f{i:05d}", "wb") as f:
        for j in range(size):
            block[:16] = f"{i:08d}{j:08d}".encode()  # every MiB distinct
            f.write(block)
"""


# ---- the layout before the stacked one, for comparison ----


class CopyPerClone(FsPart):
    """The file system of a fork before issue 13, as it was: private layers as directories on the
    state root's tmpfs; a snapshot copies the layer inside the freeze; every clone copies it
    again into its own layer, over the rootfs lowers only."""

    root = staticmethod(store.fallback_root)

    def prepare(self, b: Build) -> None:
        rec = b.rec
        root_fs = rootfs.resolve(rec.spec.rootfs)
        lay = self._layer(rec.id)
        rec.fs = FsState(root_fs, lay)
        rec.save()
        identity.seed(Path(lay.upper), rec.hostname, root_fs)
        point = rec.dir / "rootfs"
        point.mkdir()
        b.root = Mount(point, self._options(rec.fs))

    def _layer(self, ws_id: str) -> Layer:
        path = self.root() / ws_id
        path.mkdir(parents=True)
        lay = Layer("dir", str(path))
        os.mkdir(lay.upper, 0o755)
        os.mkdir(lay.work, 0o700)
        return lay

    @staticmethod
    def _options(fs: FsState) -> str:
        assert fs.layer is not None
        return f"lowerdir={':'.join(fs.rootfs.lowerdirs)},upperdir={fs.layer.upper},workdir={fs.layer.work}"

    def before_freeze(self, c: Capture) -> None:
        pass

    def capture(self, c: Capture) -> None:
        src = c.source.fs
        assert src is not None and src.layer is not None
        dest = c.snap.dir / "fs"
        layers.copy_tree(src.layer.path, str(dest))
        c.snap.meta.fs = FsState(src.rootfs, Layer("dir", str(dest)))

    def restore(self, b: Build) -> None:
        assert b.source is not None and b.source.meta.fs is not None
        src = b.source.meta.fs
        assert src.layer is not None
        rec = b.rec
        path = self.root() / rec.id
        layers.copy_tree(src.layer.path, str(path))
        lay = Layer("dir", str(path))
        shutil.rmtree(lay.work)
        os.mkdir(lay.work, 0o700)
        rec.fs = FsState(src.rootfs, lay)
        rec.save()
        identity.write_identity(Path(lay.upper), rec.hostname)
        point = rec.dir / "rootfs"
        point.mkdir()
        opts = self._options(rec.fs)
        native.mount("overlay", str(point), "overlay", 0, opts)
        b.deferred.append(lambda: native.umount2(str(point), native.MNT_DETACH))
        b.root = Mount(point, opts)

    def release(self, held: Held) -> None:
        if isinstance(held, Build):
            native.unmount_below(held.rec.dir)
            if held.rec.fs is not None and held.rec.fs.layer is not None:
                layers.remove_layer(held.rec.fs.layer)
        # A snapshot's copy lives in its directory, which the pipeline removes.


@contextlib.contextmanager
def layout(name: str) -> Iterator[None]:
    if name == "stacked":
        yield
        return
    saved = pipeline.PARTS
    pipeline.PARTS = tuple(CopyPerClone() if p.name == "fs" else p for p in saved)
    try:
        yield
    finally:
        pipeline.PARTS = saved


# ---- one measurement ----


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        if k == key:
            return int(v.split()[0]) * 1024
    raise KeyError(key)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def fits(name: str, written: int, clones: int) -> str | None:
    """Why a configuration is not run, or None."""
    avail = meminfo("MemAvailable")
    if name == "copy":
        # The source's layer, the snapshot's copy and every clone's copy, all on the state root's
        # tmpfs: in RAM, and within that tmpfs's size.
        need = written * MiB * (clones + 2)
        room = min(avail, shutil.disk_usage(state.run_root()).free)
        if need > 0.8 * room:
            return (f"needs {need / 2**30:.1f} GiB of tmpfs, {room / 2**30:.1f} GiB free "
                    f"(RAM available, and {state.run_root()}'s size)")
    elif written * MiB * 2 > 0.8 * avail:  # the source's and the clones' page cache
        return f"needs {2 * written / 1024:.1f} GiB of page cache, {avail / 2**30:.1f} GiB available"
    return None


def measure(name: str, written: int, clones: int) -> dict:
    row: dict = {"layout": name, "written_mib": written, "clones": clones}
    drop_caches()
    with layout(name), Workspace.create() as src:
        row["storage"] = src.info().storage
        src.files.write("/root/writer.py", WRITER)
        t = time.monotonic()
        r = src.commands.run(f"python3 /root/writer.py {written} {FILE_MIB}", timeout=900)
        assert r.exit_code == 0, r.stderr
        row["write_seconds"] = time.monotonic() - t
        h0 = accounting.host()
        t0 = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StorageWarning)
            snap = src.snapshot("copy")
        t1 = time.monotonic()
        h1 = accounting.host()
        try:
            results = snap.fork(clones)
            t2 = time.monotonic()
            h2 = accounting.host()
            ok = [c for c in results if isinstance(c, Workspace)]
            failed = [str(e)[:300] for e in results if not isinstance(e, Workspace)]
            try:
                reads = []
                prev = h2
                for c in ok:
                    rr = c.commands.run("cat /root/data/* > /dev/null 2>&1; echo done", timeout=900)
                    assert rr.exit_code == 0, rr.stderr
                    now = accounting.host()
                    reads.append(now - prev)
                    prev = now
                family = host_memory([src, *ok], [snap])
            finally:
                for c in ok:
                    c.destroy()
        finally:
            snap.release()
    per_restore = (h2 - h1).total / max(len(ok), 1)
    row.update({
        "clones_ok": len(ok), "errors": failed,
        "fork_seconds": t2 - t0, "snapshot_seconds": t1 - t0, "restore_seconds": t2 - t1,
        "frozen_seconds": snap.timing.frozen_seconds,
        "snapshot_host": (h1 - h0).as_dict(), "restore_host_per_clone_bytes": per_restore,
        "restore_host": (h2 - h1).as_dict(),
        "reads_host": [d.as_dict() for d in reads],
        "family_host": family.as_dict(),
    })
    later = reads[1:]
    if later:
        row["per_additional_clone_host_bytes"] = per_restore + statistics.mean(d.total for d in later)
        row["per_additional_clone_page_cache_bytes"] = statistics.mean(d.page_cache for d in later)
    row["per_clone_host_bytes"] = ((h2 - h1).total + sum(d.total for d in reads)) / max(len(ok), 1)
    return row


# ---- summary ----


def _med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else None


def _spread(rows: list[dict], key: str) -> list[float]:
    vals = [r[key] for r in rows if key in r]
    return [min(vals), max(vals)] if vals else []


def summarize(rows: list[dict], written: list[int], clone_counts: list[int]) -> dict:
    ran = [r for r in rows if "skipped" not in r]
    cells: dict = {}
    for name in ("stacked", "copy"):
        for w in written:
            for n in clone_counts:
                mine = [r for r in ran if (r["layout"], r["written_mib"], r["clones"]) == (name, w, n)]
                if not mine:
                    skipped = next((r["skipped"] for r in rows if (r["layout"], r["written_mib"], r["clones"])
                                    == (name, w, n) and "skipped" in r), None)
                    cells[f"{name}/{w}/{n}"] = {"skipped": skipped}
                    continue
                cell = {k: _med(mine, k) for k in (
                    "fork_seconds", "frozen_seconds", "snapshot_seconds", "per_clone_host_bytes",
                    "per_additional_clone_host_bytes", "per_additional_clone_page_cache_bytes")}
                cell["fork_seconds_range"] = _spread(mine, "fork_seconds")
                cell["frozen_seconds_range"] = _spread(mine, "frozen_seconds")
                cell["reps"] = len(mine)
                cells[f"{name}/{w}/{n}"] = cell
    # Per additional clone "for files": minus the same layout and count with nothing written.
    for key, cell in cells.items():
        name, w, n = key.split("/")
        base = cells.get(f"{name}/0/{n}", {})
        if int(w) > 0 and cell.get("per_additional_clone_host_bytes") is not None \
                and base.get("per_additional_clone_host_bytes") is not None:
            cell["per_additional_clone_host_bytes_for_files"] = \
                cell["per_additional_clone_host_bytes"] - base["per_additional_clone_host_bytes"]
            cell["per_additional_clone_page_cache_bytes_for_files"] = \
                cell["per_additional_clone_page_cache_bytes"] - base["per_additional_clone_page_cache_bytes"]
    targets: dict = {}
    for w in (w for w in written if w > 0):
        for n in (n for n in clone_counts if n > 1):
            cell = cells.get(f"stacked/{w}/{n}", {})
            for what in ("host", "page_cache"):
                v = cell.get(f"per_additional_clone_{what}_bytes_for_files")
                targets[f"{what} per additional clone, {w} MiB written, {n} clones <= 1%"] = \
                    None if v is None else {"value_mib": v / MiB, "limit_mib": w * 0.01, "met": v <= w * MiB * 0.01}
    if 0 in written and max(written) >= 2048:
        big = max(written)
        for n in clone_counts:
            zero, full = cells.get(f"stacked/0/{n}", {}), cells.get(f"stacked/{big}/{n}", {})
            for what in ("fork_seconds", "frozen_seconds"):
                if zero.get(what) and full.get(what):
                    ratio = full[what] / zero[what]
                    targets[f"{what} {big} MiB vs 0 written, {n} clones <= 1.1x"] = \
                        {"ratio": ratio, "met": ratio <= 1.1}
    return {"cells": cells, "targets": targets}


def print_targets(targets: dict) -> None:
    for name, t in targets.items():
        if t is None:
            print(f"  n/a     {name}: not measured")
        elif "ratio" in t:
            print(f"  {'met' if t['met'] else 'MISSED':<7} {name}: {t['ratio']:.3f}x")
        else:
            verdict = "met" if t["met"] else "MISSED"
            print(f"  {verdict:<7} {name}: {t['value_mib']:.2f} MiB (limit {t['limit_mib']:.2f})")


def _fmt(cell: dict, key: str, scale: float, unit: str, digits: int) -> str:
    v = cell.get(key)
    if v is None:
        return "-"
    out = f"{v / scale:.{digits}f}"
    lo_hi = cell.get(f"{key}_range")
    if lo_hi and len(lo_hi) == 2 and cell.get("reps", 1) > 1:
        out += f" ({lo_hi[0] / scale:.{digits}f}-{lo_hi[1] / scale:.{digits}f})"
    return out + unit


def print_table(summary: dict, written: list[int], clone_counts: list[int], names: list[str]) -> None:
    """The summary as the README's table: medians over the reps, (min-max) beside them."""
    print("| written | clones | layout | fork s | frozen s | host per clone "
          "| per additional clone: host / page cache |")
    print("|---|---|---|---|---|---|---|")
    for w in written:
        for n in clone_counts:
            for name in names:
                cell = summary["cells"].get(f"{name}/{w}/{n}", {})
                if "skipped" in cell:
                    print(f"| {w} MiB | {n} | {name} | skipped: {cell['skipped'] or 'not run'} | | | |")
                    continue
                extra = "-"
                if cell.get("per_additional_clone_host_bytes") is not None:
                    extra = (f"{cell['per_additional_clone_host_bytes'] / MiB:.1f} / "
                             f"{cell['per_additional_clone_page_cache_bytes'] / MiB:.1f} MiB")
                print(f"| {w} MiB | {n} | {name} | {_fmt(cell, 'fork_seconds', 1, '', 3)} | "
                      f"{_fmt(cell, 'frozen_seconds', 1, '', 3)} | "
                      f"{_fmt(cell, 'per_clone_host_bytes', MiB, ' MiB', 1)} | {extra} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--written-mib", default="0,64,512,2048")
    ap.add_argument("--clones", default="1,4,16")
    ap.add_argument("--layouts", default="stacked,copy")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="CI size: 0 and 256 MiB written, 1 and 2 clones, once")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.quick:
        args.written_mib, args.clones, args.reps = "0,256", "1,2", 1
    written = [int(x) for x in args.written_mib.split(",")]
    clone_counts = [int(x) for x in args.clones.split(",")]
    names = [x for x in args.layouts.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = store.check_store()
    print(f"layer store: {check.level} {check.detail}", flush=True)
    rows = []
    for rep in range(args.reps):
        for w in written:
            for n in clone_counts:
                # Interleaved: each configuration runs both layouts back to back, in turn first.
                for name in names if rep % 2 == 0 else names[::-1]:
                    if why := fits(name, w, n):
                        rows.append({"layout": name, "written_mib": w, "clones": n, "rep": rep, "skipped": why})
                        print(f"[{name:>7} {w:>5} MiB x{n:>2}] skipped: {why}", flush=True)
                        continue
                    row = {**measure(name, w, n), "rep": rep}
                    rows.append(row)
                    print(f"[{name:>7} {w:>5} MiB x{n:>2}] fork {row['fork_seconds']:.3f}s frozen "
                          f"{row['frozen_seconds']:.3f}s host/clone {row['per_clone_host_bytes'] / MiB:.1f} MiB"
                          + (f" per additional clone {row['per_additional_clone_host_bytes'] / MiB:.1f} MiB"
                             f" (page cache {row['per_additional_clone_page_cache_bytes'] / MiB:.1f})"
                             if "per_additional_clone_host_bytes" in row else "")
                          + (f" FAILED {row['errors']}" if row["errors"] else ""), flush=True)
    summary = summarize(rows, written, clone_counts)
    result = {
        "written_mib": written, "clones": clone_counts, "layouts": names, "reps": args.reps,
        "layer_store": asdict(check), "summary": summary,
        "machine": {"cpus": os.cpu_count(), "mem_total_bytes": meminfo("MemTotal"), "kernel": os.uname().release},
        "rows": rows,
    }
    (out / "fork_fs.json").write_text(json.dumps(result, indent=1))
    print_table(summary, written, clone_counts, names)
    print("targets:")
    print_targets(summary["targets"])
    print(f"wrote {out / 'fork_fs.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

