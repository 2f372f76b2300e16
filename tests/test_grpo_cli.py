"""The training benchmark and the demo, run as a user would, at a tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: float = 240) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_grpo_train_benchmark_writes_its_report(tmp_path: Path) -> None:
    out = _run(["benchmarks/grpo_train.py", "--out", str(tmp_path), "--epochs", "2", "--group", "2",
                "--tasks", "files-ab", "--think", "0"])
    report = json.loads((tmp_path / "grpo_train.json").read_text())
    configs = report["configs"]
    assert set(configs) == {"Random", "Base", "Spec", "Full"}
    for name, c in configs.items():
        assert len(c["reward_per_epoch"]) == len(c["rollout_seconds_per_epoch"]) == len(c["hit_rate_per_epoch"]) == 2
        # Sampled every 0.25 s: an epoch this small can end between two samples.
        assert isinstance(c["peak_memory_bytes"], int) and c["peak_memory_bytes"] >= 0
        assert c["identical_to_base"] is (None if name == "Random" else True)
    assert report["learning"]["trained_config"] == "Base"
    assert (tmp_path / "grpo_train.png").stat().st_size > 10_000
    assert "identical to Base: True" in out


def test_demo_trains_and_writes_plots(tmp_path: Path) -> None:
    out = _run(["-m", "bunshinrl.demo", "--out", str(tmp_path), "--epochs", "2", "--group", "3",
                "--tasks", "files-ab,fix-add", "--config", "Full", "--think", "0"])
    assert "reward per epoch (Full)" in out and "hit rate per epoch" in out and "peak memory" in out
    report = json.loads((tmp_path / "grpo_demo.json").read_text())
    assert set(report["configs"]) == {"Random", "Full"}
    assert (tmp_path / "grpo_demo.png").exists()
