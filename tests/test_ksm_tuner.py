"""The ksmd boost is host state: it must end with the last process that asked for it, even one killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import wait_for

from bunshinfork import workspace
from bunshinfork.memory import ksm

pytestmark = pytest.mark.skipif(not ksm.available(), reason="kernel without KSM")

MARK = {"run": "0", "pages_to_scan": "123", "sleep_millisecs": "37"}

# Boost, end the burst, then either exit at once or wait to be killed.
CHILD = """
import sys, time
from bunshinfork.memory import ksm
ksm.tuner.boost()
ksm.tuner.release()
print("boosted", flush=True)
if sys.argv[1] == "wait":
    time.sleep(300)
"""


@pytest.fixture
def marked_knobs() -> Iterator[None]:
    """Distinctive knob values, so a restore is told apart from ksmd's defaults."""
    ksm.tuner.relax_now()
    ksm.reconcile()
    assert not ksm.tuner.boosted() and not ksm.BOOST_PATH.exists()
    original = ksm.knobs()
    ksm.set_knobs(MARK)
    yield
    ksm.set_knobs(original)


def child(mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "boosted\n"
    return proc


def boosted() -> bool:
    return {k: ksm.knobs()[k] for k in ksm.BOOST} == ksm.BOOST


def test_exit_restores_knobs(marked_knobs: None) -> None:
    proc = child("exit")
    assert proc.wait(timeout=30) == 0
    assert ksm.knobs() == MARK
    assert not ksm.BOOST_PATH.exists()


def test_last_holder_restores(marked_knobs: None) -> None:
    first, second = child("wait"), child("wait")
    assert boosted()
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=30)
    # SIGTERM without a handler skips atexit: the record still names the dead pid until pruned.
    assert ksm.reconcile(), "second holder is alive: ksmd must stay boosted"
    assert boosted()
    os.kill(second.pid, signal.SIGKILL)
    second.wait(timeout=30)
    assert boosted(), "nothing has noticed the kill yet"
    # gc (`bunshin gc`) is the documented sweep after crashes.
    workspace.gc()
    assert ksm.knobs() == MARK
    assert not ksm.BOOST_PATH.exists()


def test_in_process_boost_then_relax(marked_knobs: None) -> None:
    ksm.tuner.boost()
    assert boosted() and ksm.tuner.boosted()
    ksm.tuner.release()
    # ksmd stays boosted until merging settles, then the relaxer restores the knobs.
    wait_for(lambda: ksm.knobs() == MARK, timeout=60)
    assert not ksm.tuner.boosted()
