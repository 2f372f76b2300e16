"""The training benchmark and the demo, run as a user would, at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_grpo_llm_benchmark_writes_its_report(tmp_path: Path) -> None:
    out = _run(["benchmarks/grpo_llm.py", "--backend", "hf", "--out", str(tmp_path), "--epochs", "2", "--group", "2",
                "--tasks", "fix-both", "--seeds", "0,1", "--no-learning-target"])
    report = json.loads((tmp_path / "grpo_llm.json").read_text())
    assert len(report["reward_per_epoch"]) == len(report["random_reward_per_epoch"]) == 2
    assert report["learning"]["seeds"] == [0, 1] and "beats_random" in report["learning"]
    assert [s["served_version"] for s in report["weight_syncs"]] == ["1", "2"]
    assert len(report["tokens_trained"]) == 2 and report["logprob_drift"]["max"] < 1e-4
    configs = report["configs"]
    assert set(configs) == {"Base", "Spec", "Full"}
    for name, c in configs.items():
        assert len(c["reward_per_epoch"]) == len(c["hit_rate_per_epoch"]) == 2
        assert c["identical_to_base"] is (None if name == "Base" else True)
    assert (tmp_path / "grpo_llm.png").stat().st_size > 10_000
    assert "identical to Base: True" in out


def test_demo_trains_and_writes_plots(tmp_path: Path) -> None:
    out = _run(["-m", "bunshinrl.demo", "--out", str(tmp_path), "--epochs", "2", "--untrained-epochs", "1",
                "--group", "3", "--tasks", "files-ab,fix-add", "--config", "Full", "--max-new-tokens", "64",
                "--no-learning-target"])
    assert "reward per epoch (Full)" in out and "hit rate per epoch" in out and "peak memory" in out
    assert out.count("s left]") == 3 and "Why rollouts grow" in out and "bounded to 64" in out
    report = json.loads((tmp_path / "grpo_demo.json").read_text())
    assert set(report["configs"]) == {"Random", "Full"}
    assert report["settings"]["max_new_tokens"] == 64 and len(report["configs"]["Random"]["reward_per_epoch"]) == 1
    # What the demo prints as its verdict: the trained model's last epochs against every untrained one.
    assert report["trained_final"] == pytest.approx(sum(report["configs"]["Full"]["reward_per_epoch"][-2:]) / 2)
    assert report["beats_untrained"] == (report["trained_final"] > report["untrained_mean"])
    assert (tmp_path / "grpo_demo.png").exists()
