"""bunshin inside a trainer that imported numpy and torch first: forks, snapshots and saves
never fork() the calling process, so no library's atfork handler runs in it (OpenBLAS's drains
its busy thread pool and can deadlock). The rounds are benchmarks/embed_fork_safety.py's; a
pthread_atfork handler of a library built here counts every fork() of this process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import load_by_path

ROUNDS = 10


def _bench() -> ModuleType:
    return load_by_path("embed_fork_safety", "benchmarks/embed_fork_safety.py")


def test_no_fork_of_the_caller_with_numpy_and_torch_pools_busy(tmp_path: Path) -> None:
    bench = _bench()

    def each_round(i: int, calls: int) -> None:
        assert calls == 0, f"round {i + 1}: this process was fork()ed {calls} times (atfork handlers ran)"

    result = bench.run(ROUNDS, tmp_path, each_round)
    assert result["atfork_calls"] == 0
    # The pools were at work during every round, not parked.
    for row in result["rows"]:
        assert row["numpy_products"] > 0 and row["torch_products"] > 0, row


def test_the_counter_counts_a_fork(tmp_path: Path) -> None:
    """The handler sees a fork() of this process: a spawn with a preexec_fn is one (glibc's
    fork, atfork handlers and all), and the same spawn without it is a vfork, which is not."""
    calls = _bench().atfork_counter(tmp_path)
    before = calls()
    subprocess.run(["true"], check=True, timeout=30)
    assert calls() == before
    subprocess.run(["true"], check=True, timeout=30, preexec_fn=lambda: None)
    assert calls() == before + 1


def test_numpy_then_bunshinrl_imports_without_warning() -> None:
    """A trainer's order (numpy and torch first) is one bunshin supports without a warning."""
    code = "import numpy, torch, bunshinrl, bunshinfork"
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args,kind", [
    ('12 clone3({flags=CLONE_VM|CLONE_VFORK|CLONE_CLEAR_SIGHAND, exit_signal=SIGCHLD, stack=0x7f, '
     'stack_size=0x9000}, 88) = 40', "vfork"),
    ("12 clone(child_stack=NULL, flags=CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|SIGCHLD, "
     "child_tidptr=0x7f) = 41", "fork"),
])
def test_the_strace_count_tells_a_vfork_from_a_fork(args: str, kind: str) -> None:
    trace = ("12 clone3({flags=CLONE_VM|CLONE_FS|CLONE_FILES|CLONE_SIGHAND|CLONE_THREAD|CLONE_SYSVSEM, "
             "exit_signal=0}, 88) = 13\n"
             "13 clone3({flags=CLONE_VM|CLONE_VFORK, exit_signal=SIGCHLD} <unfinished ...>\n"
             "13 <... clone3 resumed>, 88) = 14\n"
             f"{args}\n"
             "99 clone(child_stack=NULL, flags=SIGCHLD) = 100\n")  # another process's: not counted
    counts = _bench().classify(trace, 12)
    assert counts["thread"] == 1 and counts["vfork"] == 1 + (kind == "vfork") and counts["fork"] == (kind == "fork")
