"""What images cost as workspaces: layered (each layer once, stacked) against a flat export.

    python benchmarks/images.py [--quick] --out DIR     (root; writes DIR/images.json)

A private dockerd (tests/images_support.py: its own data root, no bridge, no iptables) builds
a base of at least 300 MiB (the Debian rootfs, sudo and libcap2-bin from .deb files, a file
capability set by setcap, and incompressible filler) and 8 images on it that differ in a
small top layer (--quick: 2 images, a 16 MiB filler). Then, for each mode:
- layered: Workspace.create(rootfs="docker:IMAGE"): the layers unpacked once into the store;
- flat: the image exported whole (container.export) and untarred with tarfile's "tar" filter
  into one directory per image, as bunshin did before, and Workspace.create(rootfs=DIR);
it records disk_bytes (what the mode keeps on disk for all images), page_cache_bytes (pages of
those files resident after every workspace read its files, counted by mincore on the host
files), create_seconds (each image's first workspace, the image's unpack or export
included; median) and first_command_seconds (median). `template` holds warm_start_seconds
(Workspace.create(template=...)) and cold_start_seconds (create, start a server, wait until
it answers) for the same image; setuid_kept and caps_kept record whether sudo's setuid bit
and the Dockerfile's file capability survived, in each mode.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import stat
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' dockerd helper

from images_support import BASE, Engine, _debs, build_base, dockerd

from bunshinfork import Workspace
from bunshinfork.images import store, templates, warm

FILLER_FULL = 160 << 20  # with the ~180 MiB Debian rootfs and packages: a base past 300 MiB
FILLER_QUICK = 16 << 20
SERVER = "exec python3 -m http.server --bind 127.0.0.1 8090"
READY = "python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:8090/')\""
READ_ALL = "find /usr /opt -xdev -type f -print0 | xargs -0 cat > /dev/null 2>&1; true"
_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of these files' pages in the host's page cache (each inode once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        with open(p, "rb") as f, mmap.mmap(f.fileno(), st.st_size, access=mmap.ACCESS_COPY) as m:
            pages = (st.st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            start = ctypes.c_char.from_buffer(m)
            _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(st.st_size), vec)
            del start  # the mapping cannot close while a ctypes view holds it
            total += sum(v & 1 for v in vec) * mmap.PAGESIZE
    return total


def evict(paths: list[Path]) -> None:
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(dirs: list[Path]) -> list[Path]:
    return [Path(r) / n for d in dirs for r, _, names in os.walk(d) for n in names]


def tree_bytes(dirs: list[Path]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in files_under(dirs):
        st = os.lstat(p)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def build(engine: Engine, n: int, filler: int) -> list[str]:
    build_base(engine)
    ctx = {"filler": os.urandom(filler)}
    engine.build("bench/base:1", f"""FROM {BASE}
COPY debs/ /tmp/debs/
RUN dpkg -i /tmp/debs/*.deb && rm -rf /tmp/debs && cp /bin/sleep /usr/local/bin/rawping \\
 && setcap cap_net_raw+ep /usr/local/bin/rawping
COPY filler /opt/filler
""", files=ctx, dirs={"debs": _debs()})
    names = []
    for i in range(n):
        name = f"bench/task{i}:1"
        engine.build(name, "FROM bench/base:1\nCOPY top /opt/task\n", files={"top": f"task {i}\n".encode() * 512})
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
            tf.extractall(dest, filter="tar")
        tar_path.unlink()
    finally:
        container.remove(force=True)
        client.close()


def kept(ws: Workspace) -> tuple[bool, bool]:
    mode = ws.commands.run("stat -c %a /usr/bin/sudo", user="root").stdout.strip()
    caps = ws.commands.run("/sbin/getcap /usr/local/bin/rawping", user="root").stdout
    return len(mode) == 4 and mode.startswith(("4", "6")), "cap_net_raw=ep" in caps


def run_mode(name: str, sources: list[str], dirs: list[Path]) -> dict:
    creates, firsts, wss = [], [], []
    try:
        for src in sources:
            t0 = time.perf_counter()
            wss.append(Workspace.create(rootfs=src))
            creates.append(time.perf_counter() - t0)
        # What unpacking or exporting wrote is in the page cache too: start the reads from none.
        files = files_under(dirs)
        evict(files)
        for ws in wss:
            t0 = time.perf_counter()
            ws.commands.run("true", user="root")
            firsts.append(time.perf_counter() - t0)
        for ws in wss:
            ws.commands.run(READ_ALL, user="root", timeout=600)
        setuid, caps = kept(wss[0])
        return {"images": len(sources), "disk_bytes": tree_bytes(dirs), "page_cache_bytes": resident_bytes(files),
                "create_seconds": statistics.median(creates), "create_seconds_each": creates,
                "first_command_seconds": statistics.median(firsts), "setuid_kept": setuid, "caps_kept": caps}
    finally:
        for ws in wss:
            ws.destroy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 images and a small filler (CI's smoke run)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    n, filler = (2, FILLER_QUICK) if args.quick else (8, FILLER_FULL)
    work = Path(tempfile.mkdtemp(prefix="bunshin-images-bench-", dir="/var/tmp"))
    saved_host = os.environ.get("DOCKER_HOST")
    saved_root = templates.ROOT
    templates.ROOT = work / "saved"
    result: dict = {"quick": args.quick}
    try:
        with dockerd(work / "engine") as engine:
            os.environ["DOCKER_HOST"] = engine.host
            names = build(engine, n, filler)
            info = [json.loads(engine.docker("image", "inspect", nm))[0] for nm in names]
            result["base_bytes"] = int(json.loads(engine.docker("image", "inspect", "bench/base:1"))[0]["Size"])
            # Layered: the store starts without these images' layers, so their unpack is timed.
            diff_ids = sorted({d for i in info for d in i["RootFS"]["Layers"]})
            for d in diff_ids:
                if store.has(d):
                    shutil.rmtree(store.path(d))
            result["layered"] = run_mode("layered", [f"docker:{nm}" for nm in names],
                                         [store.path(d) for d in diff_ids])
            flats = []
            t_export = []
            for i, nm in enumerate(names):
                t0 = time.perf_counter()
                export_flat(nm, work / f"flat{i}")
                t_export.append(time.perf_counter() - t0)
                flats.append(work / f"flat{i}")
            flat = run_mode("flat", [str(p) for p in flats], flats)
            # A flat image's create includes its export, as the layered one includes its unpack.
            flat["create_seconds_each"] = [a + b for a, b in zip(flat["create_seconds_each"], t_export, strict=True)]
            flat["create_seconds"] = statistics.median(flat["create_seconds_each"])
            result["flat"] = flat
            image = f"docker:{names[0]}"
            t0 = time.perf_counter()
            with Workspace.create(rootfs=image) as ws:
                ws.commands.run(SERVER, background=True, timeout=0, user="root")
                warm.wait_ready(ws, READY, 60)
            cold = time.perf_counter() - t0
            warm.create("bench", image, start=SERVER, ready=READY, ready_timeout=60)
            t0 = time.perf_counter()
            with Workspace.create(template="bench") as ws:
                warm_start = time.perf_counter() - t0
                assert ws.commands.run(READY, user="root").exit_code == 0
            templates.rm("bench")
            result["template"] = {"image": image, "warm_start_seconds": warm_start, "cold_start_seconds": cold}
            result["setuid_kept"] = {"layered": result["layered"]["setuid_kept"], "flat": flat["setuid_kept"]}
            result["caps_kept"] = {"layered": result["layered"]["caps_kept"], "flat": flat["caps_kept"]}
    finally:
        templates.ROOT = saved_root
        if saved_host is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved_host
        shutil.rmtree(work, ignore_errors=True)
    (args.out / "images.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
