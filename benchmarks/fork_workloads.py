"""Fork latency beyond the idle workspace (issue 40): a 1 GiB source, a web shop, a fork under load.

python benchmarks/fork_workloads.py [--workloads mem,shop,load] [--engines ksm,copy] [--runs 20]
                                    [--size-mib 1024] [--settle 0.3] [--quick] [--out FILE.json]

Regime (docs/fork_workloads.json, docs/benchmarks.md): this project's 2-core, 24 GiB VM, kernel
6.18 without soft-dirty, CRIU with the project's patches; one source per workload and engine
(ksm, then copy), each fork measured `--runs` times back to back after warm-up forks; no pool,
every clone's restore begins after its call. The sources are default workspaces (network "none")
running fork_latency.py's idle process and 1 ms ticker, plus:

- mem: a Python process holding `--size-mib` of touched anonymous memory (a bytearray filled with
  os.urandom, so no two of its pages are alike for KSM to merge). fork(1) as fork_latency's:
  the call to the clone answering `echo hi`, the call alone, the source's frozen time by the
  ticker (its largest gap during the fork) and by the freezer.
- shop: PostgreSQL and the web-shop application of bunshinfork.templates.webshop (its database
  and HTTP server, without its browser), brought up as that template does. fork(1): the call to
  the clone's shop answering /health (a query on the clone's database), the call alone, and the
  source's frozen time, ticker and freezer.
- load: the same shop source with a client inside it sending GET / (a catalogue page read from
  PostgreSQL) back to back, a connection per request (on one keep-alive connection the server's
  two writes per response meet the client's delayed ACK: 44 ms a request), and logging
  every gap between two responses longer than 3 ms. Per run the client runs `--settle` s, the
  source is forked (the clone answering `echo hi`, then destroyed), and it runs `--settle` s
  more: the client's worst stall is the largest gap in that window. The same window without a
  fork, `--runs` times, is the baseline. The client is frozen with its server, so its stall
  includes the freeze; it and the ticker stop themselves in a clone (another time namespace).
  A fork that fails is counted and its stall kept apart; runs go on until `--runs` forked. (CRIU
  refused a connection still in the listener's accept queue, "In-flight connection", until
  the dump skipped those: 3 of 43 forks failed in the run below, 0 of 20 since.)

Targets are not asserted. Every workspace made is destroyed.

Measured in that regime, 20 runs per engine (medians, p90 in brackets; ksm / copy): the 1 GiB
source frozen 586 (630) / 615 (638) ms, its fork(1) 2.17 (2.55) / 2.13 (4.26) s; the shop
frozen 151 (159) / 156 (163) ms, fork(1) to its shop answering 328 (340) / 314 (338) ms; under
load the client's worst stall 162 (176) / 179 (191) ms against 2-3 ms without a fork, and 3 of
43 forks failed on a connection in the accept queue. docs/benchmarks.md has the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bunshinfork import Workspace
from bunshinfork.errors import ForkError
from bunshinfork.templates import start_shop

# fork_latency.py's helpers, loaded by its path: benchmarks/ on sys.path would shadow the tests'
# own `workloads` package when the tests load this module.
_spec = importlib.util.spec_from_file_location("fork_latency", Path(__file__).resolve().with_name("fork_latency.py"))
assert _spec is not None and _spec.loader is not None
fl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fl)
GAP_LOGGED_MS, Ticker, destroying, fork1, ms = fl.GAP_LOGGED_MS, fl.Ticker, fl.destroying, fl.fork1, fl.ms
rounded, sh_quote, source, summary = fl.rounded, fl.sh_quote, fl.source, fl.summary

READY_FILE = "/tmp/fork-workloads-ready"
LOAD_GAPS = "/tmp/fork-workloads-load-gaps"
LOAD_ERRORS = "/tmp/fork-workloads-load-errors"
LOAD_COUNT = "/tmp/fork-workloads-load-count"
LOAD_PATH = "/"


def holder(size_mib: int) -> str:
    """A process that touches `size_mib` MiB of distinct pages, says its RSS, then sleeps."""
    return f"""
import os, time
step = 1 << 20
b = bytearray({size_mib} * step)
for off in range(0, len(b), step):
    b[off:off + step] = os.urandom(step)
rss = [l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]
open('{READY_FILE}.tmp', 'w').write(rss)
os.rename('{READY_FILE}.tmp', '{READY_FILE}')
while True:
    time.sleep(3600)
"""


def load_client(port: int) -> str:
    return f"""
import http.client, os, time
ns = os.readlink('/proc/self/ns/time')
gaps = open('{LOAD_GAPS}', 'a', buffering=1)
errors = open('{LOAD_ERRORS}', 'a', buffering=1)
last = time.monotonic()
n = 0
while True:
    conn = http.client.HTTPConnection('127.0.0.1', {port}, timeout=10)
    try:
        conn.request('GET', '{LOAD_PATH}', headers={{'Connection': 'close'}})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(r.status)
    except Exception as e:
        errors.write('%r\\n' % (e,))
        time.sleep(0.001)
        continue
    finally:
        conn.close()
    now = time.monotonic()
    if (now - last) * 1000 > {GAP_LOGGED_MS}:
        gaps.write('%.3f\\n' % ((now - last) * 1000))
    last = now
    n += 1
    if n % 20 == 0:
        if os.readlink('/proc/self/ns/time') != ns:
            raise SystemExit(0)
        with open('{LOAD_COUNT}.tmp', 'w') as c:
            c.write(str(n))
        os.rename('{LOAD_COUNT}.tmp', '{LOAD_COUNT}')
"""


class GapLog(Ticker):
    """A gap log other than the ticker's, read through the workspace's files."""

    def __init__(self, ws: Workspace, path: str) -> None:
        super().__init__(ws)
        self.path = path

    def _read(self) -> str:
        try:
            return str(self.ws.files.read(self.path))
        except FileNotFoundError:
            return ""


def wait_file(ws: Workspace, path: str, what: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return str(ws.files.read(path))
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


# ---- the shop: the web-shop template's database and server, without its browser ----


# ---- one fork ----


def fork_shop(ws: Workspace, ticker: Ticker, engine: str, url: str) -> dict:
    """fork(1): the call, and the call to the clone's shop answering /health from its database."""
    ticker.mark()
    t0 = time.monotonic()
    clones = ws.fork(1, memory=engine)
    t1 = time.monotonic()
    with destroying(clones) as (c,):
        r = c.commands.run(f"curl -sf -m 10 {url}/health", timeout=30)
        t2 = time.monotonic()
        assert r.stdout == "ok\n", r
        timings = c.info().timings
    frozen = sum(timings.get(f"snapshot.{k}", 0) for k in ("freeze", "dump", "layer", "thaw"))
    return {"answer": t2 - t0, "call": t1 - t0, "frozen_ticker": ticker.largest_since_mark(),
            "frozen_freezer": frozen, "timings": timings}


def fork_loaded(ws: Workspace, ticker: Ticker, client: GapLog, engine: str, settle: float) -> dict:
    """fork(1) in the middle of a `2 * settle` s window of the client's; its worst stall there."""
    ticker.mark()
    client.mark()
    time.sleep(settle)
    t0 = time.monotonic()
    try:
        clones = ws.fork(1, memory=engine)
    except ForkError as e:  # CRIU refuses a connection still in the listener's accept queue
        time.sleep(settle)
        said = [x.strip() for x in str(e).splitlines() if "Error (" in x] or [str(e).splitlines()[0]]
        return {"failed": "; ".join(said)[:400], "call": time.monotonic() - t0 - settle,
                "stall": client.largest_since_mark(), "frozen_ticker": ticker.largest_since_mark()}
    t1 = time.monotonic()
    with destroying(clones) as (c,):
        assert c.commands.run("echo hi", timeout=30).stdout == "hi\n"
        t2 = time.monotonic()
    time.sleep(settle)
    return {"answer": t2 - t0, "call": t1 - t0, "stall": client.largest_since_mark(),
            "frozen_ticker": ticker.largest_since_mark()}


def until_done(n: int, fn: Callable[[], dict]) -> tuple[list[dict], list[dict]]:
    """`n` runs that forked, and those that failed, giving up after 3 * n attempts."""
    done: list[dict] = []
    failed: list[dict] = []
    while len(done) < n and len(done) + len(failed) < 3 * n:
        r = fn()
        (failed if "failed" in r else done).append(r)
    return done, failed


def no_fork(ticker: Ticker, client: GapLog, seconds: float) -> dict:
    ticker.mark()
    client.mark()
    time.sleep(seconds)
    return {"stall": client.largest_since_mark(), "frozen_ticker": ticker.largest_since_mark()}


def repeat(n: int, fn: Callable[[], dict]) -> list[dict]:
    return [fn() for _ in range(n)]


def count(ws: Workspace) -> int:
    try:
        return int(str(ws.files.read(LOAD_COUNT)) or 0)
    except (FileNotFoundError, ValueError):
        return 0


# ---- one workload, one engine ----


def run_mem(engine: str, runs: int, size_mib: int, warmup: int) -> dict:
    ws, ticker = source(engine)
    try:
        ws.commands.run(f"python3 -c {sh_quote(holder(size_mib))}", background=True)
        rss = int(wait_file(ws, READY_FILE, "the memory holder", timeout=60 + size_mib / 50))
        repeat(warmup, lambda: fork1(ws, ticker, engine))
        rs = repeat(runs, lambda: fork1(ws, ticker, engine))
    finally:
        ws.destroy()
    return {"workload": "mem", "engine": engine, "size_mib": size_mib, "holder_rss_kib": rss, "runs": rs}


def run_shop(engine: str, runs: int, warmup: int, load: bool, shop: bool, settle: float) -> list[dict]:
    out = []
    ws, ticker = source(engine)
    try:
        t0 = time.monotonic()
        url = start_shop(ws)  # the web shop template's database and server, without its browser
        up = time.monotonic() - t0
        if shop:
            repeat(warmup, lambda: fork_shop(ws, ticker, engine, url))
            out.append({"workload": "shop", "engine": engine, "bring_up": up,
                        "runs": repeat(runs, lambda: fork_shop(ws, ticker, engine, url))})
        if load:
            ws.commands.run(f"python3 -c {sh_quote(load_client(int(url.rsplit(':', 1)[1])))}", background=True)
            wait_file(ws, LOAD_COUNT, "the load client", timeout=30)
            client = GapLog(ws, LOAD_GAPS)
            n0, t0 = count(ws), time.monotonic()
            base = repeat(runs, lambda: no_fork(ticker, client, 2 * settle))
            rate = (count(ws) - n0) / (time.monotonic() - t0)
            until_done(warmup, lambda: fork_loaded(ws, ticker, client, engine, settle))
            rs, failed = until_done(runs, lambda: fork_loaded(ws, ticker, client, engine, settle))
            errors = [x for x in GapLog(ws, LOAD_ERRORS)._read().split("\n") if x]
            out.append({"workload": "load", "engine": engine, "requests_per_s": rate, "path": LOAD_PATH,
                        "window": 2 * settle, "client_errors": len(errors), "client_error_sample": errors[:3],
                        "runs": rs, "failed_forks": failed, "baseline": base})
    finally:
        ws.destroy()
    return out


# ---- report ----

MEASURES = {
    "mem": [("fork(1): call to clone answering", "answer"), ("fork(1): the call alone", "call"),
            ("source frozen, ticker", "frozen_ticker"), ("source frozen, freezer's figure", "frozen_freezer")],
    "shop": [("fork(1): call to clone's shop answering", "answer"), ("fork(1): the call alone", "call"),
             ("source frozen, ticker", "frozen_ticker"), ("source frozen, freezer's figure", "frozen_freezer")],
    "load": [("client's worst stall across the fork", "stall"), ("fork(1): call to clone answering", "answer"),
             ("source frozen, ticker (under load)", "frozen_ticker")],
}


def rows(result: dict) -> list[tuple[str, str, str, dict]]:
    """(workload, measure, engine, summary) for the table."""
    out = []
    for w in result["workloads"]:
        name = w["workload"] + (f" ({w['size_mib']} MiB)" if w["workload"] == "mem" else "")
        for label, key in MEASURES[w["workload"]]:
            out.append((name, label, w["engine"], summary([r[key] for r in w["runs"]])))
        if w["workload"] == "load":
            for label, key in (("client's worst stall, no fork", "stall"), ("ticker's largest gap, no fork",
                                                                             "frozen_ticker")):
                out.append((name, label, w["engine"], summary([r[key] for r in w["baseline"]])))
    return out


def print_report(result: dict) -> None:
    print(f"regime: {result['regime']}")
    print()
    print("| workload | measure | engine | runs | median (ms) | p90 (ms) | min-max (ms) |")
    print("|---|---|---|---|---|---|---|")
    for workload, name, eng, s in rows(result):
        print(f"| {workload} | {name} | {eng} | {s['n']} | {ms(s['median'])} | {ms(s['p90'])} | "
              f"{ms(s['min'])}-{ms(s['max'])} |")
    for w in result["workloads"]:
        if w["workload"] == "mem":
            print(f"mem, {w['engine']}: the holder's RSS {w['holder_rss_kib'] / 1024:.0f} MiB")
        if w["workload"] == "shop":
            print(f"shop, {w['engine']}: brought up in {w['bring_up']:.1f} s")
        if w["workload"] == "load":
            print(f"load, {w['engine']}: {w['requests_per_s']:.0f} requests/s of GET {w['path']} without a fork, "
                  f"{w['client_errors']} client errors {w['client_error_sample']}; {len(w['failed_forks'])} "
                  f"forks failed beside the {len(w['runs'])} that forked")
            for f in w["failed_forks"][:2]:
                print(f"  a failed fork: stall {ms(f['stall'])} ms: {f['failed'][:160]}")


def regime(args: argparse.Namespace) -> str:
    from bunshinfork.process import criu

    return (f"{os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') >> 30} GiB, "
            f"kernel {platform.release()}, soft-dirty {'yes' if criu.dirty_tracking() else 'no'}, "
            f"CRIU {'.'.join(map(str, criu.version()))}; default workspaces with fork_latency's idle process "
            f"and 1 ms ticker; workloads {args.workloads}, engines {args.engines}, {args.runs} runs each back "
            f"to back after {args.warmup} warm-up fork(s); mem {args.size_mib} MiB; load window "
            f"{2 * args.settle:g} s; no pool")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workloads", default="mem,shop,load")
    ap.add_argument("--engines", default="ksm,copy")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--settle", type=float, default=0.3, help="the load client's seconds before and after a fork")
    ap.add_argument("--quick", action="store_true", help="ksm only, 3 runs, 1 warm-up, 64 MiB (the test)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.runs, args.warmup, args.size_mib, args.settle = "ksm", 3, 1, 64, 0.2
    workloads = set(args.workloads.split(","))
    unknown = workloads - set(MEASURES)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; use mem, shop, load")
    result: dict = {"regime": regime(args), "workloads": []}

    def save() -> None:  # after each workload: a later failure keeps what was measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rounded(result)))

    for engine in args.engines.split(","):
        if "mem" in workloads:
            result["workloads"].append(run_mem(engine, args.runs, args.size_mib, args.warmup))
            save()
        if workloads & {"shop", "load"}:
            result["workloads"] += run_shop(engine, args.runs, args.warmup, "load" in workloads,
                                            "shop" in workloads, args.settle)
            save()
    print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
