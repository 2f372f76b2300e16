"""Soak and chaos: workspaces created, run, forked, snapshotted and destroyed by several
processes at once, while their creators, CRIU and workspace inits are killed at random; then gc,
and a count of everything left behind.

python benchmarks/soak.py --minutes N --out DIR [--workers 3] [--seed 0]

Each worker is a process of its own (this script with --worker) that repeats one cycle until
told to stop: create a workspace (die_with_creator, as a rollout worker would), write a file in
it, fork it and check the clone sees the file and the source still runs, snapshot it, fork the
snapshot and check that clone too, release the snapshot, destroy all three. Every operation is
logged (its time, or its error's type) to DIR/workers/*.jsonl as it ends, so a killed worker's
operations still count.

Meanwhile a chaos thread sends SIGKILL, every 0.5-3 s (seeded), to one of:
- a creator (a worker; a new one replaces it at once),
- a CRIU process (dump or restore, whichever is running),
- a workspace init,
preferring, half of the time, a moment when some source is frozen (it waits up to 3 s for
one): then it kills the creator that froze it or its CRIU. Each kill is logged with what
was frozen at that moment.

The longest freeze is measured three ways: a sampler outside every workspace reads each
workspace cgroup's `frozen` state every 10 ms (killed callers included); the freeze watchdog's
log (what it thawed itself, and after how long); and the snapshots' own frozen_seconds.

After --minutes the workers are told to stop (those still busy after 60 s are killed), the
workspaces of killed creators end themselves within their lease (lifetime.LEASE_SECONDS), and
`bunshinfork.gc()` removes the rest. gc leaves layers and frozen layers younger than its
orphan age (60 s) alone, as they may be a creator's mid-create: where the first gc leaves
anything, a second runs once the last worker's stop is that old (both counts are reported).
The leak count compares a census of the host
(bunshinfork.census: mounts, cgroups, loop devices, network namespaces, veths, nft rules,
processes, host fds, tmpfs bytes, layer bytes, subvolumes, qgroups, KSM boost holders, cow
holders) taken before the run with one taken after gc; each is expected to be 0.

Targets (printed, met or missed; none is asserted): every leak 0; the longest freeze under the
`frozen` deadline (bunshinfork.deadlines); no wrong result (a clone or source that does not
see what it should).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bunshinfork import Snapshot, Workspace, census, deadlines, pipeline, state
from bunshinfork.cgroups import leftover_cgroups
from bunshinfork.cgroups.watchdog import events
from bunshinfork.fs import frozen as frozen_layers
from bunshinfork.process import lifetime
from bunshinfork.state import Record

STOP = "stop"


# ---- the worker ----

class _Log:
    def __init__(self, path: Path) -> None:
        self._f = path.open("a", buffering=1)

    def op(self, name: str, t0: float, error: BaseException | None = None, **extra: Any) -> None:
        e: dict[str, Any] = {"op": name, "seconds": round(time.monotonic() - t0, 4), **extra}
        if error is not None:
            e["error"] = type(error).__name__
            e["message"] = str(error)[:300]
        self._f.write(json.dumps(e) + "\n")


class WrongResult(Exception):
    """A workspace answered, but not what it should have."""


class KilledMeanwhile(Exception):
    """The workspace's init was killed (by the chaos) while the check ran."""


def _check(ws: Workspace, path: str, want: str) -> None:
    r = ws.commands.run(f"cat {path}", timeout=30)
    if r.exit_code != 0 and not ws.is_running():
        raise KilledMeanwhile(f"{ws.id} ended while `cat {path}` ran (exit {r.exit_code})")
    if r.exit_code != 0 or r.stdout.strip() != want:
        raise WrongResult(f"{ws.id}: {path} reads {r.stdout!r} (exit {r.exit_code}), expected {want!r}")


def _one(clones: list[Workspace | Exception]) -> Workspace:
    """The clone of a fork(1), or what it failed with, raised."""
    (c,) = clones
    if isinstance(c, Exception):
        raise c
    return c


def _cycle(log: _Log, n: int) -> None:
    held: list[Any] = []  # workspaces and the snapshot, released in reverse on the way out

    def step(name: str, fn: Any, **extra: Any) -> Any:
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:
            log.op(name, t0, e, **extra)
            raise
        log.op(name, t0, **extra)
        return out

    try:
        ws = step("create", lambda: Workspace.create(die_with_creator=True))
        held.append(ws)
        token = f"cycle-{os.getpid()}-{n}"
        step("run", lambda: ws.commands.run(f"echo {token} > /root/token", timeout=30))
        clone = step("fork", lambda: _one(ws.fork(1, die_with_creator=True)))
        held.append(clone)
        step("check", lambda: (_check(clone, "/root/token", token), _check(ws, "/root/token", token)))
        snap = step("snapshot", ws.snapshot)
        held.append(snap)
        log.op("frozen", time.monotonic(), frozen_seconds=snap.timing.frozen_seconds)
        c2 = step("fork_snapshot", lambda: _one(snap.fork(1, die_with_creator=True)))
        held.append(c2)
        step("check", lambda: _check(c2, "/root/token", token))
    except Exception:
        pass  # logged by step(); what was made is released below
    finally:
        for h in reversed(held):
            with contextlib.suppress(Exception):
                if isinstance(h, Snapshot):
                    step("release", h.release)
                else:
                    step("destroy", h.destroy)


def worker(out: Path, name: str) -> int:
    log = _Log(out / "workers" / f"{name}.jsonl")
    fds0 = len(os.listdir("/proc/self/fd"))
    n = 0
    while not (out / STOP).exists():
        _cycle(log, n)
        n += 1
    log.op("exit", time.monotonic(), cycles=n, fd_growth=len(os.listdir("/proc/self/fd")) - fds0)
    return 0


# ---- the orchestrator ----

def _frozen_ws() -> list[str]:
    out = []
    for d in leftover_cgroups():
        if "/unified/" not in d and not d.startswith("/sys/fs/cgroup/bunshin"):
            continue
        try:
            if "frozen 1" in Path(d, "cgroup.events").read_text():
                out.append(os.path.basename(d))
        except OSError:
            continue
    return out


class Sampler(threading.Thread):
    """Every workspace cgroup's frozen state, every 10 ms: the longest freeze seen."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.since: dict[str, float] = {}
        self.longest = 0.0
        self.freezes = 0

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            frozen = set(_frozen_ws())
            for ws in frozen - self.since.keys():
                self.since[ws] = now
                self.freezes += 1
            for ws in list(self.since):
                if ws not in frozen:
                    self.longest = max(self.longest, now - self.since.pop(ws))
            self.stop.wait(0.01)

    def finish(self) -> float:
        self.stop.set()
        self.join()
        now = time.monotonic()
        return max([self.longest, *(now - t for t in self.since.values())])


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _criu_of(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        for c in _children(p):
            try:
                if Path(f"/proc/{c}/comm").read_text().strip() == "criu":
                    out.append(c)
            except OSError:
                continue
    return out


class Soak:
    def __init__(self, out: Path, workers: int, rng: random.Random) -> None:
        self.out, self.rng = out, rng
        self.procs: dict[str, subprocess.Popen] = {}
        self.spawned = 0
        self.kills: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        for _ in range(workers):
            self.spawn()

    def spawn(self) -> None:
        name = f"w{self.spawned}"
        self.spawned += 1
        with (self.out / "workers" / f"{name}.stderr").open("w") as err:
            self.procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--worker", name, "--out", str(self.out)],
                stdout=subprocess.DEVNULL, stderr=err)

    def live(self) -> dict[str, subprocess.Popen]:
        return {n: p for n, p in self.procs.items() if p.poll() is None}

    def kill(self, pid: int, kind: str, frozen: list[str]) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills.append({"kind": kind, "pid": pid, "mid_freeze": bool(frozen), "t": time.time()})

    def chaos_once(self) -> None:
        frozen: list[str] = []
        if self.rng.random() < 0.5:
            end = time.monotonic() + 3
            while not frozen and time.monotonic() < end:
                frozen = _frozen_ws()
                time.sleep(0.005)
        with self.lock:
            live = self.live()
            pids = {p.pid: n for n, p in live.items()}
            if frozen:
                try:
                    creator = Record.load(frozen[0]).creator_pid
                except (FileNotFoundError, ValueError):
                    return
                # The source's creator is the worker forking it (each forks only its own).
                if creator in pids:
                    criu = _criu_of([creator])
                    if criu and self.rng.random() < 0.5:
                        self.kill(self.rng.choice(criu), "criu", frozen)
                    else:
                        self.kill(creator, "creator", frozen)
                        self.spawn()
                return
            kind = self.rng.choice(["creator", "criu", "init"])
            if kind == "creator" and pids:
                self.kill(self.rng.choice(sorted(pids)), "creator", frozen)
                self.spawn()
            elif kind == "criu":
                criu = _criu_of(sorted(pids))
                if criu:
                    self.kill(self.rng.choice(criu), "criu (restore or pre-dump)", frozen)
            elif kind == "init":
                inits = [rec.process.pid for rec in state.records()
                         if rec.process is not None and rec.creator_pid in pids]
                if inits:
                    self.kill(self.rng.choice(inits), "init", frozen)

    def chaos(self, until: float) -> None:
        while time.monotonic() < until:
            time.sleep(self.rng.uniform(0.5, 3.0))
            if time.monotonic() < until:
                self.chaos_once()

    def stop(self, grace: float = 60.0) -> int:
        (self.out / STOP).touch()
        end = time.monotonic() + grace
        killed = 0
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                killed += 1
        return killed


def _ops(out: Path) -> tuple[Counter, Counter, list[float], list[dict], list[str]]:
    done, errors, frozen, exits, samples = Counter(), Counter(), [], [], []
    for f in sorted((out / "workers").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # the last line of a killed worker
            if e["op"] == "frozen":
                frozen.append(e["frozen_seconds"])
            elif e["op"] == "exit":
                exits.append(e)
            elif "error" in e:
                errors[f"{e['op']}: {e['error']}"] += 1
                if len(samples) < 20:
                    samples.append(f"{e['op']}: {e['error']}: {e['message']}")
            else:
                done[e["op"]] += 1
    return done, errors, frozen, exits, samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.worker:
        return worker(out, args.worker)

    (out / "workers").mkdir(parents=True, exist_ok=True)
    (out / STOP).unlink(missing_ok=True)
    for f in (out / "workers").iterdir():
        f.unlink()
    pipeline.gc()
    before = census.take()
    watchdog_seen = len(events())
    sampler = Sampler()
    sampler.start()
    t0 = time.monotonic()
    soak = Soak(out, args.workers, random.Random(args.seed))
    soak.chaos(t0 + args.minutes * 60)
    killed_at_stop = soak.stop()
    run_seconds = time.monotonic() - t0
    longest_sampled = sampler.finish()
    # Killed creators' workspaces end themselves within their lease; gc removes what they left.
    t_stop = time.monotonic()
    time.sleep(lifetime.LEASE_SECONDS + 2)
    t_gc = time.monotonic()
    removed = pipeline.gc()
    gc_seconds = time.monotonic() - t_gc
    leaks_first, after = _settled(before)
    removed_second: dict[str, list[str]] = {}
    leaks = leaks_first
    if any(leaks.values()):
        # gc leaves a layer or frozen layer younger than its orphan age alone (it may be a
        # creator's under another state root, mid-create): the second gc is past that age.
        time.sleep(max(0.0, t_stop + frozen_layers.ORPHAN_AGE + 1 - time.monotonic()))
        removed_second = pipeline.gc()
        leaks, after = _settled(before)
    watchdog = events()[watchdog_seen:]
    done, errors, frozen, exits, samples = _ops(out)
    longest = {
        "sampled": round(longest_sampled, 3),
        "watchdog": max((e["frozen_seconds"] for e in watchdog), default=0.0),
        "snapshots": max(frozen, default=0.0),
    }
    limit = deadlines.current().frozen
    result = {
        "minutes": args.minutes, "workers": args.workers, "seed": args.seed, "run_seconds": round(run_seconds, 1),
        "operations": dict(sorted(done.items())), "operations_total": sum(done.values()),
        "errors": dict(sorted(errors.items())), "errors_total": sum(errors.values()),
        "error_samples": samples,
        "kills": dict(Counter(("mid-freeze " if k["mid_freeze"] else "") + k["kind"] for k in soak.kills)),
        "workers_spawned": soak.spawned, "workers_killed_at_stop": killed_at_stop,
        "worker_fd_growth": [e["fd_growth"] for e in exits],
        "freezes_sampled": sampler.freezes,
        "longest_frozen_seconds": longest, "frozen_deadline_seconds": limit,
        "watchdog_events": dict(Counter(e["reason"] for e in watchdog)),
        "gc_removed": {k: len(v) for k, v in removed.items()}, "gc_seconds": round(gc_seconds, 2),
        "leaks_after_first_gc": leaks_first,
        "second_gc_removed": {k: len(v) for k, v in removed_second.items() if v},
        "leaks": leaks,
        "leaked": {k: sorted(map(str, after[k] - before[k]))[:10] for k, v in leaks.items()
                   if v and k not in census.BYTES},
    }
    (out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    wrong = errors_of(errors, "WrongResult")
    print("targets:")
    print(f"  leaks all 0: {'met' if not any(leaks.values()) else 'MISSED'}")
    print(f"  longest freeze {max(longest.values()):.3f}s < deadline {limit:.0f}s: "
          f"{'met' if max(longest.values()) < limit else 'MISSED'}")
    print(f"  wrong results 0: {'met' if not wrong else f'MISSED ({wrong})'}")
    return 0


def _settled(before: dict[str, set]) -> tuple[dict[str, int], dict[str, set]]:
    """The leak count, given a process killed a moment ago a little while to go."""
    deadline = time.monotonic() + 10
    while True:
        leaks = census.leaks(before, after := census.take())
        if not any(leaks.values()) or time.monotonic() > deadline:
            return leaks, after
        time.sleep(0.2)


def errors_of(errors: Counter, kind: str) -> int:
    return sum(n for k, n in errors.items() if k.endswith(f": {kind}"))


if __name__ == "__main__":
    sys.exit(main())
