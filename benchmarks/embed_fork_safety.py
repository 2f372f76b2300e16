"""Workspace forks inside a trainer that imported numpy and torch first: does bunshin fork() it?

python benchmarks/embed_fork_safety.py --rounds 50 [--strace] [--out DIR]

numpy and torch are imported before bunshinfork, as verl, SkyRL or any training script does,
and their thread pools (OpenBLAS's, torch's intra-op pool) are kept busy by two threads doing
matrix products the whole time. Each round then runs, at once, 8 clones forked from a retained
snapshot of a running workspace and a fresh snapshot of it saved to disk, and destroys the
clones. A fork() of this process would run every library's pthread_atfork handlers in it
(OpenBLAS's drains its thread pool and can deadlock while another thread is inside it): a
handler this script registers, from a small C library built with cc, counts them. With
--strace the run is repeated under `strace -f`, which counts this process's own clone(),
clone3(), fork() and vfork() calls by kind: threads (CLONE_THREAD), vforks (CLONE_VM |
CLONE_VFORK: subprocess's spawns) and anything else, i.e. a fork.

Targets (printed, never asserted): 0 atfork handler calls; 0 forks in the strace count.
tests/test_embed.py runs the same rounds (fewer of them) and asserts the first.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The trainer's order: its numerical libraries first, their thread pools started.
import numpy as np
import torch

from bunshinfork import Snapshot, Workspace

CLONES = 8
ATFORK_SRC = r"""
#include <pthread.h>
static int calls;
static void prepare(void) { __atomic_fetch_add(&calls, 1, __ATOMIC_SEQ_CST); }
int atfork_calls(void) { return __atomic_load_n(&calls, __ATOMIC_SEQ_CST); }
__attribute__((constructor)) static void install(void) { pthread_atfork(prepare, 0, 0); }
"""


def atfork_counter(build_dir: Path) -> Callable[[], int]:
    """Build and load a library whose pthread_atfork prepare handler counts calls: glibc runs it
    for every fork() of this process (os.fork, subprocess's fork path, a library's or native
    code's fork()), and never for vfork, posix_spawn or a raw clone."""
    src, lib = build_dir / "atfork.c", build_dir / "libatfork.so"
    src.write_text(ATFORK_SRC)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src)], check=True, timeout=60,
                   capture_output=True)
    fn = ctypes.CDLL(str(lib)).atfork_calls
    fn.restype = ctypes.c_int
    return lambda: int(fn())


@contextlib.contextmanager
def busy_pools() -> Iterator[dict[str, int]]:
    """Two threads keeping numpy's BLAS pool and torch's intra-op pool at work until exit; yields
    how many products each finished (a pool that stalled shows as a count that stopped)."""
    stop = threading.Event()
    done = {"numpy": 0, "torch": 0}

    # Between products each loop yields the CPU a moment (stop.wait): the pools' threads stay
    # up and busy (OpenBLAS's spin between calls), and CRIU, which needs the same cores, is
    # not starved into timing out on a small host.
    def numpy_loop() -> None:
        a = np.random.default_rng(0).random((256, 256))
        while not stop.wait(0.002):
            a = np.tanh(a @ a)
            done["numpy"] += 1

    def torch_loop() -> None:
        a = torch.rand(256, 256)
        while not stop.wait(0.002):
            a = torch.tanh(a @ a)
            done["torch"] += 1

    threads = [threading.Thread(target=f, daemon=True) for f in (numpy_loop, torch_loop)]
    for t in threads:
        t.start()
    try:
        yield done
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)


def source() -> Workspace:
    """A running workspace with a process whose memory is written all the time."""
    ws = Workspace.create()
    try:
        ws.commands.run("python3 -c 'b = bytearray(8 << 20)\nwhile True:\n  b[::4096] = b\"x\" * 2048'"
                        " >/dev/null 2>&1 &")
        return ws
    except BaseException:
        ws.destroy()
        raise


def one_round(ws: Workspace, base: Snapshot, save_dir: Path) -> dict[str, float]:
    """8 clones of `base` and a snapshot of `ws` saved to `save_dir`, at the same time."""
    def fork() -> list[Workspace]:
        results = base.fork(CLONES)
        clones = [r for r in results if isinstance(r, Workspace)]
        errors = [r for r in results if not isinstance(r, Workspace)]
        if errors:
            destroy(clones)
            raise RuntimeError(f"{len(errors)} of {CLONES} clones failed: {errors!r}")
        return clones

    def snapshot_and_save() -> None:
        with ws.snapshot() as snap:
            snap.save(save_dir).result(timeout=300)

    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        forking, saving = pool.submit(fork), pool.submit(snapshot_and_save)
        try:
            saving.result()
        finally:
            clones = forking.result()
    took = time.monotonic() - t0
    destroy(clones)
    shutil.rmtree(save_dir)
    return {"seconds": took}


def destroy(clones: list[Workspace]) -> None:
    with ThreadPoolExecutor(max(1, len(clones))) as pool:
        list(pool.map(lambda c: c.destroy(), clones))


def run(rounds: int, work: Path, on_round: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`rounds` rounds with both pools busy; on_round(i, atfork calls so far) after each."""
    calls = atfork_counter(work)
    rows: list[dict[str, float]] = []
    with busy_pools() as done:
        ws = source()
        try:
            with ws.snapshot() as base:
                for i in range(rounds):
                    before = dict(done)
                    row = one_round(ws, base, work / f"saved-{i}")
                    row["numpy_products"] = done["numpy"] - before["numpy"]
                    row["torch_products"] = done["torch"] - before["torch"]
                    rows.append(row)
                    if on_round:
                        on_round(i, calls())
        finally:
            ws.destroy()
    return {"rounds": rounds, "clones_per_round": CLONES, "atfork_calls": calls(), "rows": rows}


# strace's lines: "PID clone3({flags=...}, 88) = NEW", or split around a blocking call (a vfork
# waits for its child's exec) as "PID clone3(... <unfinished ...>" and "PID <... clone3 resumed>...".
CALL = re.compile(r"^(\d+)\s+(clone3?|fork|vfork)\((.*)\)\s+=\s+(-?\d+)")
STARTED = re.compile(r"^(\d+)\s+(clone3?|fork|vfork)\((.*) <unfinished \.\.\.>$")
RESUMED = re.compile(r"^(\d+)\s+<\.\.\. (clone3?|fork|vfork) resumed>(.*)\)\s+=\s+(-?\d+)")


def classify(trace: str, root: int) -> dict[str, int]:
    """Count this process's (pid `root` and its threads') clone calls by kind; the threads are
    followed as the calls that made them appear. Children's own calls are not this process's."""
    members, pending = {root}, {}
    counts = {"thread": 0, "vfork": 0, "workspace_init": 0, "fork": 0}
    for line in trace.splitlines():
        if m := STARTED.match(line):
            pending[int(m.group(1))] = m.group(3)
            continue
        if m := RESUMED.match(line):
            pid, args, new = int(m.group(1)), pending.pop(int(m.group(1)), "") + m.group(3), int(m.group(4))
        elif m := CALL.match(line):
            pid, args, new = int(m.group(1)), m.group(3), int(m.group(4))
        else:
            continue
        if pid not in members or new <= 0:
            continue
        if m.group(2) == "vfork" or ("CLONE_VM" in args and "CLONE_VFORK" in args):
            counts["vfork"] += 1
        elif "CLONE_NEWNS" in args:
            # bunshinfork.native.spawn's raw clone3 of a workspace's init (once, for the source):
            # glibc runs no atfork handler for it, and the child runs only system calls until it
            # execs the init.
            counts["workspace_init"] += 1
        elif "CLONE_THREAD" in args:
            counts["thread"] += 1
            members.add(new)
        else:
            counts["fork"] += 1
            print(f"fork: {line}", file=sys.stderr)
    return counts


def under_strace(rounds: int, keep: str | None) -> dict[str, int]:
    """Run this script's rounds again as a child under strace -f and count its clones; `keep`:
    where to copy strace's log."""
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "trace"
        # -b execve: a child is let go at its exec (CRIU must ptrace the tasks it dumps and
        # restores, and a task has one tracer), so only this process and its threads are traced.
        subprocess.run(["strace", "-f", "-b", "execve", "-qq", "-e", "trace=clone,clone3,fork,vfork", "-o", str(log),
                        sys.executable, __file__, "--rounds", str(rounds), "--pid-to", str(Path(d) / "pid")],
                       check=True, timeout=1800, stdout=subprocess.DEVNULL)
        if keep:
            shutil.copy(log, keep)
        return classify(log.read_text(), int((Path(d) / "pid").read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--strace", action="store_true", help="also count clone calls under strace -f")
    ap.add_argument("--strace-log", help="with --strace: keep strace's log here")
    ap.add_argument("--out", help="directory for embed_fork_safety.json")
    ap.add_argument("--pid-to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pid_to:
        Path(args.pid_to).write_text(str(os.getpid()))
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        result = run(args.rounds, Path(work), lambda i, n: print(f"round {i + 1}/{args.rounds}: atfork calls {n}",
                                                                  file=sys.stderr))
    if args.strace:
        result["strace"] = under_strace(args.rounds, args.strace_log)
    secs = sorted(r["seconds"] for r in result["rows"])
    result["median_round_seconds"] = secs[len(secs) // 2]
    del result["rows"]
    print(json.dumps(result, indent=1))
    print(f"target: 0 atfork handler calls: {'met' if result['atfork_calls'] == 0 else 'MISSED'}")
    if args.strace:
        print(f"target: 0 forks under strace: {'met' if result['strace']['fork'] == 0 else 'MISSED'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "embed_fork_safety.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
