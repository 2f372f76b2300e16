"""What images cost as workspaces: layered (each layer once, stacked) against a flat export.

    python benchmarks/images.py [--quick] [--reps N] --out DIR     (root; writes DIR/images.json)

A private dockerd (tests/images_support.py: its own data root and exec root, no bridge, no
iptables; stopped afterwards) builds a base: `docker import` of the Debian rootfs set-up
caches, sudo and libcap2-bin from .deb files with a file capability set by setcap, and a
layer of a real Python environment (numpy, scipy, pandas, sympy and their dependencies, copied
from this interpreter's site-packages: 359 MiB, 10.8k files). On it, 8 images differ in a
small top layer (a task's files). --quick: 2 images, numpy alone in the base's Python layer,
1 rep; the JSON says so under "regime".

Each rep creates, for every image, a layered workspace (Workspace.create(rootfs="docker:IMAGE"),
the image's layers removed from the store first, so its save and unpack are timed) and a flat
one (the image exported whole with container.export and untarred with tarfile's "tar" filter
into one directory, as bunshin did before its layers, then Workspace.create(rootfs=DIR)),
interleaved image by image, the mode going first alternating per image and per rep. Then:
- every file either mode keeps is synced and evicted (posix_fadvise DONTNEED), and each
  workspace's first command is timed (interleaved the same way);
- every workspace reads every file under /usr and /opt;
- page_cache_bytes: the pages of each mode's own host files (the layer store's layers of
  these images; the flat directories) resident in the host's page cache, counted with mincore
  on those files, each inode once;
- disk_bytes: the blocks of those files (each inode once).
`template`: a warm template made from the first image (a server that imports the Python
layer's packages before it answers), and, interleaved per rep, cold_start_seconds (create from
the image, start the server, until the ready command succeeds) against warm_start_seconds
(Workspace.create(template=...) until the same ready command succeeds). setuid_kept and
caps_kept: sudo's setuid bit and the Dockerfile's cap_net_raw, in each mode.

Times are medians over reps and images with their (min, max) in *_range; ratios are flat over
layered (and cold over warm), of the medians.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import stat
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' dockerd helper

from images_support import BASE, Engine, _debs, build_base, dockerd

from bunshinfork import Workspace
from bunshinfork.images import store, templates, warm

MODES = ("layered", "flat")
SITE = "opt/venv/lib/python3.11/site-packages"  # the Debian rootfs's python3 is 3.11, as this venv's
PACKAGES_FULL = ("numpy", "numpy.libs", "numpy-*.dist-info", "scipy", "scipy.libs", "scipy-*.dist-info",
                 "pandas", "pandas-*.dist-info", "sympy", "sympy-*.dist-info", "mpmath", "mpmath-*.dist-info",
                 "dateutil", "python_dateutil-*.dist-info", "tzdata", "tzdata-*.dist-info")
PACKAGES_QUICK = ("numpy", "numpy.libs", "numpy-*.dist-info")
IMPORTS_FULL = "numpy, scipy.optimize, scipy.sparse, scipy.stats, pandas, sympy"
IMPORTS_QUICK = "numpy"
PORT = 8090
SERVER = "exec python3 /opt/serve.py"
READY = f"python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{PORT}/', timeout=5)\""
READY_TIMEOUT = 300.0
READ_ALL = "find /usr /opt -xdev -type f -print0 | xargs -0 cat > /dev/null 2>&1; true"
TEMPLATE = "bench-images"
_libc = ctypes.CDLL(None, use_errno=True)


# -- the host's files: blocks, resident pages, eviction ------------------------------------

def files_under(dirs: list[Path]) -> list[Path]:
    return [Path(r) / n for d in dirs for r, _, names in os.walk(d) for n in names]


def _regular(paths: list[Path]) -> Iterator[tuple[Path, os.stat_result]]:
    """Regular files, each inode once (a layer's hard links are one file)."""
    seen: set[tuple[int, int]] = set()
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            yield p, st


def disk_bytes(paths: list[Path]) -> int:
    return sum(st.st_blocks * 512 for _, st in _regular(paths))


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of these files' pages in the host's page cache, by mincore over a mapping of each."""
    total = 0
    for p, st in _regular(paths):
        if st.st_size == 0:
            continue
        # A private mapping: ctypes can view it (not a read-only one), and until written its
        # pages are the page cache's own, which is what mincore reports.
        with open(p, "rb") as f, mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_COPY) as m:
            pages = (st.st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            start = ctypes.c_char.from_buffer(m)
            rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(st.st_size), vec)
            del start  # the mapping cannot close while a ctypes view holds it
            if rc != 0:
                raise OSError(ctypes.get_errno(), f"mincore {p}")
            total += sum(v & 1 for v in vec) * mmap.PAGESIZE
    return total


def evict(paths: list[Path]) -> None:
    """Write back, then drop these files' pages (a dirty page cannot be dropped)."""
    os.sync()
    for p, _ in _regular(paths):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the images ---------------------------------------------------------------------------

SERVE_PY = """import http.server, os, sys
import {imports}  # what a real service loads before it answers: the Python layer's packages
http.server.test(http.server.SimpleHTTPRequestHandler, http.server.ThreadingHTTPServer, port={port},
                 bind="127.0.0.1")
"""


def build(engine: Engine, work: Path, n: int, packages: tuple[str, ...], imports: str) -> list[str]:
    """The base and n images on it; their names."""
    build_base(engine)
    ctx = work / "ctx-base"
    site = ctx / "site-packages"
    site.mkdir(parents=True)
    src = Path(sysconfig.get_paths()["purelib"])
    for pattern in packages:
        found = sorted(src.glob(pattern))
        if not found:
            raise SystemExit(f"{src} has no {pattern}: the benchmark's Python layer copies it from this venv")
        for p in found:
            subprocess.run(["cp", "-a", str(p), str(site / p.name)], check=True, timeout=300)
    subprocess.run(["cp", "-a", str(_debs()), str(ctx / "debs")], check=True, timeout=60)
    (ctx / "serve.py").write_text(SERVE_PY.format(imports=imports, port=PORT))
    (ctx / "Dockerfile").write_text(f"""FROM {BASE}
COPY debs/ /tmp/debs/
RUN dpkg -i /tmp/debs/*.deb && rm -rf /tmp/debs && cp /bin/sleep /usr/local/bin/rawping \\
 && setcap cap_net_raw+ep /usr/local/bin/rawping
COPY site-packages/ /{SITE}/
COPY serve.py /opt/serve.py
ENV PYTHONPATH=/{SITE}
""")
    engine.docker("build", "-q", "--network", "none", "-t", "bench/base:1", str(ctx), timeout=900)
    shutil.rmtree(ctx)
    names = []
    for i in range(n):
        name = f"bench/task{i}:1"
        engine.build(name, "FROM bench/base:1\nCOPY task /opt/task\n",
                     files={"task/README": f"task {i}\n".encode() * 64,
                            "task/patch.diff": f"-{i}\n+{i + 1}\n".encode()})
        names.append(name)
    return names


def export_flat(image: str, dest: Path) -> None:
    """The image as one directory, the way bunshin made docker: workspaces before its layers."""
    import docker  # type: ignore[import-untyped]

    client = docker.from_env(timeout=300)
    container = client.containers.create(image, command=["/bin/true"])
    try:
        tar_path = dest.with_suffix(".tar")
        with open(tar_path, "wb") as f:
            for chunk in container.export():
                f.write(chunk)
        dest.mkdir()
        with tarfile.open(tar_path) as tf:
            extract_as_tar_filter(tf, dest)
        tar_path.unlink()
    finally:
        container.remove(force=True)
        client.close()


def extract_as_tar_filter(tf: tarfile.TarFile, dest: Path) -> None:
    """extractall(filter="tar"), also where Python 3.11 predates extraction filters (3.11.4):
    the setuid, setgid and sticky bits and group and other write go, as that filter drops them."""
    if hasattr(tarfile, "tar_filter"):
        tf.extractall(dest, filter="tar")
        return
    members = tf.getmembers()
    for m in members:
        if m.isfile() or m.isdir():
            m.mode &= ~(stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH)
    tf.extractall(dest, members=members)  # the engine's own export of an image this run built


def kept(ws: Workspace) -> tuple[bool, bool]:
    mode = ws.commands.run("stat -c %a /usr/bin/sudo", user="root").stdout.strip()
    caps = ws.commands.run("/sbin/getcap /usr/local/bin/rawping", user="root").stdout
    return len(mode) == 4 and mode.startswith(("4", "6")), "cap_net_raw=ep" in caps


# -- one rep --------------------------------------------------------------------------------

def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def clear_layers(diff_ids: list[str]) -> None:
    for d in diff_ids:
        if store.has(d):
            shutil.rmtree(store.path(d))


def rep(r: int, names: list[str], diff_ids: list[str], work: Path) -> dict:
    """Both modes for every image, interleaved; what each measured."""
    clear_layers(diff_ids)
    flats = [work / f"flat{i}" for i in range(len(names))]
    for p in flats:
        shutil.rmtree(p, ignore_errors=True)
    wss: dict[str, list[Workspace]] = {m: [] for m in MODES}
    out: dict[str, dict] = {m: {"create_seconds": [], "first_command_seconds": []} for m in MODES}

    def order(i: int) -> tuple[str, ...]:
        return MODES if (i + r) % 2 == 0 else MODES[::-1]

    def create(mode: str, i: int) -> None:
        if mode == "layered":
            ws, took = timed(lambda: Workspace.create(rootfs=f"docker:{names[i]}"))
        else:
            def make() -> Workspace:
                # A flat image's create includes its export, as a layered one's includes its unpack.
                export_flat(names[i], flats[i])
                return Workspace.create(rootfs=str(flats[i]))
            ws, took = timed(make)
        wss[mode].append(ws)  # type: ignore[arg-type]
        out[mode]["create_seconds"].append(took)

    try:
        for i in range(len(names)):
            for mode in order(i):
                create(mode, i)
        files = {"layered": files_under([store.path(d) for d in diff_ids]), "flat": files_under(flats)}
        # What unpacking or exporting wrote is in the page cache too: the reads start from none.
        for mode in MODES:
            evict(files[mode])
            out[mode]["page_cache_bytes_before_reads"] = resident_bytes(files[mode])
        for i in range(len(names)):
            for mode in order(i):
                _, took = timed(lambda ws=wss[mode][i]: ws.commands.run("true", user="root"))
                out[mode]["first_command_seconds"].append(took)
        for i in range(len(names)):
            for mode in order(i):
                res = wss[mode][i].commands.run(READ_ALL, user="root", timeout=900)
                assert res.exit_code == 0, res.stderr
        for mode in MODES:
            out[mode]["page_cache_bytes"] = resident_bytes(files[mode])
            out[mode]["disk_bytes"] = disk_bytes(files[mode])
            out[mode]["setuid_kept"], out[mode]["caps_kept"] = kept(wss[mode][0])
        return out
    finally:
        for mode in MODES:
            for ws in wss[mode]:
                ws.destroy()
        for p in flats:
            shutil.rmtree(p, ignore_errors=True)


def template_reps(image: str, reps: int) -> dict:
    """cold (from the image: create, start, ready) against warm (from the template), interleaved."""
    def cold() -> None:
        with Workspace.create(rootfs=image) as ws:
            ws.commands.run(SERVER, background=True, timeout=0, user="root")
            warm.wait_ready(ws, READY, READY_TIMEOUT)

    def warm_start() -> None:
        with Workspace.create(template=TEMPLATE) as ws:
            warm.wait_ready(ws, READY, READY_TIMEOUT)

    _, made = timed(lambda: warm.create(TEMPLATE, image, start=SERVER, ready=READY, ready_timeout=READY_TIMEOUT))
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    try:
        for r in range(reps):
            for kind in (("cold", "warm") if r % 2 == 0 else ("warm", "cold")):
                # A workspace's time ends at its destroy: what it costs to start is what is timed.
                t0 = time.perf_counter()
                if kind == "cold":
                    cold()
                else:
                    warm_start()
                times[kind].append(time.perf_counter() - t0)
    finally:
        templates.rm(TEMPLATE)
    return {"image": image, "template_create_seconds": made, "cold_start_seconds_each": times["cold"],
            "warm_start_seconds_each": times["warm"]}


# -- summary --------------------------------------------------------------------------------

def med(vals: list[float]) -> float:
    return statistics.median(vals)


def spread(vals: list[float]) -> list[float]:
    return [min(vals), max(vals)]


def summarize(reps: list[dict]) -> dict:
    out: dict = {}
    for mode in MODES:
        rows = [r[mode] for r in reps]
        cell: dict = {}
        for key in ("create_seconds", "first_command_seconds"):
            vals = [v for row in rows for v in row[key]]
            cell[key], cell[f"{key}_range"] = med(vals), spread(vals)
            cell[f"{key}_each"] = [row[key] for row in rows]
            cell[f"{key.replace('_seconds', '')}_total_seconds"] = med([sum(row[key]) for row in rows])
        for key in ("disk_bytes", "page_cache_bytes", "page_cache_bytes_before_reads"):
            vals = [row[key] for row in rows]
            cell[key], cell[f"{key}_range"] = int(med(vals)), spread(vals)
        cell["setuid_kept"] = all(row["setuid_kept"] for row in rows)
        cell["caps_kept"] = all(row["caps_kept"] for row in rows)
        out[mode] = cell
    lay, flat = out["layered"], out["flat"]
    out["ratios_flat_over_layered"] = {k: flat[k] / lay[k] if lay[k] else None for k in
                                       ("disk_bytes", "page_cache_bytes", "create_seconds", "create_total_seconds",
                                        "first_command_seconds")}
    return out


def regime(args: argparse.Namespace, n: int, packages: tuple[str, ...], imports: str) -> dict:
    mem = next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal:"))
    return {
        "quick": args.quick, "images": n, "reps": args.reps, "python_layer_packages": list(packages),
        "server_imports": imports, "interleaving": "modes alternate image by image, the first alternating per rep; "
        "template cold and warm alternate per rep",
        "page_cache_method": "mincore over each mode's own host files (layer store layers; flat directories), "
        "each inode once, after sync + posix_fadvise(DONTNEED) eviction and every workspace reading /usr and /opt",
        "host": {"cpus": os.cpu_count(), "mem_kib": int(mem), "kernel": platform.release()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 images, a numpy-only Python layer, 1 rep")
    ap.add_argument("--reps", type=int, default=None, help="reps of both modes and of the template (3; quick 1)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    n, packages, imports = (2, PACKAGES_QUICK, IMPORTS_QUICK) if args.quick else (8, PACKAGES_FULL, IMPORTS_FULL)
    args.reps = args.reps or (1 if args.quick else 3)
    result: dict = {"regime": regime(args, n, packages, imports)}
    print("regime:", json.dumps(result["regime"], indent=2), flush=True)
    work = Path(tempfile.mkdtemp(prefix="bunshin-images-bench-", dir="/var/tmp"))
    saved_host, saved_root = os.environ.get("DOCKER_HOST"), templates.ROOT
    templates.ROOT = work / "saved"
    added: list[str] = []
    image_ids: list[str] = []
    t_start = time.perf_counter()
    try:
        with dockerd(work / "engine") as engine:
            os.environ["DOCKER_HOST"] = engine.host
            names = build(engine, work, n, packages, imports)
            info = [json.loads(engine.docker("image", "inspect", nm))[0] for nm in names]
            image_ids = [i["Id"] for i in info]
            diff_ids = sorted({d for i in info for d in i["RootFS"]["Layers"]})
            added = [d for d in diff_ids if not store.has(d)]
            base = json.loads(engine.docker("image", "inspect", "bench/base:1"))[0]
            result["base_bytes"] = int(base["Size"])
            history = [json.loads(line) for line in engine.docker(
                "history", "--format", "{{json .}}", "--no-trunc", "--human=false", "bench/base:1").splitlines()]
            result["python_layer_bytes"] = next(int(h["Size"]) for h in history
                                                if "COPY" in h["CreatedBy"] and "site-packages" in h["CreatedBy"])
            result["top_layer_bytes"] = int(info[0]["Size"]) - result["base_bytes"]
            print(f"built {n} images on a {result['base_bytes'] / 2**20:.0f} MiB base "
                  f"({time.perf_counter() - t_start:.0f} s)", flush=True)
            reps = []
            for r in range(args.reps):
                reps.append(rep(r, names, diff_ids, work))
                print(f"rep {r}: " + json.dumps({m: {k: v for k, v in reps[-1][m].items() if not k.endswith('_seconds')}
                                                 for m in MODES}), flush=True)
            result.update(summarize(reps))
            t = template_reps(f"docker:{names[0]}", args.reps)
            t["cold_start_seconds"], t["cold_start_seconds_range"] = med(t["cold_start_seconds_each"]), \
                spread(t["cold_start_seconds_each"])
            t["warm_start_seconds"], t["warm_start_seconds_range"] = med(t["warm_start_seconds_each"]), \
                spread(t["warm_start_seconds_each"])
            t["ratio_cold_over_warm"] = t["cold_start_seconds"] / t["warm_start_seconds"]
            result["template"] = t
            result["setuid_kept"] = {m: result[m]["setuid_kept"] for m in MODES}
            result["caps_kept"] = {m: result[m]["caps_kept"] for m in MODES}
    finally:
        templates.ROOT = saved_root
        if saved_host is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved_host
        forget(added, image_ids)
        shutil.rmtree(work, ignore_errors=True)
    result["wall_seconds"] = time.perf_counter() - t_start
    (args.out / "images.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def forget(diff_ids: list[str], image_ids: list[str]) -> None:
    """Take out of the layer store what only this run put there: its layers, their short
    links and its images' records (layers the store held before stay: it is a cache)."""
    for d in diff_ids:
        h = store.hex_of(d)
        shutil.rmtree(store.path(d), ignore_errors=True)
        for n in (store.SHORT, 24, 64):
            link = store.LINKS / h[:n]
            if link.is_symlink() and os.readlink(link).endswith(h):
                link.unlink()
        with suppress(FileNotFoundError):
            (store.LAYERS / f".{h}.lock").unlink()
    for i in image_ids:
        with suppress(FileNotFoundError, Exception):
            (store.CONFIGS / f"img-{store.hex_of(i)[:16]}.json").unlink()


if __name__ == "__main__":
    sys.exit(main())
