"""`bunshin serve` under load: N clients of the unmodified e2b Python SDK on loopback, each
creating a sandbox, running `true` in it (timed), forking it and killing both, for S seconds.
Prints cycles, errors, the p50 and p99 of commands.run("true"), and what was left behind.

With --attackers (issue 36's proof of #9 and #14): the server runs in a memory cgroup the
benchmark makes (and removes); N clients run commands.run("true") in sandboxes of their own, in
windows without attackers (idle) and with three (a sandbox flooding 4x the output the server
holds per stream, read by its client; a client without the key posting large bodies to a
port-proxy URL; one holding 100 half-open connections), interleaved over --rounds in an order
drawn from --seed. The attackers run in a process of their own, so their client-side work
does not slow the measured clients. Prints the clients' p50/p99 idle vs attacked (pooled, and
each round's ratio), the server's cgroup memory peak and the size of the output files, and the
targets: p99 attacked <= 2x idle, server < 300 MiB.

python benchmarks/e2b_server.py [--clients 32] [--seconds 60] [--out FILE.json]
python benchmarks/e2b_server.py --attackers [--clients 32] [--rounds 3] [--window 20] [--seed 0] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import e2b_server_support as support

from bunshinfork import state

MiB = 1 << 20
P99_RATIO_TARGET = 2.0
SERVER_MIB_TARGET = 300


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--attackers", action="store_true", help="idle vs attacked windows (issue 36)")
    ap.add_argument("--rounds", type=int, default=3, help="--attackers: idle and attacked windows per round")
    ap.add_argument("--window", type=float, default=20, help="--attackers: seconds per window")
    ap.add_argument("--seed", type=int, default=0, help="--attackers: draws each round's order")
    ap.add_argument("--body-mib", type=int, default=256, help="--attackers: each no-key body through the proxy")
    ap.add_argument("--attack-process", nargs=4, metavar=("URL", "KEY", "FLOOD_SANDBOX", "PROXY_HOST"),
                    help=argparse.SUPPRESS)  # the attackers' own process (see --attackers)
    args = ap.parse_args()
    if args.attack_process:
        return attack_process(*args.attack_process, body_bytes=args.body_mib * MiB)
    if args.attackers:
        return attackers(args)
    with tempfile.TemporaryDirectory(prefix="bunshin-serve-bench-") as tmp:
        key = Path(tmp) / "key"
        key.write_text("bench-" + os.urandom(8).hex())
        served = support.start(Path(tmp) / "state", key)
        try:
            result = support.load(served, args.clients, args.seconds)
        finally:
            status = served.stop()
        left = [i for i in state.all_ids() if state.Record.load(i).creator_pid == served.proc.pid]
    report = {"clients": args.clients, "seconds": args.seconds, "cycles": result.cycles,
              "errors": len(result.errors), "run_true_p50_ms": round(result.percentile(0.5) * 1000, 2),
              "run_true_p99_ms": round(result.percentile(0.99) * 1000, 2), "runs": len(result.run_true),
              "server_exit": status, "left_behind": left}
    print(result.summary())
    for err in result.errors[:10]:
        print("error:", err)
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if not result.errors and not left and status == 0 else 1


class MemoryCgroup:
    """A memory cgroup of the benchmark's own for the server: v1's memory controller where the
    host mounts one (a child of the benchmark's own), else cgroup v2's root. The server is
    forked inside it (the benchmark joins it only for that fork), so all its memory counts."""

    def __init__(self, name: str) -> None:
        v1 = Path("/sys/fs/cgroup/memory")
        if (v1 / "memory.usage_in_bytes").exists():
            own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                       if line.split(":", 2)[1] == "memory")
            self.parent, self.v1 = v1 / own.lstrip("/"), True
        elif "memory" in Path("/sys/fs/cgroup/cgroup.controllers").read_text().split():
            self.parent, self.v1 = Path("/sys/fs/cgroup"), False
        else:
            raise RuntimeError("no memory cgroup controller on this host")
        self.path = self.parent / name
        self.path.mkdir()
        self.version = "v1" if self.v1 else "v2"

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """This process inside the cgroup while the block runs (to fork the server there)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (self.parent / "cgroup.procs").write_text(str(os.getpid()))

    def current(self) -> int:
        return int((self.path / ("memory.usage_in_bytes" if self.v1 else "memory.current")).read_text())

    def peak(self) -> int:
        return int((self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")).read_text())

    def reset_peak(self) -> bool:
        """Start a new peak (v1, and v2 on kernels that allow it); False: the peak is the cgroup's lifetime's."""
        try:
            (self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")).write_text("0")
            return True
        except OSError:
            return False

    def remove(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:  # its last task not yet gone
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def attack_process(url: str, key: str, flood_id: str, host: str, body_bytes: int) -> int:
    """The attackers until stdin closes; their result as JSON on stdout."""
    import e2b
    import e2b_attack_support as attack

    served = support.Served(url, key, None, Path("/"))  # type: ignore[arg-type]
    flood = e2b.Sandbox.connect(flood_id, api_key=key, api_url=url, sandbox_url=url)
    attackers = attack.Attackers(served, flood, host, body_bytes=body_bytes).start()
    print("started", flush=True)
    sys.stdin.read()
    print(json.dumps(asdict(attackers.stop())), flush=True)
    return 0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


class OutputFiles:
    """Samples, while it runs, the bytes of the flood sandbox's command output files (in the
    sandbox: the server keeps none) and of the server's state directory; keeps the peaks."""

    def __init__(self, flood_id: str, state_dir: Path) -> None:
        from bunshinfork import Workspace
        from bunshinfork.process.protocol import CMD_DIR

        self.files = Workspace.connect(flood_id).files
        self.cmd_dir = CMD_DIR
        self.state_dir = state_dir
        self.peak_output = self.peak_state = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> OutputFiles:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            with contextlib.suppress(Exception):
                out = sum(e.size for e in self.files.list(self.cmd_dir, depth=2, user="root")
                          if e.name in ("stdout", "stderr"))
                self.peak_output = max(self.peak_output, out)
            self.peak_state = max(self.peak_state, _dir_bytes(self.state_dir))


def attackers(args: argparse.Namespace) -> int:
    import e2b
    import e2b_attack_support as attack

    order = []
    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        pair = ["idle", "attacked"]
        rng.shuffle(pair)
        order.append(pair)
    cg = MemoryCgroup(f"bunshin-bench-serve-{os.getpid()}")
    print(f"regime: {platform.node()} kernel {platform.release()}, {os.cpu_count()} CPUs (load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, shared with other work), cgroup {cg.version} memory "
          f"cgroup {cg.path}; bunshin serve on loopback with its defaults (head 10 s, idle 30 s); {args.clients} "
          f"clients in {args.clients} sandboxes, each running commands.run('true') back to back (sync e2b SDK, one "
          f"process); {args.rounds} rounds of an idle and an attacked {args.window:g} s window, order by seed "
          f"{args.seed}: {order}; attackers in a process of their own: a flood of {attack.FLOOD_BYTES // MiB} MiB "
          f"per command (4x the {attack.OUTPUT_CAP // MiB} MiB the server holds per stream) back to back, no-key "
          f"bodies of {args.body_mib} MiB to a port-proxy URL back to back, 100 half-open connections (reopened "
          f"when closed)", flush=True)
    windows: list[dict] = []
    errors: list[str] = []
    made: list[e2b.Sandbox] = []
    status = -1
    try:
        with tempfile.TemporaryDirectory(prefix="bunshin-serve-bench-") as tmp:
            key = Path(tmp) / "key"
            key.write_text("bench-" + os.urandom(8).hex())
            with cg.joined():
                served = support.start(Path(tmp) / "state", key)
            try:
                opts = {"api_key": served.key, "api_url": served.url, "sandbox_url": served.url}
                with ThreadPoolExecutor(8) as pool:
                    made = list(pool.map(lambda _: e2b.Sandbox.create(timeout=3600, **opts), range(args.clients + 2)))
                flood, target = made[-2], made[-1]
                host = attack.serve_count(target)
                clients = attack.Clients(served, [s.sandbox_id for s in made[:args.clients]], args.clients)
                clients.start()  # warm: each client answered once
                deadline = time.monotonic() + 120
                while min(clients.result.per_client) < 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
                errors += clients.stop().errors
                attack.settle(served)
                base = cg.current()
                with OutputFiles(flood.sandbox_id, served.state_dir) as files:
                    for rnd, pair in enumerate(order):
                        for mode in pair:
                            w = _window(served, cg, clients, mode, args, flood.sandbox_id, host)
                            w["round"] = rnd
                            windows.append(w)
                            errors += w.pop("errors")
                            print(f"round {rnd} {mode:8s}: {w['calls']} calls, p50 {w['p50_ms']:.1f} ms, "
                                  f"p99 {w['p99_ms']:.1f} ms, server cgroup peak {w['cgroup_peak_mib']:.1f} MiB",
                                  flush=True)
                    peak_output, peak_state = files.peak_output, files.peak_state
                use = attack.settle(served)
            finally:
                for s in made:
                    with contextlib.suppress(Exception):
                        s.kill()
                status = served.stop()
            left = [i for i in state.all_ids() if state.Record.load(i).creator_pid == served.proc.pid]
    finally:
        cg.remove()
    return _report(args, windows, errors, base, peak_output, peak_state, use, status, left)


def _window(served: support.Served, cg: MemoryCgroup, clients: object, mode: str, args: argparse.Namespace,
            flood_id: str, host: str) -> dict:
    import e2b_attack_support as attack

    assert isinstance(clients, attack.Clients)
    cg.reset_peak()
    proc = None
    if mode == "attacked":
        proc = subprocess.Popen([sys.executable, __file__, "--body-mib", str(args.body_mib), "--attack-process",
                                 served.url, served.key, flood_id, host],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "started":
            proc.kill()
            raise RuntimeError("the attackers did not start")
    clients.start()
    time.sleep(args.window)  # the clients work meanwhile: the window is the span measured
    got = clients.stop()
    hit: dict = {}
    if proc is not None:
        try:
            out, _ = proc.communicate("", timeout=attack.CALL_TIMEOUT + 30)
            hit = json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            got.errors.append(f"attackers: {type(e).__name__}: {e}")
    peak = cg.peak()
    attack.settle(served)  # the half-open and idle connections gone before the next window
    closes = hit.get("half_open_closed_after", [])
    return {"mode": mode, "calls": len(got.run_true), "p50_ms": _pct(got.run_true, 0.5) * 1000,
            "p99_ms": _pct(got.run_true, 0.99) * 1000, "samples": got.run_true, "cgroup_peak_mib": peak / MiB,
            "floods": hit.get("floods", 0), "flood_mib": hit.get("flood_read", 0) / MiB,
            "bodies": hit.get("bodies", 0), "body_mib": hit.get("body_bytes", 0) / MiB,
            "half_open_opened": hit.get("half_open_opened", 0), "half_open_closed": len(closes),
            "half_open_closed_after_s": [round(min(closes), 2), round(max(closes), 2)] if closes else None,
            "errors": got.errors + hit.get("errors", [])}


def _report(args: argparse.Namespace, windows: list[dict], errors: list[str], base: int, peak_output: int,
            peak_state: int, use: object, status: int, left: list[str]) -> int:
    idle = [x for w in windows if w["mode"] == "idle" for x in w["samples"]]
    hit = [x for w in windows if w["mode"] == "attacked" for x in w["samples"]]
    p = {m: (_pct(xs, 0.5) * 1000, _pct(xs, 0.99) * 1000) for m, xs in (("idle", idle), ("attacked", hit))}
    ratio = p["attacked"][1] / p["idle"][1]
    rounds = sorted({w["round"] for w in windows})
    by = {(w["round"], w["mode"]): w for w in windows}
    per_round = [by[r, "attacked"]["p99_ms"] / by[r, "idle"]["p99_ms"] for r in rounds]
    mem_idle = max(w["cgroup_peak_mib"] for w in windows if w["mode"] == "idle")
    mem_hit = max(w["cgroup_peak_mib"] for w in windows if w["mode"] == "attacked")
    attacked = [w for w in windows if w["mode"] == "attacked"]
    print(f"commands.run('true'), {args.clients} clients: idle p50 {p['idle'][0]:.1f} ms p99 {p['idle'][1]:.1f} ms "
          f"({len(idle)} calls); attacked p50 {p['attacked'][0]:.1f} ms p99 {p['attacked'][1]:.1f} ms ({len(hit)} "
          f"calls); p50 x{p['attacked'][0] / p['idle'][0]:.2f}, p99 x{ratio:.2f} (per round "
          f"{', '.join(f'x{r:.2f}' for r in per_round)}; spread x{min(per_round):.2f}-x{max(per_round):.2f})")
    spans = [w["half_open_closed_after_s"] for w in attacked if w["half_open_closed_after_s"]]
    closed_after = f", after {min(a for a, _ in spans)}-{max(b for _, b in spans)} s" if spans else ""
    print(f"attackers over {len(attacked)} windows: {sum(w['floods'] for w in attacked)} floods "
          f"({sum(w['flood_mib'] for w in attacked):.0f} MiB read by their client), "
          f"{sum(w['bodies'] for w in attacked)} no-key bodies ({sum(w['body_mib'] for w in attacked):.0f} MiB "
          f"through the proxy), {sum(w['half_open_opened'] for w in attacked)} half-open connections "
          f"({sum(w['half_open_closed'] for w in attacked)} closed by the server{closed_after})")
    print(f"server cgroup memory: {base / MiB:.1f} MiB after warm-up; peak {mem_idle:.1f} MiB idle, {mem_hit:.1f} MiB "
          f"attacked; output files: the flood's in its sandbox peaked at {peak_output / MiB:.1f} MiB (on the layer "
          f"store, not the server's memory), the server's state directory {peak_state / 1024:.1f} KiB; "
          f"cgroup peak + output files {mem_hit + peak_output / MiB + peak_state / MiB:.1f} MiB")
    ok_p99 = ratio <= P99_RATIO_TARGET
    ok_mem = mem_hit < SERVER_MIB_TARGET
    print(f"target p99 attacked <= {P99_RATIO_TARGET:g}x idle: {'PASS' if ok_p99 else 'FAIL'} (x{ratio:.2f})")
    print(f"target server < {SERVER_MIB_TARGET} MiB (cgroup peak under attack): {'PASS' if ok_mem else 'FAIL'} "
          f"({mem_hit:.1f} MiB)")
    print(f"errors {len(errors)}, server exit {status}, left behind {left}, server after: {use}")
    for err in errors[:10]:
        print("error:", err)
    report = {"clients": args.clients, "rounds": args.rounds, "window_s": args.window, "seed": args.seed,
              "idle_p50_ms": round(p["idle"][0], 2), "idle_p99_ms": round(p["idle"][1], 2),
              "attacked_p50_ms": round(p["attacked"][0], 2), "attacked_p99_ms": round(p["attacked"][1], 2),
              "p99_ratio": round(ratio, 3), "p99_ratio_per_round": [round(r, 3) for r in per_round],
              "server_cgroup_base_mib": round(base / MiB, 1), "server_cgroup_peak_idle_mib": round(mem_idle, 1),
              "server_cgroup_peak_attacked_mib": round(mem_hit, 1), "flood_output_files_peak_mib":
              round(peak_output / MiB, 1), "state_dir_peak_kib": round(peak_state / 1024, 1),
              "target_p99": ok_p99, "target_memory": ok_mem, "errors": len(errors), "server_exit": status,
              "left_behind": left, "windows": [{k: v for k, v in w.items() if k != "samples"} for w in windows]}
    print(json.dumps({k: v for k, v in report.items() if k != "windows"}))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if not errors and not left and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
