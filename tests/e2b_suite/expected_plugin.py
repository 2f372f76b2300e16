"""A pytest plugin loaded into E2B's own suite at run time (`-p expected_plugin`), so that the
suite's files stay unchanged: the tests named in expected_failures.txt for this mode are marked
xfail(strict=True), so one that starts passing fails the run (XPASS(strict)) and the list shrinks.

The list and the mode come from the runner (tests/e2b_suite/run.py) through the environment.
An entry that names a test in a collected file but matches no collected test is an error: a
renamed or removed test must not leave a stale excuse behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from expected_list import Entry, load

LIST_ENV = "BUNSHIN_E2B_EXPECTED"
MODE_ENV = "BUNSHIN_E2B_MODE"


def _entries() -> dict[str, Entry]:
    mode = os.environ[MODE_ENV]
    return {e.node_id: e for e in load(Path(os.environ[LIST_ENV])) if mode in e.modes}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = _entries()
    collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    seen = set()
    for item in items:
        entry = entries.get(item.nodeid)
        if entry is not None:
            seen.add(item.nodeid)
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"[{entry.category}] {entry.evidence}"))
    if any("::" in arg for arg in config.args):
        return  # narrowed to node ids: the files' other tests were never collected
    stale = [n for n in entries if n not in seen and n.split("::", 1)[0] in collected_files]
    if stale:
        raise pytest.UsageError(f"expected_failures.txt names tests this suite does not have: {stale}")
