"""benchmarks/fork_latency.py's arithmetic and parsing, without a workspace: its percentiles, the
ticker's gap log read in increments, and the table's rows from a synthetic result; and
benchmarks/fork_workloads.py's smallest mode end to end. Untimed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_by_path

bench = load_by_path("fork_latency", "benchmarks/fork_latency.py")


def test_percentile_interpolates_between_ranks() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bench.percentile(xs, 50) == 3.0
    assert bench.percentile(xs, 0) == 1.0
    assert bench.percentile(xs, 100) == 5.0
    assert bench.percentile(xs, 90) == pytest.approx(4.6)
    assert bench.percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        bench.percentile([], 50)


def test_summary() -> None:
    s = bench.summary([0.1, 0.3, 0.2, 0.4])
    assert s["n"] == 4 and s["median"] == pytest.approx(0.25) and s["min"] == 0.1 and s["max"] == 0.4
    assert s["p90"] == pytest.approx(0.37)


def test_gaps_are_read_in_increments_and_a_partial_line_waits() -> None:
    gaps, seen = bench.new_gaps("", 0)
    assert (gaps, seen) == ([], 0)
    gaps, seen = bench.new_gaps("3.5\n140.2\n12", 0)
    assert gaps == [3.5, 140.2] and seen == 2  # "12" is still being written
    gaps, seen = bench.new_gaps("3.5\n140.2\n12.0\n4.1\n", seen)
    assert gaps == [12.0, 4.1] and seen == 4


def _run(answer: float, frozen: float) -> dict:
    return {"answer": answer, "call": answer - 0.003, "first_command": 0.003, "frozen_ticker": frozen,
            "frozen_freezer": frozen - 0.001, "cpu_criu": 0.1, "cpu_self": 0.02,
            "timings": {"snapshot.dump": frozen - 0.005, "criu.start": 0.01}}


def test_rows_and_stages_from_a_result(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [_run(0.2 + i / 100, 0.1 + i / 1000) for i in range(5)]
    result = {"regime": "synthetic", "engines": [{
        "engine": "ksm", "fork1_back_to_back": runs, "fork1_spaced": runs,
        "fork16": [{"call": 0.9, "answer": 0.95}], "snapshot_fork1": runs}],
        "serve": {"create_from_snapshot": [0.05, 0.07], "pause": [0.2], "connect": [0.3]}}
    rows = {(name, eng): (s, t) for name, eng, s, t in bench.rows(result)}
    s, target = rows[("fork(1): call to clone answering (back to back)", "ksm")]
    assert s["median"] == pytest.approx(0.22) and target == bench.TARGETS["fork1_answer"]
    assert rows[("fork(16): the call", "ksm")][0]["n"] == 1
    assert rows[("serve: Sandbox.create(snapshot), client-measured", "serve")][0]["median"] == pytest.approx(0.06)
    stages = dict(bench.stage_rows(result))
    assert stages["criu.start"] == {"ksm": pytest.approx(0.01)}
    assert next(iter(dict(bench.stage_rows(result)))) == "snapshot.dump"  # the largest first
    bench.print_report(result)
    out = capsys.readouterr().out
    assert "| fork(1): call to clone answering (back to back) | ksm | 5 | 220.0 |" in out
    assert "regime: synthetic" in out


def test_fork_workloads_quick_runs_end_to_end(tmp_path: Path) -> None:
    """benchmarks/fork_workloads.py --quick (ksm, 3 runs, a 64 MiB holder, the shop, the shop under
    load): every row is there with its runs, and (the suite's leak check) nothing is left. Untimed."""
    from conftest import leaks
    from conftest import snapshot as host_snapshot

    workloads = load_by_path("fork_workloads", "benchmarks/fork_workloads.py")
    before = host_snapshot()
    out = tmp_path / "fork_workloads.json"
    assert workloads.main(["--quick", "--out", str(out)]) == 0
    assert leaks(before) == {}
    result = json.loads(out.read_text())
    assert "regime" in result
    by = {w["workload"]: w for w in result["workloads"]}
    assert set(by) == {"mem", "shop", "load"} and all(w["engine"] == "ksm" for w in by.values())
    assert by["mem"]["size_mib"] == 64 and by["mem"]["holder_rss_kib"] >= 64 * 1024
    for w in by.values():
        assert len(w["runs"]) == 3
        assert all(r["answer"] >= r["call"] > 0 and r["frozen_ticker"] >= 0 for r in w["runs"])
    assert all(r["stall"] > 0 for r in by["load"]["runs"]) and len(by["load"]["baseline"]) == 3
    assert by["load"]["requests_per_s"] > 0
    rows = workloads.rows(result)
    assert ("mem (64 MiB)", "source frozen, ticker", "ksm") in {r[:3] for r in rows}
    assert len(rows) == 4 + 4 + 5
