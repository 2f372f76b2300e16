"""CPU slots (bunshinrl.calls.cpu_slots): CPU-heavy tool executions beyond the slots wait for
one, inside the call, and the waits are counted; unconfigured, nothing waits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from bunshinfork import Workspace
from bunshinrl.calls import cpu_slots
from bunshinrl.calls.cpu_slots import CpuSlots
from bunshinrl.envs import coding


@pytest.fixture
def unlimited_after() -> Iterator[None]:
    yield
    cpu_slots.configure(None)


def test_a_second_holder_waits_for_the_first_and_is_counted() -> None:
    slots = CpuSlots(1)
    entered, release = threading.Event(), threading.Event()

    def first() -> None:
        with slots.hold():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=first)
    t.start()
    assert entered.wait(10)
    got = threading.Event()

    def second() -> None:
        with slots.hold():
            got.set()

    t2 = threading.Thread(target=second)
    t2.start()
    assert not got.wait(0.2)  # the slot is taken: the second waits
    release.set()
    assert got.wait(10)
    t.join(10)
    t2.join(10)
    s = slots.stats()
    assert s["held"] == 2 and s["waited"] == 1 and s["wait_seconds"] >= 0.2 and s["slots"] == 1, s
    assert CpuSlots(None).stats()["slots"] is None


def test_a_wait_past_the_deadline_is_a_typed_error() -> None:
    slots = CpuSlots(1, timeout=0.1)
    with slots.hold(), pytest.raises(TimeoutError), slots.hold():
        pass
    with pytest.raises(ValueError):
        CpuSlots(0)


def test_the_code_familys_test_runs_queue_for_one_slot(unlimited_after: None) -> None:
    """Two forks run the project's `make test` at once: with one slot, one waits for the other;
    what each observes is what it observes with no limit."""
    task = coding.make_env(0)
    run_tests = task.engine_tools["run_tests"]
    ws = Workspace.create()
    try:
        task.setup(ws)
        with ws.snapshot() as snap:
            forks = snap.fork(2)
        try:
            free = run_tests.execute(forks[0], {})
            coding.sh(forks[0], "make -s clean")
            slots = cpu_slots.configure(1)
            with ThreadPoolExecutor(2) as pool:
                outs = list(pool.map(lambda w: run_tests.execute(w, {}), forks))
            s = slots.stats()
            assert s["held"] == 2 and s["waited"] == 1 and s["wait_seconds"] > 0, s
            assert outs == [free, free]
        finally:
            for f in forks:
                f.destroy()
    finally:
        ws.destroy()
