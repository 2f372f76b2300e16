"""The pieces of benchmarks/agent_rollouts.py: the latency model's arithmetic, the agent's
determinism per seed and its dependence on observations, and one tiny real run of one
configuration on the coding task (real gcc/make in a real workspace, under the leak check)."""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from pathlib import Path

import pytest
from helpers import load_by_path

from bunshinrl import RolloutEngine
from bunshinrl.calls.policy import FinalAnswer, SampleContext, Step
from bunshinrl.calls.signature import ToolCall
from bunshinrl.envs import coding

# Loaded by its path: putting benchmarks/ on sys.path would shadow the tests' own `workloads`
# package with benchmarks/workloads.py for every test module collected after this one.
agent_policy = load_by_path("agent_policy", "benchmarks/agent_policy.py", register=True)
DEFAULT_LATENCY = agent_policy.DEFAULT_LATENCY
AgentConfig = agent_policy.AgentConfig
LatencyModel = agent_policy.LatencyModel
Server = agent_policy.Server
StochasticAgent = agent_policy.StochasticAgent
coding_candidates = agent_policy.coding_candidates
gui_candidates = agent_policy.gui_candidates
shop_candidates = agent_policy.shop_candidates
oracle = load_by_path("rollouts_oracle", "benchmarks/rollouts/oracle.py")
contention = load_by_path("rollouts_contention", "benchmarks/rollouts/contention.py")
trajectories = load_by_path("rollouts_trajectories", "benchmarks/rollouts/trajectories.py")
# tpot(n) = n ms from 1 to 128 in flight, nothing else priced: hand-computable steps.
LINEAR = LatencyModel(tpot_table=((1, 1e-3), (128, 128e-3)), first_token_s=0.0, prefill_s_per_token=0.0)


def test_latency_model_arithmetic() -> None:
    m = DEFAULT_LATENCY
    assert m.tpot(1) == pytest.approx(6.48e-3)
    assert m.tpot(0) == pytest.approx(6.48e-3)  # flat below the first measured point
    assert m.tpot(16) == pytest.approx(10.94e-3)
    assert m.tpot(10) == pytest.approx(6.59e-3 + (10.94e-3 - 6.59e-3) * 6 / 12)
    slope = (46.91e-3 - 10.94e-3) / 48
    assert m.tpot(80) == pytest.approx(46.91e-3 + slope * 16)  # the last slope beyond the table
    assert m.seconds(1000, 100, 1) == pytest.approx(13.98e-3 + 1000 * 0.04e-3 + 100 * 6.48e-3)
    assert "H100" in m.describe() and "vLLM" in m.describe()


def test_paper_regime_prices_every_step_with_the_papers_batch() -> None:
    """128 requests in flight whatever this host runs: tpot continues the table's last slope
    (~95 ms per output token), a median step ~11 s; the local regime prices its own load."""
    m = DEFAULT_LATENCY
    assert m.tpot(agent_policy.PAPER_IN_FLIGHT) == pytest.approx(94.87e-3, abs=0.05e-3)
    paper, local = Server(m, agent_policy.PAPER_IN_FLIGHT), Server(m)
    assert paper.load() == 128 and local.load() == 1
    assert 11.0 < paper.predicted_step(120) < 12.0
    assert local.predicted_step(120) < 1.0

    async def one(server: Server) -> float:
        return await server.answer((0, "t", 0), 10, 1)  # one token: the step's pricing, quickly

    assert asyncio.run(one(paper)) == pytest.approx(m.seconds(10, 1, 128))


def test_batch_regime_prices_a_draining_batch() -> None:
    """k of N rollouts reasoning stand for k x 128 / N requests in flight: all N reasoning is the
    paper's batch, one alone is 128 / N of it; a step keeps the price it started with."""
    m = DEFAULT_LATENCY
    batch = agent_policy.make_server(m, "batch", 8)
    assert batch.load_at(8) == 128 and batch.load_at(1) == 16 and batch.load() == 16
    assert batch.price(200, 120, 8) == pytest.approx(m.seconds(200, 120, 128))  # ~11.4 s
    assert batch.price(200, 120, 1) == pytest.approx(m.seconds(200, 120, 16))  # ~1.34 s
    assert agent_policy.make_server(m, "batch", 24).load_at(1) == pytest.approx(128 / 24)
    assert agent_policy.make_server(m, "paper", 8).load_at(1) == 128
    assert agent_policy.make_server(m, "local", 8).load_at(3) == 3
    with pytest.raises(ValueError):
        agent_policy.make_server(m, "fixed", 8)

    server = agent_policy.make_server(LINEAR, "batch", 4)  # 32 ms per token per rollout reasoning

    async def drain() -> tuple[list[float], float]:
        three = await asyncio.gather(*(server.answer((0, "t", i), 0, 1) for i in range(3)))
        alone = await server.answer((0, "t", 3), 0, 1)  # the batch has drained: priced alone
        return three, alone

    three, alone = asyncio.run(drain())
    assert three == [pytest.approx(0.032), pytest.approx(0.064), pytest.approx(0.096)]
    assert alone == pytest.approx(0.032)
    assert server.recorded(0) == [[(0, 1)]] * 4 and server.recorded(1) == []


def test_oracle_replays_the_recorded_steps_by_hand() -> None:
    """Two samples, N = 2 in the batch regime (tpot 64 ms per rollout reasoning), hand-computed:
    A starts first, alone: 10 tokens x 64 ms = 0.64 s; B joins it: 4 x 128 ms = 0.512 s, and
    finishes; A's second step starts alone at 0.64 s: 20 x 64 ms = 1.28 s, so A ends at 1.92 s."""
    batch = agent_policy.make_server(LINEAR, "batch", 2)
    steps = [[(0, 10), (0, 20)], [(0, 4)]]
    assert oracle.replay(steps, batch.price) == pytest.approx(1.92)
    # A pause of 0.1 s after A's first step: its second starts at 0.74 s, still alone.
    assert oracle.replay(steps, batch.price, [[0.1, 0.0], [0.0]]) == pytest.approx(2.02)
    # The paper's fixed batch: every token at 128 ms, the replay is A's reasoning alone.
    paper = agent_policy.make_server(LINEAR, "paper", 2)
    assert oracle.replay(steps, paper.price) == pytest.approx(30 * 0.128)
    # Steps ending at an instant are counted out before the steps starting then are priced: both
    # first steps end at 128 ms (2 x 64 ms alone, 1 x 128 ms beside it), and the first sample's
    # next step starts alone (64 ms, to 192 ms), not beside the step ending with it (to 256 ms).
    tie = [[(0, 2), (0, 1)], [(0, 1)]]
    assert oracle.replay(tie, batch.price) == pytest.approx(0.192)
    assert oracle.replay([], batch.price) == 0.0 and oracle.replay([[]], batch.price) == 0.0


def _random_epoch(rng: random.Random) -> tuple[list[list[tuple[int, int]]], list[list[float]]]:
    samples = [[(rng.randint(50, 900), rng.randint(20, 400)) for _ in range(rng.randint(1, 12))]
               for _ in range(rng.choice([1, 2, 3, 6, 8]))]
    pauses = [[rng.choice([0.0, 0.005, rng.expovariate(0.5)]) for _ in s] for s in samples]
    return samples, pauses


def test_oracle_never_exceeds_a_run_where_the_load_does_not_price_a_step() -> None:
    """With every tool at 0 s the replay is the longest sample's reasoning when the price does
    not depend on the load (the paper regime), so no run with tools ends before it; nor with a
    single rollout, in any regime."""
    rng = random.Random(38)
    for _ in range(300):
        samples, pauses = _random_epoch(rng)
        paper = agent_policy.make_server(DEFAULT_LATENCY, "paper", len(samples))
        free = oracle.replay(samples, paper.price)
        assert free == pytest.approx(max(sum(paper.price(p, o, 1) for p, o in s) for s in samples))
        assert free <= oracle.replay(samples, paper.price, pauses) + 1e-9
        for regime in ("batch", "local"):
            server = agent_policy.make_server(DEFAULT_LATENCY, regime, 1)
            assert oracle.replay(samples[:1], server.price) <= oracle.replay(samples[:1], server.price,
                                                                              pauses[:1]) + 1e-9


def test_oracle_is_no_bound_where_a_pause_drains_the_batch() -> None:
    """Prices fixed at a step's start: B's tool pause leaves A's long step alone in the batch, so
    the run with the pause ends before the replay with free tools (docs/rl_rollouts_method.md:
    such epochs are flagged, oracle_exceeds_epoch, never clipped)."""
    batch = agent_policy.make_server(LINEAR, "batch", 2)
    steps = [[(0, 1), (0, 1)], [(0, 1), (0, 30)]]  # B first, then A
    # Free tools: B 64 ms, A joins (128 ms); B's second step with A reasoning (128 ms, to 192 ms);
    # A's 30 tokens start at 128 ms with B reasoning: x 128 ms, to 3.968 s.
    assert oracle.replay(steps, batch.price) == pytest.approx(3.968)
    # B pauses 1 s: A's 30 tokens start alone at 128 ms (x 64 ms), the run ends at 2.048 s.
    assert oracle.replay(steps, batch.price, [[1.0, 0.0], [0.0, 0.0]]) == pytest.approx(2.048)


def test_exploration_schedule_is_fixed_per_epoch() -> None:
    a = StochasticAgent(AgentConfig(schedule=agent_policy.EXPLORATION["decaying"]), Server(DEFAULT_LATENCY), {})
    assert [a.explore(e) for e in range(6)] == [0.16, 0.12, 0.08, 0.06, 0.04, 0.04]
    c = StochasticAgent(AgentConfig(schedule=agent_policy.EXPLORATION["constant"]), Server(DEFAULT_LATENCY), {})
    assert {c.explore(e) for e in range(5)} == {0.08}
    assert "2505.22617" in agent_policy.EXPLORATION_SOURCE


def _agent(seed: int, drift: float = 0.04) -> StochasticAgent:
    return StochasticAgent(AgentConfig(seed=seed, drift=drift), Server(DEFAULT_LATENCY),
                           {"code-fix-0": coding_candidates})


def test_agent_is_deterministic_per_seed_and_drifts() -> None:
    hist = [Step(ToolCall("ls"), "./Makefile\n./src")]
    decisions = {s: [_agent(s).decide(SampleContext("code-fix-0", i, e), hist) for e in range(6) for i in range(8)]
                 for s in (0, 1)}
    assert decisions[0] == [_agent(0).decide(SampleContext("code-fix-0", i, e), hist)
                            for e in range(6) for i in range(8)]
    assert decisions[0] != decisions[1]  # output lengths at least differ between seeds
    a = _agent(0, drift=0.1)
    assert a.explore(3) == pytest.approx(a.explore(0) + 0.3)


def test_candidates_follow_the_observations() -> None:
    seed, c = 0, coding.params(0)[2]
    out = "PASS scale(3)\nFAIL discount(60): expected 40, got 60\n11 passed, 1 failed"
    failed = [Step(ToolCall("run_tests"), out)]
    assert coding_candidates(f"code-fix-{seed}", failed)[0] == ToolCall("grep", {"pattern": "discount"})
    line = f"src/pricing.c:6:int discount(int x) {{ return x - x % {c}; }}"
    src = [*failed, Step(ToolCall("grep", {"pattern": "discount"}), line)]
    fix = coding_candidates(f"code-fix-{seed}", src)[0]
    assert fix == ToolCall("edit", {"path": "src/pricing.c", "find": f"x - x % {c}", "replace": f"x - x / {c}"})
    passed = [*src, Step(fix, "edited"), Step(ToolCall("run_tests"), "checksum 1\n12 passed, 0 failed")]
    assert isinstance(coding_candidates(f"code-fix-{seed}", passed)[0], FinalAnswer)
    shop = shop_candidates({"TEA-GRN": 1}, "Ada", "12 Row")
    first = shop("shop-0", [])[0]
    assert first.name == "goto"
    page = [Step(first, "http://shop/search?q=tea\n\nGreen Tea (100 g)\nTea · $4.50")]
    add = ToolCall("click", {"selector": "button[aria-label='Add Green Tea (100 g) to cart']"})
    assert shop("shop-0", page)[0] == add


def test_gui_candidates_follow_the_window_titles() -> None:
    C = ToolCall
    gui = gui_candidates("Ship it")
    assert gui("gui-0", [])[0] == C("list_windows")
    windows = "window 1 at (0, 0) size 640x480 'notes.txt - Mousepad'\nwindow 2 at (9, 9) size 80x24 'Terminal'"
    seen = [Step(C("list_windows"), windows)]
    assert gui("gui-0", seen) == [C("activate_window", {"title": "Mousepad"}),
                                  C("activate_window", {"title": "Terminal"})]
    wrong = [*seen, Step(C("activate_window", {"title": "Terminal"}), "activated 'Terminal'")]
    assert gui("gui-0", wrong)[0] == C("activate_window", {"title": "Mousepad"})
    typed = [*seen, Step(C("activate_window", {"title": "Mousepad"}), "activated 'notes.txt - Mousepad'"),
             Step(C("key", {"combo": "ctrl+a"}), "pressed ctrl+a"), Step(C("type_text", {"text": "Ship it"}), "typed")]
    assert gui("gui-0", typed[:-1])[0] == C("type_text", {"text": "Ship it"})
    saved = [*typed, Step(C("key", {"combo": "ctrl+s"}), "pressed ctrl+s")]
    assert gui("gui-0", saved)[0] == C("list_windows")
    # The title still marks the file modified: save again; once it does not, the task is done.
    dirty = [*saved, Step(C("list_windows"), "window 1 at (0, 0) size 640x480 '*notes.txt - Mousepad'")]
    assert gui("gui-0", dirty)[0] == C("key", {"combo": "ctrl+s"})
    assert isinstance(gui("gui-0", [*saved, Step(C("list_windows"), windows)])[0], FinalAnswer)
    # The headline's task: the editor is not running; start it (or read the help page first).
    launch = gui_candidates("Ship it", launch=True, help_page="/root/h.html")
    assert launch("gui-0", []) == [C("launch_app", {"app": "editor"}), C("open_page", {"path": "/root/h.html"})]
    helped = [Step(C("open_page", {"path": "/root/h.html"}), "loaded 'Editor help - Chromium'")]
    assert launch("gui-0", helped)[0] == C("launch_app", {"app": "editor"})
    started = [Step(C("launch_app", {"app": "editor"}), "started editor")]
    assert launch("gui-0", started)[0] == C("activate_window", {"title": "Mousepad"})


def test_one_real_epoch_of_base_on_the_coding_task() -> None:
    fast = LatencyModel(tpot_table=((1, 1e-4), (64, 2e-4)), first_token_s=0.0, prefill_s_per_token=0.0)
    agent = StochasticAgent(AgentConfig(seed=0), Server(fast), {"code-fix-0": coding_candidates})
    engine = RolloutEngine(agent, memory="ksm", keep_initial=True, overlap_fork=True)
    task = coding.make_env(0)

    async def go() -> list:
        try:
            pressure = contention.CpuPressure()
            pressure.start()
            r = await engine.run_epoch([task], 2, 0)
            assert len(engine.core.kept_snapshots()) == 1  # kept for the next epoch
            r2 = await engine.run_epoch([task], 2, 1)
            share = pressure.share()
            alone = await contention.calibrate([task], r2)  # a fresh workspace, destroyed after
            return [r, r2, share, alone]
        finally:
            await engine.close()

    r, r2, share, alone = asyncio.run(go())
    # Contention: the calibration ran one sample's calls alone (make and gcc included), and each
    # real call of the epoch is set against its time there.
    assert share is not None and share >= 0
    assert alone and set(alone) <= {st.call.key for s in r2.samples for st in s.steps}
    f = contention.factor(r2, alone)
    assert f["calls"] > 0 and f["factor"] > 0 and f["straggler"] is not None
    assert 0 < contention.reasoning_busy_share(r) <= 1
    assert 0 < contention.distinct_prefixes(r)[task.id] <= 1
    assert not [e for s in r.samples + r2.samples for e in s.errors]
    # The oracle replays each sample's recorded steps (one per decision) with every tool at 0 s:
    # this real epoch, gcc and make included, ends after it.
    server = agent.server
    assert len(server.recorded(0)) == len(r.samples) and all(server.recorded(0))
    assert 0 < oracle.replay(server.recorded(0), server.price) <= r.seconds
    assert all(s.reward is not None for s in r.samples)
    # A real run of make test: the tool saw gcc's output, and a passing run is rewarded.
    calls = [st for s in r.samples for st in s.steps if st.call.name == "run_tests"]
    assert calls and all("passed" in st.observation for st in calls)
    assert engine.core.kept_snapshots() == []
    # Trajectories: each sample's calls and observation digests, parted where a step differs.
    d = trajectories.digests(r)
    assert {k: len(v) for k, v in d.items()} == {f"{s.task_id}/{s.sample}": len(s.steps) for s in r.samples}
    assert all(how == "executed" for v in d.values() for _, how, _ in v)
    assert trajectories.compare([d], [d])["samples_parted"] == 0
    k = next(iter(d))
    seen = {**d, k: [list(x) for x in d[k]]}
    seen[k][1][2] = "0" * 12
    other = {**d, k: [*d[k][:1], ["no_such_call{}", "cache", d[k][1][2]], *d[k][2:]]}
    got = trajectories.compare([d, d, d], [seen, other, {k: d[k][:-1]}])
    assert got["by_kind"] == {"observation": 1, "call": 1, "length": 1}
    assert got["per_epoch"][0] == {k: {"step": 1, "kind": "observation", "call": d[k][1][0],
                                       "served": ["executed", "executed"]}}
    assert got["per_epoch"][1][k]["calls"] == [d[k][1][0], "no_such_call{}"]


def _seed_result(seed: int, spec_s: float, fork_s: float, base_s: float = 20.0, full_s: float | None = None) -> dict:
    """What one --seed run writes: three configurations (four with full_s) over two epochs."""
    def config(seconds: float, peak: int) -> dict:
        return {"epoch_seconds": [seconds + 5, seconds], "oracle_seconds": [3.0, 3.0],
                "median_rollout_seconds": [seconds, seconds - 1], "peak_memory_bytes_per_epoch": [peak, peak],
                "hit_rate_per_epoch": {"cache": [0, 0], "speculation": [0, 0.5], "total": [0, 0.5]},
                "peak_memory_bytes": peak, "reward_per_epoch": [1.0, 0.5], "errors": []}
    series = {"memory": [[[0.0, 1 << 20]], [[0.0, 2 << 20]]], "running": [[[0.0, 2], [1.0, 0]]] * 2}
    seeds = {"Base": config(base_s, 40 << 20), "Spec": config(spec_s, 41 << 20),
             "Spec@fork_first": config(fork_s, 43 << 20)}
    if full_s is not None:
        seeds["Full"] = config(full_s, 42 << 20)
    return {"latency_model": {"formula": "f"}, "agent": {"seed": 0}, "share_engine": "ksm",
            "size": {"seeds": [seed], "families": ["code"], "epochs": 2, "quick": True},
            "seeds": {str(seed): {**seeds, "rewards_identical": True}},
            "series": {str(seed): {n: series for n in seeds}}, "host": {}, "wall_seconds": 1.0}


def test_merge_of_per_seed_runs_reports_mean_and_spread(tmp_path: Path) -> None:
    import json
    import subprocess

    dirs = []
    for seed, (spec_s, fork_s) in enumerate([(10.0, 12.0), (14.0, 13.0), (12.0, 14.0)]):
        d = tmp_path / f"seed{seed}"
        d.mkdir()
        (d / "agent_rollouts.json").write_text(json.dumps(_seed_result(seed, spec_s, fork_s)))
        dirs.append(str(d))
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "agent_rollouts.py"
    out = tmp_path / "merged"
    subprocess.run([sys.executable, str(bench), "--merge", *dirs, "--out", str(out)], check=True,
                   capture_output=True, timeout=120)
    r = json.loads((out / "agent_rollouts.json").read_text())
    assert r["size"]["seeds"] == [0, 1, 2] and sorted(r["seeds"]) == ["0", "1", "2"]
    spec = r["summary"]["Spec"]["epoch_seconds"]  # the later epoch of each seed
    assert spec == {"mean": 12.0, "min": 10.0, "max": 14.0, "n": 3}
    assert r["summary"]["Base"]["peak_memory_mib"]["mean"] == 40.0
    assert r["placements"]["fork_first"]["epoch_seconds"]["mean"] == 13.0
    assert r["placements"]["shorter_epoch"] == "live" and r["placements"]["live"]["config"] == "Spec"
    ratio = r["placements"]["fork_first"]["epoch_ratio_to_default"]  # paired within each seed
    assert (ratio["min"], ratio["max"]) == (pytest.approx(13 / 14, abs=1e-4), pytest.approx(12 / 10, abs=1e-4))
    assert r["targets"]["rewards_identical"] and (out / "fig10_hit_rate.png").exists()
    # A seed given twice is refused, not averaged in twice.
    again = subprocess.run([sys.executable, str(bench), "--merge", dirs[0], dirs[0], "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "twice" in again.stderr
    assert r["settle"]["seconds"] == 0.0  # runs from before --settle paused nothing
    # A seed run naming only the configurations every seed runs (--configs Base,Full where Spec
    # runs at seed 0 only) merges with the full runs; one that drops another configuration does not.
    for i, configs in enumerate((["Base", "Spec", "Full"], ["Base", "Spec", "Full"], ["Base", "Full"])):
        part = json.loads(Path(dirs[i], "agent_rollouts.json").read_text())
        part["size"] |= {"configs": configs, "short_configs": ["Spec"], "short_seeds": [0]}
        Path(dirs[i], "agent_rollouts.json").write_text(json.dumps(part))
    subprocess.run([sys.executable, str(bench), "--merge", *dirs, "--out", str(out)], check=True,
                   capture_output=True, timeout=120)
    assert json.loads((out / "agent_rollouts.json").read_text())["size"]["configs"] == ["Base", "Spec", "Full"]
    part["size"]["configs"] = ["Base"]
    Path(dirs[2], "agent_rollouts.json").write_text(json.dumps(part))
    other = subprocess.run([sys.executable, str(bench), "--merge", *dirs, "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and "differ in size" in other.stderr


BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "agent_rollouts.py"


def test_settle_reaches_the_gui_task_only_and_changes_its_fingerprint() -> None:
    """--settle (OSWorld's pause after each action) goes to the gui family's tasks, whose
    fingerprint, so whose cache keys, it changes; the other families' tasks are unchanged."""
    from bunshinrl.envs import gui

    tasks_mod = load_by_path("rollouts_tasks", "benchmarks/rollouts/tasks.py")
    at = {s: {t.id: t for t in tasks_mod.build_tasks(["code", "gui"], 0, 1, settle=s)[0]} for s in (0.0, 2.0)}
    assert at[0.0]["code-fix-0"].fingerprint == at[2.0]["code-fix-0"].fingerprint
    assert at[0.0]["gui-0"].fingerprint != at[2.0]["gui-0"].fingerprint
    want = gui.make_env(target=tasks_mod.GUI_TARGETS[0], apps=(), files={tasks_mod.GUI_HELP: tasks_mod.GUI_HELP_PAGE},
                        settle=2.0)
    assert at[2.0]["gui-0"].fingerprint == want.fingerprint


def test_settle_is_recorded_and_runs_at_different_settles_merge_as_a_sweep(tmp_path: Path) -> None:
    """A real one-rollout run records its --settle; --merge keeps a settle shared by its runs,
    and runs at different settles make a sweep: each settle's runs merged apart (as seeds of one
    point), the points side by side with the settle's share of Base - oracle paired by seed."""
    import json
    import subprocess

    helptext = subprocess.run([sys.executable, str(BENCH), "--help"], check=True, capture_output=True, text=True,
                              timeout=120).stdout
    assert "--settle SECONDS" in helptext and "OSWorld" in helptext and "default 2.0" in helptext
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, str(BENCH), "--families", "code", "--group-size", "1", "--epochs", "1",
                           "--configs", "Base", "--short-configs", "", "--seed", "0", "--regime", "local", "--audit",
                           "off", "--settle", "0.5", "--out", str(run)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "settle 0.5 s" in done.stdout
    assert json.loads((run / "agent_rollouts.json").read_text())["settle"]["seconds"] == 0.5

    dirs = []
    for seed, settle, base in ((0, 2.0, 20.0), (1, 2.0, 20.0), (0, 0.0, 10.0)):
        d = tmp_path / f"seed{seed}-settle{settle:g}"
        d.mkdir()
        (d / "agent_rollouts.json").write_text(json.dumps({**_seed_result(seed, 10.0, 12.0, base, base * 0.75),
                                                           "settle": {"seconds": settle}}))
        dirs.append(str(d))
    out = tmp_path / "merged"
    subprocess.run([sys.executable, str(BENCH), "--merge", dirs[0], dirs[1], "--out", str(out)], check=True,
                   capture_output=True, timeout=120)
    merged = json.loads((out / "agent_rollouts.json").read_text())
    assert merged["settle"]["seconds"] == 2.0 and merged["size"]["seeds"] == [0, 1]
    sweep_out = tmp_path / "sweep"
    done = subprocess.run([sys.executable, str(BENCH), "--merge", dirs[0], dirs[1], dirs[2], "--out",
                           str(sweep_out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (sweep_out / "agent_rollouts.json").exists()  # never one result across settles
    points = {p["settle_seconds"]: p for p in json.loads((sweep_out / "sweep.json").read_text())["points"]}
    assert sorted(points) == [0.0, 2.0] and points[2.0]["seeds"] == [0, 1] and points[0.0]["seeds"] == [0]
    # Epoch 2 compared: Base 20 s against an oracle of 3 s at settle 2, 10 s against 3 s at settle 0.
    assert points[2.0]["ceiling"]["mean"] == pytest.approx(20 / 3, abs=1e-3)
    assert points[2.0]["full_speedup"]["mean"] == pytest.approx(1 / 0.75, abs=1e-3)
    assert points[2.0]["settle_share_of_removable"] == {"mean": pytest.approx((17 - 7) / 17, abs=1e-3), "seeds": [0]}
    assert points[2.0]["full_speedup_at_settle_0"]["mean"] == pytest.approx(1 / 0.75, abs=1e-3)
    assert points[0.0]["settle_share_of_removable"] is None
    assert (sweep_out / "speedup_vs_ceiling.png").exists()
    for settle, seeds in ((2.0, [0, 1]), (0.0, [0])):
        point = json.loads((sweep_out / f"settle-{settle:g}" / "agent_rollouts.json").read_text())
        assert point["settle"]["seconds"] == settle and point["size"]["seeds"] == seeds


def test_swe_candidates_follow_the_test_output() -> None:
    from bunshinrl.envs import swe

    C = ToolCall
    rel, good, bad, _test = swe.BUGS[0]
    cands = agent_policy.swe_candidates
    assert cands("swe-fix-0", [])[0] == C("run_tests")
    failed = [Step(C("run_tests"), "FAILED mpmath/tests/test_functions.py::test_sinc - AssertionError\n"
                                   "1 failed, 112 passed")]
    assert cands("swe-fix-0", failed) == [C("grep", {"pattern": "def sinc("}),
                                          C("run_tests", {"path": "test_functions.py"})]
    body = f"mpmath/functions/functions.py:159:def sinc(ctx, x):\nmpmath/functions/functions.py-164-    {bad}"
    seen = [*failed, Step(C("grep", {"pattern": "def sinc("}), body)]
    fix = C("edit", {"path": rel, "find": bad, "replace": good})
    assert cands("swe-fix-0", seen)[0] == fix
    edited = [*seen, Step(fix, "edited: 1 replacement(s)")]
    assert cands("swe-fix-0", edited)[0] == C("run_tests", {"path": "test_functions.py"})
    one = [*edited, Step(C("run_tests", {"path": "test_functions.py"}), "46 passed")]
    assert cands("swe-fix-0", one)[0] == C("run_tests")
    assert isinstance(cands("swe-fix-0", [*one, Step(C("run_tests"), "113 passed")])[0], FinalAnswer)


def test_swe_family_runs_the_pinned_projects_own_tests() -> None:
    """mpmath 1.3.0's sdist ships its tests; the injected bug fails the test it names, one state
    observes the same normalised output twice, the subset takes seconds of real work, and the
    reward follows the last run of the subset. check_family finds nothing fork-specific."""
    from bunshinrl.calls.determinism import check_family
    from bunshinrl.envs import swe

    files = swe.project_files(0)
    assert all(f"{swe.TESTS}/{f}" in files for f in swe.SUBSET)  # the sdist ships the suite
    rel, good, bad, test = swe.BUGS[0]
    assert bad in files[rel].decode() and good not in files[rel].decode()
    task = swe.make_env(0)
    ws = task.create()
    try:
        t0 = time.monotonic()
        out = task.call(ws, "run_tests")
        seconds = time.monotonic() - t0
        assert f"FAILED {swe.TESTS}/test_functions.py::{test} " in out and re.search(r"\d+ failed, \d+ passed", out)
        assert not re.search(r" in \d+(\.\d+)?s", out) and task.call(ws, "run_tests") == out
        assert task.reward(ws) == 0.0 and seconds > 1.0  # real work: ~6 s on the 2-core host alone
        assert bad in task.call(ws, "grep", pattern="def sinc(")
        assert "1 replacement" in task.call(ws, "edit", path=rel, find=bad, replace=good)
        assert re.search(r"^\d+ passed", task.call(ws, "run_tests", path="test_functions.py"), re.M)
        assert task.reward(ws) == 0.5  # fixed, the subset not run since
        assert "failed" not in task.call(ws, "run_tests") and task.reward(ws) == 1.0
    finally:
        ws.destroy()
    report = check_family(task, [ToolCall("run_tests"), ToolCall("grep", {"pattern": "def sinc("})])
    assert not report.differing
