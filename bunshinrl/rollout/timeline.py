"""Per-sample timelines and per-epoch results of a rollout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..calls.policy import Step
from ..calls.signature import ToolCall
from ..calls.task import REWARD_TOOL
from ..speculation.selector import Trajectory

# reason: the policy generating; tool: a real call on the critical path; cache_hit / spec_hit:
# a call served without running it then (the span is any wait for a call still in flight);
# materialize: rebuilding a cached state on a miss; audit: a re-execution checking a hit;
# post_wait: the next call waiting for the previous one's capture or speculative fork;
# sibling_wait: a call served by waiting for the same call a sibling was running (it skipped no
# work of the sample's own, so it is no hit).
KINDS = ("reason", "tool", "cache_hit", "spec_hit", "spec_miss", "materialize", "audit", "setup", "post_wait",
         "sibling_wait")
_VERIFIER_KEY = ToolCall(REWARD_TOOL).key
DIVERGENCE_KINDS = ("mid_plan", "removed_node", "speculation", "sibling_race")
# What became of each divergence (SampleTimeline.divergence_outcomes): rewound, the sample's
# verified rebuild met the step and the driver acted again from it; refused, so met by a driver
# that cannot rewind (the trajectory is scored nothing); rerolled, the framework ran the whole
# trajectory again with the cache off; node_refused, the sample's own run of a call another
# sample recorded first observed something else (the begin() race, or an adopted speculative
# call): it keeps what it ran and is not placed on that node; destroyed_rewound /
# destroyed_reproduced, a warm workspace's replay diverged, the workspace was destroyed, and the
# sample's next verified state then rewound it (a divergence of its own, counted again) or
# reproduced every step it was served (its state forked from one the recording sample captured);
# unresolved, the sample closed with a destroyed warm workspace it never verified (0 in a run
# whose samples all finished).
DIVERGENCE_OUTCOMES = ("rewound", "refused", "rerolled", "node_refused", "destroyed_rewound",
                       "destroyed_reproduced", "unresolved")


@dataclass
class Event:
    kind: str
    start: float
    end: float
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class SampleTimeline:
    task_id: str
    sample: int
    epoch: int
    started: float = 0.0
    finished: float = 0.0
    events: list[Event] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    # Per step, what served it (Rollout.served: executed, cache, speculation, rejected): the
    # audit names it beside a step that did not reproduce.
    served: list[str] = field(default_factory=list)
    answer: str | None = None  # the agent's final text; None when its budget or an error ended it
    reward: float | None = None  # the task's verifier on the final state, when it has one
    errors: list[str] = field(default_factory=list)
    wasted_seconds: float = 0.0  # speculative execution whose result was discarded
    # The invariant (a sample's workspace is exactly the history it was shown) at work: replays
    # on this sample's behalf that observed something else than it was served, and the seconds
    # rebuilding a verified state took after one; rewinds (the history cut back to a step that
    # did not reproduce), the steps they dropped and the seconds those steps had taken; re-rolls
    # (a framework's whole trajectory run again with the cache off).
    divergences: int = 0
    divergence_seconds: float = 0.0
    rewound: int = 0
    rewound_steps: int = 0
    rewound_seconds: float = 0.0
    rerolled: int = 0
    # The divergences by kind (flags, not exclusive: one divergence may be of several kinds):
    # mid_plan, at a replayed call after the first on its workspace (a rebuild's plan past its
    # first step, a warm workspace that had replayed a call already); removed_node, while the node
    # replayed to was already dropped (a sample revalidated under an invalidated subtree);
    # speculation, one that stopped a speculative chain meant for the warm workspace or was met
    # adopting a speculative hit; sibling_race, the sample's own run of a call another sample
    # recorded first (cache.begin's race) observing something else.
    divergences_mid_plan: int = 0
    divergences_removed_node: int = 0
    divergences_speculation: int = 0
    divergences_sibling_race: int = 0
    # Per divergence, in order, its outcome (DIVERGENCE_OUTCOMES; None while a destroyed warm
    # workspace awaits the sample's verified state) and whether it is flagged speculation.
    divergence_outcomes: list[str | None] = field(default_factory=list)
    _speculation_flagged: set[int] = field(default_factory=set, init=False, repr=False)
    # The chances a run had to meet the rarer kinds: a sample's own run of an agent's call
    # compared with another sample's recording of it (the begin() race, or an adopted speculative
    # call); speculation_checks, a speculative chain meant for a warm workspace that replays a
    # served call (a fork of a captured state cannot diverge), or an adopted speculative call so
    # compared.
    sibling_checks: int = 0
    speculation_checks: int = 0

    def diverged(self, *, mid_plan: bool = False, removed_node: bool = False, speculation: bool = False,
                 sibling_race: bool = False, outcome: str | None = None) -> int:
        """Count one divergence, with its kinds and its outcome (None: settled later by
        settle_divergences); its index."""
        if outcome is not None and outcome not in DIVERGENCE_OUTCOMES:
            raise ValueError(f"a divergence's outcome is one of {DIVERGENCE_OUTCOMES}, not {outcome!r}")
        self.divergences += 1
        self.divergences_mid_plan += mid_plan
        self.divergences_removed_node += removed_node
        self.divergences_sibling_race += sibling_race
        self.divergence_outcomes.append(outcome)
        i = len(self.divergence_outcomes) - 1
        if speculation:
            self.flag_speculation(i)
        return i

    def flag_speculation(self, index: int) -> None:
        """Divergence `index` (already counted) is of the speculation kind too; flagged once."""
        if index not in self._speculation_flagged:
            self._speculation_flagged.add(index)
            self.divergences_speculation += 1

    def settle_divergences(self, outcome: str) -> None:
        """Every divergence still without an outcome (a destroyed warm workspace) gets `outcome`."""
        if outcome not in DIVERGENCE_OUTCOMES:
            raise ValueError(f"a divergence's outcome is one of {DIVERGENCE_OUTCOMES}, not {outcome!r}")
        self.divergence_outcomes = [outcome if o is None else o for o in self.divergence_outcomes]

    def rerolled_by_framework(self) -> None:
        """This attempt was discarded and its trajectory rolled again with the cache off (verl):
        what the rollout refused was re-rolled."""
        self.divergence_outcomes = ["rerolled" if o == "refused" else o for o in self.divergence_outcomes]

    def set_last_outcome(self, outcome: str) -> None:
        """The outcome of the divergence counted last (a rewind's, once the driver is known)."""
        if outcome not in DIVERGENCE_OUTCOMES:
            raise ValueError(f"a divergence's outcome is one of {DIVERGENCE_OUTCOMES}, not {outcome!r}")
        self.divergence_outcomes[-1] = outcome

    def add(self, kind: str, start: float, end: float, detail: str = "") -> None:
        self.events.append(Event(kind, start, end, detail))

    def count(self, kind: str) -> int:
        return sum(e.kind == kind for e in self.events)

    def agent_count(self, kind: str) -> int:
        """Events of `kind` for the agent's own calls (the hidden verifier's call left out)."""
        return sum(e.kind == kind and e.detail != _VERIFIER_KEY for e in self.events)

    def seconds(self, kind: str) -> float:
        return sum(e.seconds for e in self.events if e.kind == kind)

    @property
    def tool_calls(self) -> int:
        return len(self.steps)

    @property
    def agent_calls(self) -> int:
        """The agent's tool calls: the hidden verifier's call is not one."""
        return sum(s.call.name != REWARD_TOOL for s in self.steps)

    def summary(self) -> dict[str, Any]:
        return {
            "task": self.task_id, "sample": self.sample, "finished": round(self.finished, 3),
            "tool_calls": self.tool_calls, "cache_hits": self.count("cache_hit"), "spec_hits": self.count("spec_hit"),
            "real_calls": self.count("tool"), "reasoning_seconds": round(self.seconds("reason"), 3),
            "tool_seconds": round(self.seconds("tool"), 3),
            "wait_seconds": round(sum(self.seconds(k) for k in ("cache_hit", "spec_hit", "spec_miss",
                                                                 "materialize", "post_wait")), 3),
            "waits": {k: round(self.seconds(k), 3) for k in ("cache_hit", "spec_hit", "spec_miss",
                                                             "materialize", "post_wait")},
            "wasted_seconds": round(self.wasted_seconds, 3), "reward": self.reward, "errors": list(self.errors),
            **self.invariant(),
        }

    def invariant(self) -> dict[str, Any]:
        """The divergence counters (see the fields)."""
        return {"divergences": self.divergences, "divergence_seconds": round(self.divergence_seconds, 3),
                "rewound": self.rewound, "rewound_steps": self.rewound_steps,
                "rewound_seconds": round(self.rewound_seconds, 3), "rerolled": self.rerolled,
                **{f"divergences_{k}": v for k, v in self.divergence_kinds().items()},
                **{f"outcome_{k}": v for k, v in self.outcomes().items()},
                "divergences_unaccounted": self.divergences - sum(self.outcomes().values()),
                "sibling_checks": self.sibling_checks, "speculation_checks": self.speculation_checks}

    def outcomes(self) -> dict[str, int]:
        """The divergences by outcome (DIVERGENCE_OUTCOMES); they sum to `divergences` when every
        divergence has one (divergences_unaccounted 0)."""
        return {k: sum(o == k for o in self.divergence_outcomes) for k in DIVERGENCE_OUTCOMES}

    def divergence_kinds(self) -> dict[str, int]:
        """The divergences by kind (see the fields): mid_plan, removed_node, speculation, sibling_race."""
        return {k: getattr(self, f"divergences_{k}") for k in DIVERGENCE_KINDS}


@dataclass
class EpochResult:
    epoch: int
    seconds: float
    samples: list[SampleTimeline]
    memory: list[tuple[float, int, int]]  # (time, workspace PSS bytes, resident cache bytes)
    cache: dict[str, Any] | None = None
    speculation: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None

    teardown_seconds: float = 0.0  # after the last rollout: its workspaces torn down, branches discarded

    @property
    def tool_calls(self) -> int:
        """The agents' tool calls (the hidden verifier's call is not counted)."""
        return sum(s.agent_calls for s in self.samples)

    @property
    def cache_hits(self) -> int:
        return sum(s.agent_count("cache_hit") for s in self.samples)

    @property
    def sibling_waits(self) -> int:
        """Calls served by waiting for a sibling's running call (not hits)."""
        return sum(s.agent_count("sibling_wait") for s in self.samples)

    @property
    def spec_hits(self) -> int:
        return sum(s.agent_count("spec_hit") for s in self.samples)

    @property
    def hit_rate(self) -> float:
        """Share of the agents' tool calls served from a cached state or a speculative fork (a
        wait for a sibling's running call is not a hit)."""
        return (self.cache_hits + self.spec_hits) / self.tool_calls if self.tool_calls else 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return max((w + c for _, w, c in self.memory), default=0)

    @property
    def peak_workspace_bytes(self) -> int:
        return max((w for _, w, _ in self.memory), default=0)

    @property
    def memory_byte_seconds(self) -> float:
        """Total memory over the epoch: the time integral of workspace plus cache bytes."""
        total = 0.0
        for (t0, w0, c0), (t1, _w1, _c1) in zip(self.memory, self.memory[1:], strict=False):
            total += (w0 + c0) * (t1 - t0)
        return total

    @property
    def wasted_seconds(self) -> float:
        return sum(s.wasted_seconds for s in self.samples)

    @property
    def divergences(self) -> int:
        """Replays that observed something else than a sample was served (each one refused:
        its workspace destroyed, the sample rebuilt and verified, rewound when a step failed)."""
        return sum(s.divergences for s in self.samples)

    @property
    def rewound(self) -> int:
        return sum(s.rewound for s in self.samples)

    @property
    def rerolled(self) -> int:
        return sum(s.rerolled for s in self.samples)

    @property
    def divergence_kinds(self) -> dict[str, int]:
        """The samples' divergences by kind, summed (SampleTimeline.divergence_kinds)."""
        return {k: sum(s.divergence_kinds()[k] for s in self.samples) for k in DIVERGENCE_KINDS}

    @property
    def divergence_outcomes(self) -> dict[str, int]:
        """The samples' divergences by outcome, summed (SampleTimeline.outcomes)."""
        return {k: sum(s.outcomes()[k] for s in self.samples) for k in DIVERGENCE_OUTCOMES}

    def invariant(self) -> dict[str, Any]:
        """The samples' divergence counters summed (SampleTimeline.invariant)."""
        out = SampleTimeline("", 0, 0).invariant()
        for s in self.samples:
            for k, v in s.invariant().items():
                out[k] += v
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}

    def trajectories(self) -> list[Trajectory]:
        return [Trajectory(self.epoch, s.task_id, s.sample, tuple(st.call for st in s.steps), s.answer is not None)
                for s in self.samples]

    def observations(self) -> dict[str, list[str]]:
        return {f"{s.task_id}/{s.sample}": [st.observation for st in s.steps] for s in self.samples}

    def running_over_time(self, points: int = 200) -> list[tuple[float, int]]:
        """How many rollouts are still running, sampled over the epoch (paper Fig. 8)."""
        ends = sorted(s.finished for s in self.samples)
        out = []
        for i in range(points + 1):
            t = self.seconds * i / points
            out.append((t, sum(e > t for e in ends)))
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "seconds": round(self.seconds, 3), "tool_calls": self.tool_calls,
            "cache_hits": self.cache_hits, "spec_hits": self.spec_hits, "hit_rate": round(self.hit_rate, 4),
            "peak_memory_bytes": self.peak_memory_bytes, "peak_workspace_bytes": self.peak_workspace_bytes,
            "memory_byte_seconds": round(self.memory_byte_seconds), "wasted_seconds": round(self.wasted_seconds, 3),
            "cache": self.cache, "speculation": self.speculation, "guard": self.guard, **self.invariant(),
        }
