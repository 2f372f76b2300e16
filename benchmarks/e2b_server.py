"""`bunshin serve` under load: N clients of the unmodified e2b Python SDK on loopback, each
creating a sandbox, running `true` in it (timed), forking it and killing both, for S seconds.
Prints cycles, errors, the p50 and p99 of commands.run("true"), and what was left behind.

python benchmarks/e2b_server.py [--clients 32] [--seconds 60] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import e2b_server_support as support

from bunshinfork import state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
