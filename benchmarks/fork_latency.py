"""Fork latency (issue 40): how long a live fork takes, and how long its source stands still.

python benchmarks/fork_latency.py [--engines ksm,copy] [--runs 20] [--runs16 20] [--space 1.0]
                                  [--serve-runs 20] [--no-serve] [--quick] [--out FILE.json]

A default workspace runs an idle Python process (the workload the targets name) and a ticker:
a Python loop that sleeps 1 ms and appends every gap between two of its ticks longer than
GAP_LOGGED_MS to a file inside the workspace. The source's frozen time is the largest gap the
ticker saw during a fork, not the freezer's own figure (which is printed beside it). The ticker
stops itself in a clone (it sees a time namespace other than its own), so clones are idle.

Per engine, each measured `--runs` times, after two warm-up forks:
- fork(count=1) back to back and spaced (`--space` s between runs): from the call to the clone
  answering `echo hi`; the call alone and the first command beside it; the ticker's largest gap;
  the CPU the fork cost (CRIU's processes, reaped, plus this process).
- fork(count=16), `--runs16` times: the call, and the call to all 16 answering.
- Snapshot.fork(1) from a retained snapshot: the call to the clone answering.
- every stage of fork(1)'s profile (info().timings), median.
Then `Sandbox.create()` of the real e2b SDK against `bunshin serve` from one of its snapshots,
client-measured, with pause() and connect() beside it.

No pool of clones is used: every clone's restore begins after its call. The CRIU processes that
dump and restore are started ahead where one is idle (bunshinfork/process/prestart.py, one per
kind): their hits and misses are printed, and a CRIU's CPU counts its start. Targets are printed, never
asserted. Everything made (workspaces, snapshots, the server and its sandboxes) is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bunshinfork import Snapshot, Workspace, WorkspaceSpec
from bunshinfork.process import criu

GAP_LOGGED_MS = 3.0
GAPS_FILE = "/tmp/fork-latency-gaps"
# The ticker: its own time namespace is read once; a clone lives in a new one (CRIU gives every
# clone its own), so a clone's ticker exits at its next check and clones stay idle.
TICKER = f"""
import os, time
ns = os.readlink('/proc/self/ns/time')
f = open('{GAPS_FILE}', 'a', buffering=1)
last = time.monotonic()
n = 0
while True:
    time.sleep(0.001)
    now = time.monotonic()
    if (now - last) * 1000 > {GAP_LOGGED_MS}:
        f.write('%.3f\\n' % ((now - last) * 1000))
    last = now
    n += 1
    if n % 50 == 0 and os.readlink('/proc/self/ns/time') != ns:
        raise SystemExit(0)
"""
IDLE = "import time\nwhile True: time.sleep(3600)"

# The targets (this host, ksm engine), printed beside the figures.
TARGETS = {
    "fork1_answer": 0.120,
    "frozen_ticker": 0.060,
    "fork16_call": 0.65,
    "snapfork1_answer": 0.050,
    "serve_create": 0.060,
}


# ---- arithmetic ----


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not xs:
        raise ValueError("percentile of no values")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {"n": len(xs), "median": statistics.median(xs), "p90": percentile(xs, 90), "min": min(xs), "max": max(xs)}


def new_gaps(text: str, seen: int) -> tuple[list[float], int]:
    """The gaps (ms) the ticker logged after the first `seen` complete lines, and the new count;
    a last line without its newline is still being written and is left for the next read."""
    lines = text.split("\n")[:-1]
    return [float(x) for x in lines[seen:] if x.strip()], len(lines)


# ---- measuring ----


class Ticker:
    """The source's gap log, read through the workspace's files."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        self.seen = 0

    def mark(self) -> None:
        _, self.seen = new_gaps(self._read(), 0)

    def largest_since_mark(self) -> float:
        time.sleep(0.02)  # the tick that ends the freeze's gap is written within a few ms
        gaps, self.seen = new_gaps(self._read(), self.seen)
        return max(gaps, default=0.0) / 1000

    def _read(self) -> str:
        try:
            return self.ws.files.read(GAPS_FILE)
        except FileNotFoundError:
            return ""


def cpu_seconds() -> tuple[float, float]:
    """(reaped children's CPU: CRIU and its helpers; this process's CPU). The CRIU that answered
    are reaped off the fork's path: waited for first, outside the timed span. A CRIU started
    ahead (prestart.py) counts its start too, when the request it served has it reaped."""
    criu.settle()
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    s = resource.getrusage(resource.RUSAGE_SELF)
    return c.ru_utime + c.ru_stime, s.ru_utime + s.ru_stime


@contextlib.contextmanager
def destroying(clones: list) -> Iterator[list[Workspace]]:
    """The clones of one call, every one destroyed afterwards; a failed clone fails the run."""
    try:
        bad = [c for c in clones if isinstance(c, Exception)]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(clones)} clones failed: {bad[0]}")
        yield clones
    finally:
        for c in clones:
            if not isinstance(c, Exception):
                c.destroy()


def fork1(ws: Workspace, ticker: Ticker, engine: str) -> dict:
    ticker.mark()
    c0, s0 = cpu_seconds()
    t0 = time.monotonic()
    clones = ws.fork(1, memory=engine)
    t1 = time.monotonic()
    with destroying(clones) as (c,):
        r = c.commands.run("echo hi", timeout=30)
        t2 = time.monotonic()
        c1, s1 = cpu_seconds()
        assert r.stdout == "hi\n", r
        timings = c.info().timings
    # The stages between the freeze and the thaw (a large source's holders and its small
    # processes' pages are taken there too: memory/late.py).
    snap = sum(timings.get(f"snapshot.{k}", 0) for k in ("freeze", "dump", "holders", "late_frozen", "layer", "thaw"))
    return {"answer": t2 - t0, "call": t1 - t0, "first_command": t2 - t1, "frozen_ticker": ticker.largest_since_mark(),
            "frozen_freezer": snap, "cpu_criu": c1 - c0, "cpu_self": s1 - s0, "timings": timings}


def fork16(ws: Workspace, engine: str, count: int) -> dict:
    t0 = time.monotonic()
    clones = ws.fork(count, memory=engine)
    t1 = time.monotonic()
    with destroying(clones) as cs:
        for c in cs:
            assert c.commands.run("echo hi", timeout=30).stdout == "hi\n"
        t2 = time.monotonic()
    return {"call": t1 - t0, "answer": t2 - t0}


def snapfork1(snap: Snapshot) -> dict:
    c0, s0 = cpu_seconds()
    t0 = time.monotonic()
    clones = snap.fork(1)
    t1 = time.monotonic()
    with destroying(clones) as (c,):
        assert c.commands.run("echo hi", timeout=30).stdout == "hi\n"
        t2 = time.monotonic()
        c1, s1 = cpu_seconds()
        timings = c.info().timings
    return {"answer": t2 - t0, "call": t1 - t0, "cpu_criu": c1 - c0, "cpu_self": s1 - s0, "timings": timings}


def repeat(n: int, fn: Callable[[], dict], space: float = 0.0) -> list[dict]:
    out = []
    for _ in range(n):
        if space:
            time.sleep(space)
        out.append(fn())
    return out


def source(engine: str, spec: dict | None = None) -> tuple[Workspace, Ticker]:
    ws = Workspace.create(WorkspaceSpec(**(spec or {})))
    try:
        ws.commands.run(f"python3 -c {sh_quote(IDLE)}", background=True)
        ws.commands.run(f"python3 -c {sh_quote(TICKER)}", background=True)
        deadline = time.monotonic() + 30
        while ws.commands.run(f"test -e {GAPS_FILE}").exit_code != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the ticker did not start")
            time.sleep(0.05)
        return ws, Ticker(ws)
    except BaseException:
        ws.destroy()
        raise


def sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def run_engine(engine: str, runs: int, runs16: int, space: float) -> dict:
    ws, ticker = source(engine)
    try:
        repeat(2, lambda: fork1(ws, ticker, engine))  # warm-up: caches, the first snapshot's chain
        hits, misses = criu.PRESTARTED.stats.hits, criu.PRESTARTED.stats.misses
        b2b = repeat(runs, lambda: fork1(ws, ticker, engine))
        spaced = repeat(runs, lambda: fork1(ws, ticker, engine), space)
        f16 = repeat(runs16, lambda: fork16(ws, engine, 16))
        snap = ws.snapshot(engine)
        try:
            snapfork1(snap)  # warm-up
            sf = repeat(runs, lambda: snapfork1(snap))
        finally:
            snap.release()
    finally:
        ws.destroy()
    started = {"hits": criu.PRESTARTED.stats.hits - hits, "misses": criu.PRESTARTED.stats.misses - misses}
    return {"engine": engine, "fork1_back_to_back": b2b, "fork1_spaced": spaced, "fork16": f16, "snapshot_fork1": sf,
            "criu_started_ahead": started}


# ---- the containment defences, one row each ----

# Each is on by default or where a server turns it on (bunshin serve: limits, user namespace,
# port isolation); the last row turns the default ones off, for contrast.
DEFENCES: tuple[tuple[str, dict], ...] = (
    ("default: capabilities dropped, seccomp profile, masked /proc", {}),
    ("+ cgroup limits (2 cores, 512 MiB, 1024 pids: serve's)",
     {"cpu_limit": 2.0, "memory_limit": 512 << 20, "pids_limit": 1024}),
    ("+ disk quota (10 GiB: serve's)", {"disk_limit": 10 << 30}),
    ("+ user namespace (serve's default; the debian rootfs)", {"rootfs": "debian", "userns": True}),
    ("+ bridged, port isolation, private ranges blocked", {"network": "bridge", "port_isolation": True,
                                                           "block_private": True}),
    ("privileged: capabilities kept, no seccomp profile, /proc unmasked (defences off)", {"privileged": True}),
)


def run_defences(engine: str, runs: int) -> list[dict]:
    """fork(1) of a source with each defence on, back to back after two warm-up forks."""
    out = []
    for label, spec in DEFENCES:
        ws, ticker = source(engine, spec)
        try:
            one = functools.partial(fork1, ws, ticker, engine)
            repeat(2, one)
            rs = repeat(runs, one)
        finally:
            ws.destroy()
        out.append({"defence": label, "spec": {k: v for k, v in spec.items()}, "engine": engine, "runs": rs})
    return out


# ---- bunshin serve, client-measured ----


def run_serve(runs: int) -> dict:
    """Sandbox.create() from one of the server's snapshots, pause() and connect(), all through
    the unmodified e2b SDK on loopback."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import e2b_server_support as support
    from e2b import Sandbox

    create, pause, resume, cold = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bunshin-fork-latency-") as d, support.serving(Path(d)):
        t0 = time.monotonic()
        src = Sandbox.create(timeout=600)
        cold.append(time.monotonic() - t0)
        try:
            src.commands.run(f"python3 -c {sh_quote(IDLE)}", background=True)
            snap_id = src.create_snapshot().snapshot_id
            for _ in range(2 + runs):  # two warm-up creates
                t0 = time.monotonic()
                sbx = Sandbox.create(snap_id, timeout=600)
                took = time.monotonic() - t0
                try:
                    assert sbx.commands.run("echo hi").stdout == "hi\n"
                    create.append(took)
                finally:
                    sbx.kill()
            for _ in range(max(3, runs // 4)):
                t0 = time.monotonic()
                src.pause()
                t1 = time.monotonic()
                src = Sandbox.connect(src.sandbox_id, timeout=600)
                t2 = time.monotonic()
                assert src.commands.run("echo hi").stdout == "hi\n"
                pause.append(t1 - t0)
                resume.append(t2 - t1)
        finally:
            src.kill()
    return {"create_from_snapshot": create[2:], "pause": pause, "connect": resume, "cold_create": cold}


# ---- report ----


def rows(result: dict) -> list[tuple[str, str, dict, float | None]]:
    """(measure, engine, summary, target) for the table."""
    out = []
    for e in result["engines"]:
        eng = e["engine"]
        for key, label in (("fork1_back_to_back", "back to back"), ("fork1_spaced", "spaced")):
            rs = e[key]
            out.append((f"fork(1): call to clone answering ({label})", eng, summary([r["answer"] for r in rs]),
                        TARGETS["fork1_answer"]))
            out.append((f"fork(1): source frozen, ticker ({label})", eng, summary([r["frozen_ticker"] for r in rs]),
                        TARGETS["frozen_ticker"]))
        rs = e["fork1_back_to_back"]
        out.append(("fork(1): the call alone", eng, summary([r["call"] for r in rs]), None))
        out.append(("fork(1): clone's first command", eng, summary([r["first_command"] for r in rs]), None))
        out.append(("fork(1): source frozen, freezer's figure", eng, summary([r["frozen_freezer"] for r in rs]), None))
        out.append(("fork(1): CPU, CRIU (dump + restore)", eng, summary([r["cpu_criu"] for r in rs]), None))
        out.append(("fork(1): CPU, this process", eng, summary([r["cpu_self"] for r in rs]), None))
        f16 = e["fork16"]
        out.append(("fork(16): the call", eng, summary([r["call"] for r in f16]), TARGETS["fork16_call"]))
        out.append(("fork(16): call to all 16 answering", eng, summary([r["answer"] for r in f16]), None))
        sf = e["snapshot_fork1"]
        out.append(("Snapshot.fork(1): call to clone answering", eng, summary([r["answer"] for r in sf]),
                    TARGETS["snapfork1_answer"]))
        out.append(("Snapshot.fork(1): CPU, CRIU (restore)", eng, summary([r["cpu_criu"] for r in sf]), None))
    for d in result.get("defences", []):
        out.append((f"fork(1) with {d['defence']}: call to clone answering", d["engine"],
                    summary([r["answer"] for r in d["runs"]]), None))
        out.append((f"fork(1) with {d['defence']}: source frozen, ticker", d["engine"],
                    summary([r["frozen_ticker"] for r in d["runs"]]), None))
    if s := result.get("serve"):
        out.append(("serve: Sandbox.create(snapshot), client-measured", "serve", summary(s["create_from_snapshot"]),
                    TARGETS["serve_create"]))
        out.append(("serve: pause()", "serve", summary(s["pause"]), None))
        out.append(("serve: connect() (resume)", "serve", summary(s["connect"]), None))
    return out


def stage_rows(result: dict) -> list[tuple[str, dict[str, float]]]:
    """Each stage of fork(1)'s profile (back to back), median seconds per engine."""
    stages: dict[str, dict[str, float]] = {}
    for e in result["engines"]:
        per: dict[str, list[float]] = {}
        for r in e["fork1_back_to_back"]:
            for k, v in r["timings"].items():
                per.setdefault(k, []).append(v)
        for k, vs in per.items():
            stages.setdefault(k, {})[e["engine"]] = statistics.median(vs)
    return sorted(stages.items(), key=lambda kv: -max(kv[1].values()))


def rounded(x: object) -> object:
    """Seconds to the microsecond, for the JSON."""
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def ms(x: float) -> str:
    return f"{x * 1000:.1f}"


def print_report(result: dict) -> None:
    print(f"regime: {result['regime']}")
    print()
    print("| measure | engine | runs | median (ms) | p90 (ms) | min-max (ms) | target (ms) |")
    print("|---|---|---|---|---|---|---|")
    for name, eng, s, target in rows(result):
        t = f"<= {ms(target)}" if target is not None else ""
        spread = f"{ms(s['min'])}-{ms(s['max'])}"
        print(f"| {name} | {eng} | {s['n']} | {ms(s['median'])} | {ms(s['p90'])} | {spread} | {t} |")
    print()
    engines = [e["engine"] for e in result["engines"]]
    if not engines:
        return
    print("fork(1)'s stages, back to back, median (ms):")
    print()
    print("| stage | " + " | ".join(engines) + " |")
    print("|---|" + "---|" * len(engines))
    for stage, per in stage_rows(result):
        print(f"| {stage} | " + " | ".join(ms(per[e]) if e in per else "" for e in engines) + " |")
    print()
    for e in result["engines"]:
        started = e.get("criu_started_ahead")
        if started:
            print(f"{e['engine']}: CRIU requests served by a CRIU started ahead (prestart.py): {started['hits']}; "
                  f"that started their own: {started['misses']}")


def regime(args: argparse.Namespace) -> str:
    from bunshinfork.process import criu

    soft_dirty = "yes" if criu.dirty_tracking() else "no"
    return (f"{os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30} GiB, "
            f"kernel {platform.release()}, soft-dirty {soft_dirty}, CRIU {'.'.join(map(str, criu.version()))}; "
            f"a default workspace (containment defences on) running an idle Python process and a 1 ms ticker; "
            f"{args.runs} runs per row ({args.runs16} for fork(16)), back to back and {args.space:g} s apart; "
            f"{args.defence_runs} back to back per containment defence row; "
            f"no pool of clones: every restore begins after its call, in a CRIU process started ahead where "
            f"one is idle (hits and misses below)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="ksm,copy")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--runs16", type=int, default=20)
    ap.add_argument("--space", type=float, default=1.0, help="seconds between spaced runs")
    ap.add_argument("--serve-runs", type=int, default=20)
    ap.add_argument("--no-serve", action="store_true", help="skip bunshin serve's rows")
    ap.add_argument("--defence-runs", type=int, default=10, help="fork(1) runs per defence row (0: none)")
    ap.add_argument("--defences-only", action="store_true", help="only the rows per containment defence")
    ap.add_argument("--quick", action="store_true", help="ksm only, 5 runs, 3 of fork(16), no serve (CI)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.runs, args.runs16, args.space, args.no_serve = "ksm", 5, 3, 0.2, True
        args.defence_runs = 0
    result: dict = {"regime": regime(args), "engines": []}
    engines = args.engines.split(",")
    if not args.defences_only:
        for engine in engines:
            result["engines"].append(run_engine(engine, args.runs, args.runs16, args.space))
    if args.defence_runs:
        result["defences"] = run_defences(engines[0], args.defence_runs)
    if not args.no_serve and not args.defences_only:
        try:
            result["serve"] = run_serve(args.serve_runs)
        except Exception as e:  # the engines' rows still print
            result["serve_error"] = f"{type(e).__name__}: {e}"
            print(f"bunshin serve's rows failed: {result['serve_error']}", file=sys.stderr)
    print_report(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rounded(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
