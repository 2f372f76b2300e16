"""The agent of benchmarks/agent_rollouts.py: a seeded stochastic, closed-loop policy over
observation-dependent candidate calls, and the latency model that stands for its reasoning.

LatencyModel: the time a GPU server takes to answer one agent step,

    seconds = first_token_s + prompt_tokens * prefill_s_per_token + output_tokens * tpot(n)

where n is the number of requests in flight on the server when the step starts (this one
included) and tpot(n) interpolates a measured time-per-output-token table linearly. The prompt
tokens are those the server has not seen: vLLM's automatic prefix caching keeps the
conversation so far, so a step pays for the new observation and the previous reply only.
Tokens are counted as characters / 4.

Constants (DEFAULT_LATENCY; printed before every run, never tuned per result):
  tpot(n) and first_token_s: the InferenceBench concurrency sweep of Llama-3.1-8B-Instruct, fp16,
  on one H100-80GB-HBM3 under vLLM 0.21.0 (yobitelcomm.github.io/bench, recipe
  "concurrency-sweep", 2026-05-16): median TPOT 6.48 / 6.59 / 10.94 / 46.91 ms at 1 / 4 / 16 / 64
  concurrent requests, median TTFT 13.98 ms at 1.
  prefill_s_per_token: 0.04 ms, derived, not measured: an 8B dense model needs ~16 GFLOP per
  prompt token, at 40% of the H100's 989 dense bf16 TFLOPS.
  Beyond 64 in flight the table has no measured point: tpot continues the last measured slope
  (16 -> 64), an extrapolation, not a measurement. At the paper's batch (128 requests on one
  H100, PAPER_IN_FLIGHT) that is 94.9 ms per output token, ~11.4 s for a median step.

Regimes (make_server): "paper" prices every step with the paper's batch in flight, whatever
number of rollouts this host runs (the pessimistic bound: the batch never drains); "local" with
this configuration's own requests in flight (at most its rollouts, ~0.9 s steps); "batch" with
the paper's batch as it drains: k of the configuration's N rollouts reasoning stand for k x 128 / N
requests in flight (each local rollout for 128 / N of the paper's, as in the paper's Fig. 8). A
step is priced when it starts and keeps its price, in every regime. The server records each
sample's steps (prompt and output tokens), which the oracle replays (benchmarks/rollouts/oracle.py).

Agent: each decision draws from the candidates the last observation allows (what the test run
failed on, which products a page lists, what is in the cart), the preferred one with
probability 1 - explore(epoch): schedule[epoch] when a schedule is fixed (the last entry
beyond it), else explore0 + drift * epoch. Draws come from a generator
seeded by (seed, epoch, task, sample, step), so a configuration that serves the same
observations makes the same decisions: rewards are comparable one to one.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bunshinfork.templates import CATALOGUE
from bunshinrl.calls.policy import Action, FinalAnswer, SampleContext, Step
from bunshinrl.calls.signature import ToolCall
from bunshinrl.envs import coding, office, swe


@dataclass(frozen=True)
class LatencyModel:
    tpot_table: tuple[tuple[int, float], ...] = ((1, 6.48e-3), (4, 6.59e-3), (16, 10.94e-3), (64, 46.91e-3))
    first_token_s: float = 13.98e-3
    prefill_s_per_token: float = 0.04e-3
    source: str = ("InferenceBench concurrency sweep: Llama-3.1-8B-Instruct fp16, 1x H100-80GB-HBM3, vLLM 0.21.0 "
                   "(TPOT, TTFT); prefill 0.04 ms/token derived (16 GFLOP/token at 40% of 989 TFLOPS)")

    def tpot(self, in_flight: float) -> float:
        """Seconds per output token with `in_flight` requests on the server (linear between the
        measured points, flat below the first, the last slope beyond the last)."""
        pts = self.tpot_table
        n = max(in_flight, pts[0][0])
        for (n0, t0), (n1, t1) in itertools.pairwise(pts):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)

    def seconds(self, prompt_tokens: int, output_tokens: int, in_flight: float) -> float:
        return self.first_token_s + prompt_tokens * self.prefill_s_per_token + output_tokens * self.tpot(in_flight)

    def describe(self) -> str:
        table = ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in self.tpot_table)
        return (f"reasoning = {self.first_token_s * 1e3:.2f} ms + prompt tokens x "
                f"{self.prefill_s_per_token * 1e3:.3f} ms + output tokens x tpot(requests in flight); "
                f"tpot {{{table}}}; source: {self.source}")


DEFAULT_LATENCY = LatencyModel()
PAPER_IN_FLIGHT = 128  # the paper's rollouts, all served by one H100

# Exploration as a GRPO policy's entropy falls: fixed before any run, never changed after one.
# Direction: policy entropy falls monotonically and early under GRPO/REINFORCE/PRIME on LLMs
# (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
# Models", arXiv:2505.22617: -73% within the first 200 of ~2400 steps). The levels mirror the
# earlier rising schedule (0.08, 0.12, 0.16) and continue it.
EXPLORATION = {"decaying": (0.16, 0.12, 0.08, 0.06, 0.04), "constant": (0.08,)}
EXPLORATION_SOURCE = ("Cui et al. 2025, The Entropy Mechanism of Reinforcement Learning for Reasoning Language "
                      "Models, arXiv:2505.22617 (entropy collapses early and monotonically under GRPO)")


def tokens(text: str) -> int:
    return max(1, len(text) // 4)


@dataclass(frozen=True)
class AgentConfig:
    seed: int = 0
    explore0: float = 0.08  # chance of a non-preferred candidate at epoch 0
    drift: float = 0.04  # added per epoch
    output_median: int = 120  # output tokens per decision (lognormal, clipped)
    output_sigma: float = 0.5
    output_max: int = 400
    system_tokens: int = 900  # system prompt + tool schemas of the first request
    schedule: tuple[float, ...] = ()  # exploration per epoch (wins over explore0 + drift)


Candidates = list[Action]  # preferred first


class Server:
    """Requests in flight on the modelled server (one per configuration's run), and the steps it
    answered, per (epoch, task, sample) in the order the samples first reached it."""

    def __init__(self, model: LatencyModel, in_flight: int | None = None, *, batch_of: int | None = None) -> None:
        self.model = model
        self.in_flight = 0
        self.fixed_in_flight = in_flight  # the paper's regime: the batch the server is priced at
        self.batch_of = batch_of  # the batch regime: the configuration's rollouts per epoch (N)
        self.reasoning_seconds: dict[tuple[int, str, int], float] = {}
        self.steps: dict[tuple[int, str, int], list[tuple[int, int]]] = {}

    def load_at(self, reasoning: int) -> float:
        """The requests in flight a step is priced with when `reasoning` of this configuration's
        rollouts reason as it starts (it included): the one function the live server and the
        oracle's replay price with."""
        if self.fixed_in_flight:
            return self.fixed_in_flight
        if self.batch_of:
            return reasoning * PAPER_IN_FLIGHT / self.batch_of
        return reasoning

    def load(self) -> float:
        """The requests in flight a step starting now is priced with (this one included)."""
        return self.load_at(self.in_flight + 1)

    def price(self, prompt_tokens: int, output_tokens: int, reasoning: int) -> float:
        """A step's seconds when it starts with `reasoning` rollouts reasoning (it included)."""
        return self.model.seconds(prompt_tokens, output_tokens, self.load_at(reasoning))

    def predicted_step(self, output_tokens: int, prompt_tokens: int = 200) -> float:
        """A step's seconds at the current load: what the rollout core weighs a capture against."""
        return self.model.seconds(prompt_tokens, output_tokens, self.load())

    def recorded(self, epoch: int) -> list[list[tuple[int, int]]]:
        """Each sample's steps in `epoch`, the samples in the order they first reached the server."""
        return [s for (e, _t, _i), s in self.steps.items() if e == epoch]

    async def answer(self, key: tuple[int, str, int], prompt_tokens: int, output_tokens: int) -> float:
        s = self.model.seconds(prompt_tokens, output_tokens, self.load())
        self.steps.setdefault(key, []).append((prompt_tokens, output_tokens))  # the oracle replays it
        self.in_flight += 1
        try:
            await asyncio.sleep(s)  # the documented latency model, not a tool
        finally:
            self.in_flight -= 1
        self.reasoning_seconds[key] = self.reasoning_seconds.get(key, 0.0) + s
        return s


REGIMES = ("paper", "local", "batch")


def make_server(model: LatencyModel, regime: str, rollouts: int) -> Server:
    """The server of one configuration's run in `regime`; `rollouts`: its rollouts per epoch."""
    if regime == "paper":
        return Server(model, PAPER_IN_FLIGHT)
    if regime == "batch":
        return Server(model, batch_of=rollouts)
    if regime == "local":
        return Server(model)
    raise ValueError(f"unknown regime {regime!r}; use {', '.join(REGIMES)}")


@dataclass
class StochasticAgent:
    """A Policy: candidates from the observations so far, one drawn per decision."""

    cfg: AgentConfig
    server: Server
    families: dict[str, Callable[[str, Sequence[Step]], Candidates]] = field(default_factory=dict)  # by task id

    def rng(self, ctx: SampleContext, step: int) -> random.Random:
        h = hashlib.sha256(f"{self.cfg.seed}|{ctx.epoch}|{ctx.task_id}|{ctx.sample}|{step}".encode()).digest()
        return random.Random(int.from_bytes(h[:8], "big"))

    def explore(self, epoch: int) -> float:
        if self.cfg.schedule:
            return self.cfg.schedule[min(epoch, len(self.cfg.schedule) - 1)]
        return min(0.9, self.cfg.explore0 + self.cfg.drift * epoch)

    def decide(self, ctx: SampleContext, history: Sequence[Step]) -> tuple[Action, int, int]:
        """(action, prompt tokens, output tokens) of the next decision; no time passes."""
        rng = self.rng(ctx, len(history))
        cands = self.families[ctx.task_id](ctx.task_id, history)
        action = rng.choice(cands[1:]) if len(cands) > 1 and rng.random() < self.explore(ctx.epoch) else cands[0]
        drawn = self.cfg.output_median * math.exp(rng.gauss(0, self.cfg.output_sigma))
        out = int(min(self.cfg.output_max, max(20, drawn)))
        prompt = tokens(history[-1].observation) + 40 if history else self.cfg.system_tokens + tokens(ctx.prompt)
        return action, prompt, out

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        action, prompt, out = self.decide(ctx, history)
        await self.server.answer((ctx.epoch, ctx.task_id, ctx.sample), prompt, out)
        return action


# ---- candidates per task family ----

_FAIL = re.compile(r"^FAIL (\w+)\(", re.M)


def coding_candidates(task_id: str, history: Sequence[Step]) -> Candidates:
    """A developer's loop: look around, run the tests, read what failed, edit, test again."""
    seed = int(task_id.rsplit("-", 1)[1])
    c = coding.params(seed)[2]
    calls = [h.call for h in history]
    last = history[-1] if history else None
    C = ToolCall
    if last is None:
        return [C("ls"), C("cat", {"path": "README.md"}), C("run_tests")]
    if last.call.name == "run_tests":
        if last.observation.rstrip().endswith(" 0 failed"):
            return [FinalAnswer("tests pass"), C("cat", {"path": "src/pricing.c"})]
        failed = _FAIL.findall(last.observation)
        if failed:
            return [C("grep", {"pattern": failed[0]}), C("cat", {"path": "src/pricing.c"}),
                    C("cat", {"path": "tests/test_main.c"})]
        return [C("build"), C("cat", {"path": "Makefile"})]
    if last.call.name in ("grep", "cat") and "return x - x % " in last.observation:
        seen = re.search(r"return x - x % (\d+);", last.observation)
        k = int(seen.group(1)) if seen else c
        return [C("edit", {"path": "src/pricing.c", "find": f"x - x % {k}", "replace": f"x - x / {k}"}),
                C("edit", {"path": "src/pricing.c", "find": f"x - x % {k}", "replace": f"x - x / {k + 1}"}),
                C("cat", {"path": "src/pricing.h"})]
    if last.call.name == "edit":
        return [C("run_tests"), C("build"), C("cat", {"path": "src/pricing.c"})]
    if last.call.name == "build":
        return [C("run_tests"), C("ls", {"path": "build"})]
    if sum(c.name == "run_tests" for c in calls) >= 3:
        return [FinalAnswer("giving up")]
    if any(c.name == "edit" for c in calls):
        return [C("run_tests"), C("cat", {"path": "src/pricing.c"})]
    return [C("run_tests"), C("grep", {"pattern": "discount"}), C("cat", {"path": "src/pricing.c"})]


def _name_of(sku: str) -> str:
    return CATALOGUE[sku][0]


def shop_candidates(items: dict[str, int], name: str, address: str) -> Callable[[str, Sequence[Step]], Candidates]:
    """A shopper's loop: search, add what the page lists, check out, read the order."""
    wanted = sorted(items.items())
    others = sorted(s for s in CATALOGUE if s not in items)

    def candidates(_task_id: str, history: Sequence[Step]) -> Candidates:
        C = ToolCall
        added: dict[str, int] = {}
        for h in history:
            m = re.search(r"Added (\d+) \u00d7 (.+?) to your cart", h.observation)
            if m:
                added[m.group(2)] = added.get(m.group(2), 0) + int(m.group(1))
        last = history[-1] if history else None
        if last is not None and "/orders/" in last.observation.split("\n", 1)[0]:
            return [FinalAnswer("ordered")]
        missing = [(s, q - added.get(_name_of(s), 0)) for s, q in wanted if added.get(_name_of(s), 0) < q]
        if last is not None and last.call.name == "fill" and last.call.args.get("selector") == "#ship-address":
            return [C("click", {"selector": "#place-order"}), C("goto", {"url": "/cart"})]
        if last is not None and last.call.name == "fill":
            return [C("fill", {"selector": "#ship-address", "value": address})]
        if not missing:
            if last is not None and "Your cart" in last.observation and "/cart" in last.observation.split("\n", 1)[0]:
                return [C("fill", {"selector": "#ship-name", "value": name}), C("goto", {"url": "/"})]
            return [C("goto", {"url": "/cart"})]
        sku, _ = missing[0]
        product = _name_of(sku)
        if last is not None and last.call.name == "goto" and product in last.observation:
            # The page lists what we want: add it (or, now and then, a neighbour it also lists).
            listed = [_name_of(s) for s in others if _name_of(s) in last.observation]
            return [C("click", {"selector": f"button[aria-label='Add {product} to cart']"})] + \
                [C("click", {"selector": f"button[aria-label='Add {p} to cart']"}) for p in listed[:1]]
        word = product.split()[-1].lower()
        return [C("goto", {"url": f"/search?q={word}"}), C("goto", {"url": f"/search?q={product.split()[0].lower()}"}),
                C("goto", {"url": "/"})]

    return candidates


def gui_candidates(target: str, editor: str = "Mousepad", launch: bool = False,
                   help_page: str = "/root/Desktop/help.html") -> Callable[[str, Sequence[Step]], Candidates]:
    """A desktop user's loop: (launch: start the editor first, or read the help page in
    Chromium) find the editor's window, focus it, replace the text, save, and look at the window
    title again until it no longer says the file is modified."""
    typo = target[:-1] if len(target) > 1 else target + "."

    def candidates(_task_id: str, history: Sequence[Step]) -> Candidates:
        C = ToolCall
        last = history[-1] if history else None
        saved = any(h.call == C("key", {"combo": "ctrl+s"}) for h in history)
        if len(history) >= 12:
            return [FinalAnswer("giving up")]
        started = any(h.call.name == "launch_app" and h.call.args.get("app") == "editor" for h in history)
        if launch and not started:
            # Starting the editor takes real time; reading the help page loads it in Chromium.
            return [C("launch_app", {"app": "editor"}), C("open_page", {"path": help_page})]
        if last is None or last.observation.startswith("ERROR"):
            return [C("list_windows"), C("activate_window", {"title": editor})]
        name, args = last.call.name, last.call.args
        if name == "launch_app":
            return [C("activate_window", {"title": editor}), C("list_windows")]
        if name == "list_windows":
            titles = [line for line in last.observation.splitlines() if editor.lower() in line.lower()]
            if not titles:
                return [C("list_windows")]
            if saved and not any("'*" in t for t in titles):
                return [FinalAnswer("saved"), C("list_windows")]
            if saved:
                return [C("key", {"combo": "ctrl+s"}), C("list_windows")]
            others = [w.split("'")[1] for w in last.observation.splitlines() if "'" in w and w not in titles]
            return [C("activate_window", {"title": editor})] + \
                [C("activate_window", {"title": t}) for t in others[:1]]
        if name == "activate_window":
            if editor.lower() not in last.observation.lower():
                return [C("activate_window", {"title": editor}), C("list_windows")]
            return [C("key", {"combo": "ctrl+a"}), C("key", {"combo": "ctrl+End"})]
        if name == "key" and args.get("combo") == "ctrl+a":
            return [C("type_text", {"text": target}), C("type_text", {"text": typo})]
        if name == "key" and args.get("combo") == "ctrl+End":
            return [C("type_text", {"text": "\n" + target}), C("key", {"combo": "ctrl+a"})]
        if name == "type_text":
            return [C("key", {"combo": "ctrl+s"}), C("list_windows")]
        return [C("list_windows"), C("key", {"combo": "ctrl+s"})]

    return candidates


def _entered(history: Sequence[Step], cell: str, note: str) -> bool:
    """The note was typed into the cell and committed: a goto_cell(cell), then (with no other
    goto_cell between) type_text(note), then a Return."""
    at = None  # where the cursor was last sent, and whether the note was typed there since
    typed = False
    for h in history:
        name, args = h.call.name, h.call.args
        if h.observation.startswith("ERROR"):
            continue
        if name == "goto_cell":
            at, typed = str(args.get("cell", "")).upper(), False
        elif name == "type_text":
            typed = at == cell and args.get("text") == note
        elif name == "key" and typed:
            if args.get("combo") == "Return":
                return True
            typed = False  # Escape (or anything else) leaves the cell as it was
    return False


def office_candidates(cells: Sequence[tuple[str, str]], path: str = office.LEDGER,
                      window: str = "ledger.ods") -> Callable[[str, Sequence[Step]], Candidates]:
    """An office user's loop on LibreOffice Calc: start Calc on the spreadsheet (or, now and then,
    Writer by mistake), look at the windows, for each note go to its cell through the Name Box,
    type it and press Return, save, read the saved cells back, export the PDF, and finish once
    the saved file holds every note and the PDF is exported. The alternatives: a typo, Escape
    instead of Return, a look at the windows, a save or an export too early."""
    refs = ", ".join(c for c, _ in cells)

    def candidates(_task_id: str, history: Sequence[Step]) -> Candidates:
        C = ToolCall
        # The right path is 11 calls; each note typed wrong or cancelled costs 3 more to redo.
        if len(history) >= 20:
            return [FinalAnswer("giving up")]
        open_ = any(h.call.name == "launch_app" and h.call.args.get("path") == path
                    and not h.observation.startswith("ERROR") for h in history)
        if not open_:
            return [C("launch_app", {"app": "calc", "path": path}), C("list_windows"),
                    C("launch_app", {"app": "writer"})]
        last = history[-1]
        name, args = last.call.name, last.call.args
        pending = [(c, n) for c, n in cells if not _entered(history, c, n)]
        # Saved and checked count only after the last edit (an earlier save holds less), the
        # export only after the last save (it converts the file as saved).
        since_edit = history[max((i for i, h in enumerate(history) if h.call.name in ("type_text", "key")
                                  and h.call.args.get("combo") != "ctrl+s"), default=-1) + 1:]
        saves = [i for i, h in enumerate(since_edit) if h.call.name == "save" or h.call.args.get("combo") == "ctrl+s"]
        saved = bool(saves)
        checked = any(h.call.name == "read_cells" and all(f"{c} = {n!r}" in h.observation for c, n in cells)
                      for h in since_edit)
        exported = saved and any(h.call.name == "export_pdf" and h.observation.startswith("exported")
                                 for h in since_edit[saves[-1] + 1:] if saves)
        if last.observation.startswith("ERROR"):
            return [C("list_windows"), C("key", {"combo": "Escape"})]
        if name == "launch_app":
            return [C("list_windows"), C("goto_cell", {"cell": (pending or cells)[0][0]})]
        if name == "list_windows":
            lines = last.observation.splitlines()
            active = next((ln for ln in lines if ln.endswith("[active]")), "")
            if window not in active:
                return [C("activate_window", {"title": window}), C("list_windows")]
        if name == "goto_cell":
            note = dict(cells).get(str(args.get("cell", "")).upper())
            if note is not None:
                return [C("type_text", {"text": note}), C("type_text", {"text": note[:-1]})]
        if name == "type_text":
            return [C("key", {"combo": "Return"}), C("key", {"combo": "Escape"})]
        if pending:
            return [C("goto_cell", {"cell": pending[0][0]}), C("list_windows"), C("save")]
        if not saved:
            return [C("save"), C("export_pdf", {"path": path})]
        if not checked:
            return [C("read_cells", {"path": path, "cells": refs}), C("export_pdf", {"path": path})]
        if not exported:
            return [C("export_pdf", {"path": path}), FinalAnswer("saved")]
        return [FinalAnswer("saved and exported"), C("list_windows")]

    return candidates


_FAILED_TEST = re.compile(r"^FAILED " + swe.TESTS + r"/(test_\w+\.py)::(?:\w+::)?test_(\w+)", re.M)
_PASSED = re.compile(r"^\d+ passed", re.M)


def swe_candidates(task_id: str, history: Sequence[Step]) -> Candidates:
    """A developer's loop on a real project: run the tests, find the function the first failing
    test names, edit what is wrong in it (the task's bug, bunshinrl.envs.swe.BUGS: what a
    developer would see reading it), run the failing file, then the tests again."""
    rel, good, bad, _test = swe.BUGS[int(task_id.rsplit("-", 1)[1]) % len(swe.BUGS)]
    C = ToolCall
    last = history[-1] if history else None
    failing = [m for h in history if h.call.name == "run_tests" for m in _FAILED_TEST.findall(h.observation)]
    if last is None:
        return [C("run_tests"), C("ls", {"path": "mpmath"})]
    if len(history) >= 12:
        return [FinalAnswer("giving up")]
    if last.call.name == "run_tests":
        found = _FAILED_TEST.search(last.observation)
        if found:
            return [C("grep", {"pattern": f"def {found.group(2)}("}), C("run_tests", {"path": found.group(1)})]
        if _PASSED.search(last.observation):
            return [C("run_tests"), FinalAnswer("fixed")] if last.call.args.get("path") else [FinalAnswer("tests pass")]
        return [C("run_tests"), C("ls", {"path": "mpmath"})]
    if last.call.name in ("grep", "cat") and bad in last.observation:
        return [C("edit", {"path": rel, "find": bad, "replace": good}), C("cat", {"path": rel})]
    if last.call.name == "edit" and failing:
        return [C("run_tests", {"path": failing[-1][0]}), C("run_tests")]
    if failing:
        return [C("grep", {"pattern": f"def {failing[-1][1]}("}), C("run_tests")]
    return [C("run_tests"), C("grep", {"pattern": "def "})]
