"""A seeded generator of agent traces over the workload's tools, and a policy that replays them.

Per task the policy has a preferred next call given the step and the previous call, and a
couple of alternatives; GRPO samples of one group draw from the same distribution, so they
share prefixes and diverge at random points. Across epochs the policy drifts: the chance that a
step emits a call never made before grows with the epoch, so later epochs repeat earlier calls
with decreasing probability. Reasoning delays are drawn per step. Every configuration replays
the same traces, so their observations can be compared one to one.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from . import workload
from .policy import Action, FinalAnswer, SampleContext, Step
from .signature import ToolCall


@dataclass(frozen=True)
class TraceConfig:
    tasks: int = 3
    group_size: int = 4
    epochs: int = 3
    seed: int = 0
    min_steps: int = 8
    max_steps: int = 9
    p_main: float = 0.9  # chance of the preferred call at a step
    p_main_early: float = 0.97  # ... during the first early_steps (agents explore alike at first)
    early_steps: int = 4
    drift: float = 0.02  # per epoch after the first: added chance of a never-seen call per step
    think_median: float = 0.6  # seconds of reasoning before a call
    think_sigma: float = 0.45
    think_max: float = 2.0


@dataclass(frozen=True)
class TraceStep:
    think: float  # reasoning seconds before the policy emits this action
    call: ToolCall | None  # None: the final answer


@dataclass(frozen=True)
class Trace:
    epoch: int
    task_id: str
    sample: int
    steps: tuple[TraceStep, ...]

    @property
    def calls(self) -> list[ToolCall]:
        return [s.call for s in self.steps if s.call is not None]


def _pools(seed: int) -> list[list[ToolCall]]:
    """What the policy considers at each step, preferred-by-default first."""
    fx = workload.fixes(seed)
    C = ToolCall
    return [
        [C("ls", {"path": "."}), C("cat", {"path": "README.md"}), C("ls", {"path": "app"})],
        [C("cat", {"path": "app/core.py"}), C("cat", {"path": "tests/cases.txt"}), C("grep", {"pattern": "def "})],
        [C("run_tests", {"target": "all"}), C("build", {"target": "all"}), C("run_tests", {"target": "core"})],
        [C("build", {"target": "all"}), C("start_server"), C("grep", {"pattern": "discount"})],
        [C("start_server"), C("query", {"path": "/stats"}), C("sql", {"query": "select count(*) from items"})],
        [C("query", {"path": "/report"}), C("query", {"path": "/stats"}), C("cat", {"path": "app/core.py"})],
        [C("edit", fx[0]), C("edit", fx[1]), C("grep", {"pattern": "score"})],
        [C("run_tests", {"target": "all"}), C("query", {"path": "/report"}), C("run_tests", {"target": "core"})],
        [C("query", {"path": "/stats"}), C("sql", {"query": "select max(price) from items"}),
         C("query", {"path": "/report"})],
    ]


def _novel(rng: random.Random) -> ToolCall:
    word = rng.choice(workload.WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        return ToolCall("grep", {"pattern": word})
    if kind == 1:
        return ToolCall("query", {"path": f"/search?q={word}"})
    if kind == 2:
        return ToolCall("lookup", {"key": f"k{64 * rng.randrange(100)}"})
    return ToolCall("sql", {"query": f"select count(*) from items where name like '{word}%'"})


def _rotation(seed: int, step: int, last: ToolCall | None) -> int:
    # The preferred call depends on the previous one, so a sample that deviated keeps deviating
    # in its own consistent way rather than snapping back to the main path.
    h = hashlib.sha256(f"{seed}|{step}|{last.key if last else ''}".encode()).digest()
    return 0 if last is None or h[0] < 180 else h[1]


def task_ids(cfg: TraceConfig) -> list[str]:
    return [f"task{i}" for i in range(cfg.tasks)]


def task_seed(cfg: TraceConfig, i: int) -> int:
    return cfg.seed * 1000 + i


def generate(cfg: TraceConfig) -> dict[tuple[int, str, int], Trace]:
    """Traces for every (epoch, task id, sample)."""
    out = {}
    for e in range(cfg.epochs):
        for ti, tid in enumerate(task_ids(cfg)):
            pools = _pools(task_seed(cfg, ti))
            for s in range(cfg.group_size):
                rng = random.Random(f"{cfg.seed}|{e}|{tid}|{s}")
                length = rng.randint(cfg.min_steps, cfg.max_steps)
                steps: list[TraceStep] = []
                last: ToolCall | None = None
                for i in range(length):
                    pool = pools[min(i, len(pools) - 1)]
                    r = _rotation(task_seed(cfg, ti), i, last)
                    order = pool[r % len(pool):] + pool[:r % len(pool)]
                    u = rng.random()
                    if u < cfg.drift * e:
                        call = _novel(rng)
                    elif rng.random() < (cfg.p_main_early if i < cfg.early_steps else cfg.p_main):
                        call = order[0]
                    else:
                        call = rng.choice(order[1:])
                    steps.append(TraceStep(_think(rng, cfg), call))
                    last = call
                steps.append(TraceStep(_think(rng, cfg), None))
                out[(e, tid, s)] = Trace(e, tid, s, tuple(steps))
    return out


def _think(rng: random.Random, cfg: TraceConfig) -> float:
    return min(cfg.think_max, max(0.1, cfg.think_median * math.exp(rng.gauss(0, cfg.think_sigma))))


def prefix_hit_rates(traces: dict[tuple[int, str, int], Trace], epochs: int) -> list[float]:
    """Share of calls per epoch whose whole prefix an earlier epoch already made: the cache hit
    rate a prefix cache could reach from earlier epochs alone (same-epoch siblings add more)."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    rates = []
    for e in range(epochs):
        hits = total = 0
        new = set()
        for (ep, tid, _s), tr in sorted(traces.items()):
            if ep != e:
                continue
            prefix: tuple[str, ...] = ()
            for c in tr.calls:
                prefix = (*prefix, c.key)
                total += 1
                hits += (tid, prefix) in seen
                new.add((tid, prefix))
        seen |= new
        rates.append(hits / total if total else 0.0)
    return rates


class ReplayPolicy:
    """Replays generated traces, sleeping for each step's reasoning time (scaled by time_scale)."""

    def __init__(self, traces: dict[tuple[int, str, int], Trace], time_scale: float = 1.0) -> None:
        self.traces = traces
        self.time_scale = time_scale

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        trace = self.traces[(ctx.epoch, ctx.task_id, ctx.sample)]
        step = trace.steps[min(len(history), len(trace.steps) - 1)]
        await asyncio.sleep(step.think * self.time_scale)
        if step.call is None or len(history) >= len(trace.steps) - 1:
            return FinalAnswer("done")
        return step.call
