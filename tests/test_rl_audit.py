"""The trajectory audit (issue 37 #3): after a Full epoch, each sample's history re-executed from its
root in a fresh fork, every observation it was shown and its reward compared."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Sequence

import pytest
from rl_support import counter_task, no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinfork import Workspace
from bunshinrl import (
    FinalAnswer,
    RolloutEngine,
    SampleContext,
    SnapshotBackend,
    Step,
    Task,
    ToolCall,
    ToolPrefixCache,
    TrajectoryAuditor,
)
from bunshinrl.calls.policy import Action
from bunshinrl.rollout.audit import cache_roots
from bunshinrl.rollout.timeline import EpochResult

pytestmark = pytest.mark.usefixtures("no_own_leaks")

C = ToolCall
ROOT_FORKS: list[bool] = []
PLAN = [C("bump", {"n": 1}), C("touch", {"name": "a"}), C("bump", {"n": 2}), C("state")]


def scored_task() -> Task:
    def verify(ws: Workspace) -> tuple[float, str]:
        value = int(ws.commands.run("curl -s http://127.0.0.1:9000/value", timeout=30).stdout or 0)
        return value / 10, f"counter {value}"

    return dataclasses.replace(counter_task("audited"), verify=verify)


class Plan:
    """Every sample follows `calls`, one per decision."""

    def __init__(self, calls: list[ToolCall]) -> None:
        self.calls = calls

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        await asyncio.sleep(0.02)
        return self.calls[len(history)] if len(history) < len(self.calls) else FinalAnswer("done")


def _run(task: Task, calls: list[ToolCall], modes: Sequence[tuple[str, Sequence[str]]],
         doctor: bool = False) -> tuple[EpochResult, list]:
    cache = ToolPrefixCache(SnapshotBackend(), 1 << 40, background=False)
    engine = RolloutEngine(Plan(calls), cache=cache)

    roots = cache_roots(engine.core)

    async def root(t: Task) -> Workspace | None:
        ws = await roots(t)
        ROOT_FORKS.append(ws is not None)  # a fork of the cache's root, not the auditor's own
        return ws

    async def main() -> tuple[EpochResult, list]:
        auditors = [TrajectoryAuditor([task], mode=m, root=root, stateless=stateless) for m, stateless in modes]
        try:
            await engine.run_epoch([task], group_size=2, epoch=0)
            r = await engine.run_epoch([task], group_size=2, epoch=1)  # served from the cache
            reports = [await a.audit(r) for a in auditors]
            if doctor:
                # What the invariant forbids: a sample shown an observation its history does not
                # produce, and a reward its state does not earn.
                bad = copy.deepcopy(r)
                s = bad.samples[0]
                s.steps[2] = Step(s.steps[2].call, "7", s.steps[2].decision)
                s.reward = 1.0
                reports.append(await auditors[0].audit(bad))
            return r, reports
        finally:
            for a in auditors:
                await a.close()
            await engine.close()
            cache.close()

    return asyncio.run(main())


def test_the_audit_passes_a_cached_epoch_and_catches_a_doctored_one() -> None:
    task = scored_task()
    r, (every, one, doctored) = _run(task, PLAN, [("all", ()), ("sample", ())], doctor=True)
    assert r.cache_hits > 0  # the audited epoch was served from the cache
    assert ROOT_FORKS and all(ROOT_FORKS)
    assert every.ok and every.mismatches == 0 and [s.status for s in every.samples] == ["ok", "ok"]
    # Every step, the verifier's included: the reward reproduced.
    assert every.samples[0].steps == len(PLAN) + 1 and every.samples[0].fresh_reward == 0.3 == r.samples[0].reward
    assert one.summary()["audited"] == 1 and one.ok
    assert doctored.mismatches == 1 and not doctored.ok
    bad = doctored.samples[0]
    assert bad.status == "mismatch" and [(m.step, m.served, m.fresh) for m in bad.mismatches] == [(2, "7", "3")]
    assert bad.fresh_reward == 0.3 != bad.reward
    assert doctored.summary()["samples"][0]["mismatches"][0]["call"] == 'bump{"n":2}'
    # What had served each step is named (the sample's path), the mismatching one's beside it.
    kinds = {"executed", "cache", "speculation"}
    assert len(bad.path) == len(PLAN) + 1 and set(bad.path) <= kinds and bad.mismatches[0].how in kinds
    assert "cache" in every.samples[0].path + every.samples[1].path


def test_a_tool_declared_non_deterministic_makes_a_sample_not_auditable() -> None:
    task = counter_task("undeclared")  # uuid is declared deterministic=False
    calls = [C("bump", {"n": 1}), C("uuid"), C("state")]
    _, (report, stateless) = _run(task, calls, [("all", ()), ("all", ("uuid",))])
    assert report.not_auditable == 2 and not report.mismatches and report.ok
    assert report.samples[0].steps == 1 and "uuid" in report.samples[0].reason  # the step before it compared
    assert report.summary()["samples"][0]["status"] == "not_auditable"  # reported, never passed
    # Unless its caller says it changes no state: its observation skipped, the rest compared.
    assert stateless.ok and [(s.status, s.steps) for s in stateless.samples] == [("ok", 2), ("ok", 2)]


def test_the_trainer_audits_its_epochs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """GRPOTrainer(audit=...): each epoch's audit in StepMetrics.extra["audit"]."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bunshinrl.grpo import suite, testmodel
    from bunshinrl.policies.hf_policy import HFPolicy
    from bunshinrl.training.trainer import GRPOConfig, GRPOTrainer

    tasks = [t for t in suite() if t.id == "files-ab"]
    model = testmodel.make(tmp_path_factory.mktemp("tiny"))
    trainer = GRPOTrainer(HFPolicy.from_pretrained(model, tasks), tasks, config=GRPOConfig(group_size=2),
                          engine="Full", audit="all")
    (m,) = trainer.run(1)
    audit = m.extra["audit"]
    assert (audit["mode"], audit["audited"], audit["mismatches"], audit["errors"]) == ("all", 2, 0, 0), audit
    assert audit["steps"] >= 2  # every sample's calls and its verifier re-executed
