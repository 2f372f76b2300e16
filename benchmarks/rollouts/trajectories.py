"""Each sample's trajectory as the run saw it, and where two configurations' trajectories part.

The agent is seeded by (seed, epoch, task, sample, step) and decides from the observations alone,
so two configurations whose samples were shown the same observations make the same calls. Where
a sample's trajectories part, the first step that differs says why: the same call observed
something else (a tool whose result depends on when it runs, or a served observation that a real
call would not have given), or another call after the same observations (the agent's inputs
differed elsewhere). Observations are kept as digests: the row stays small.
"""

from __future__ import annotations

import hashlib
from typing import Any

from bunshinrl import EpochResult


def digests(r: EpochResult) -> dict[str, list[list[str]]]:
    """Per sample (task/sample), each step's call, what served it and its observation's digest."""
    out = {}
    for s in r.samples:
        served = s.served + [""] * (len(s.steps) - len(s.served))
        out[f"{s.task_id}/{s.sample}"] = [
            [st.call.key, how, hashlib.sha256(st.observation.encode()).hexdigest()[:12]]
            for st, how in zip(s.steps, served, strict=False)]
    return out


def first_difference(a: list[list[str]], b: list[list[str]]) -> dict[str, Any] | None:
    """Where trajectory b first parts from a (None: the same calls and observations)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x[0] != y[0]:
            return {"step": i, "kind": "call", "calls": [x[0], y[0]], "served": [x[1], y[1]]}
        if x[2] != y[2]:
            return {"step": i, "kind": "observation", "call": x[0], "served": [x[1], y[1]]}
    if len(a) != len(b):
        return {"step": min(len(a), len(b)), "kind": "length", "steps": [len(a), len(b)]}
    return None


def compare(base: list[dict[str, list[list[str]]]], other: list[dict[str, list[list[str]]]]) -> dict[str, Any]:
    """Per epoch, the samples whose trajectory in `other` parts from `base`'s, at its first
    difference, and the counts by kind (observation first: the case that asks for a reason)."""
    epochs = []
    for a, b in zip(base, other, strict=False):
        parted = {k: d for k in sorted(a.keys() & b.keys()) if (d := first_difference(a[k], b[k])) is not None}
        epochs.append(parted)
    kinds = [d["kind"] for e in epochs for d in e.values()]
    return {"samples_parted": sum(len(e) for e in epochs),
            "by_kind": {k: kinds.count(k) for k in ("observation", "call", "length")},
            "per_epoch": epochs}


def report(parted: dict[str, Any]) -> None:
    """Print compare()'s results against the reference configuration, each parted sample's first
    difference on a line."""
    ref = parted["reference"]
    for n, c in parted.items():
        if n == "reference":
            continue
        kinds = ", ".join(f"{k} {v}" for k, v in c["by_kind"].items())
        print(f"  trajectories of {n} against {ref}: {c['samples_parted']} samples parted ({kinds})", flush=True)
        for e, samples in enumerate(c["per_epoch"]):
            for k, d in samples.items():
                print(f"    epoch {e} {k}: {d}", flush=True)
