"""A pytest plugin (entry point `bunshinfork.testing`) for tests that run in workspaces.

Installed with bunshin, it gives every test suite on the host:

- `bunshin_workspace`: a fresh Workspace for one test, destroyed after it;
- `bunshin_prepared`: a Prepared workspace for the whole session: created from the
  `bunshin_spec` fixture, set up once by the `bunshin_setup` fixture (override either in
  your conftest.py), snapshotted, and forked as often as a test likes;
- `bunshin_fork`: a fork of `bunshin_prepared` for one test, destroyed after it.

For Hypothesis, every example should start from the same state without paying for a new
container: in a `@given` test, take a fork per example with `bunshin_prepared.fork()` (a
session-scoped fixture, so Hypothesis does not share one fork between examples); a stateful
test subclasses ForkedStateMachine, whose every example starts in `self.workspace`, a fork of
the machine's prepared snapshot (set up once per session by its `setup` classmethod). Unless
the suite picks a Hypothesis profile itself, the plugin loads one without the 200 ms deadline
(a fork alone takes longer) and without the too_slow health check.

README's "Testing with bunshin" shows them in a 20-line example.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .spec import WorkspaceSpec
from .workspace import Snapshot, Workspace

Setup = Callable[[Workspace], object]


class Prepared:
    """A workspace set up once and kept as a retained snapshot; fork() gives running copies.

    The source workspace is destroyed as soon as its snapshot is taken: only the snapshot
    (images and file-system layer) stays, until release().
    """

    def __init__(self, spec: WorkspaceSpec | None = None, setup: Setup | None = None, memory: str = "auto") -> None:
        self.spec = spec
        self.setup = setup
        self.memory = memory
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()

    @property
    def snapshot(self) -> Snapshot:
        """The retained snapshot, taken on first use."""
        with self._lock:
            if self._snapshot is None:
                with Workspace.create(self.spec) as ws:
                    if self.setup is not None:
                        self.setup(ws)
                    self._snapshot = ws.snapshot(self.memory)
            return self._snapshot

    def fork_one(self) -> Workspace:
        """One running fork; the caller destroys it."""
        (clone,) = self.snapshot.fork(1, self.memory)
        if isinstance(clone, Exception):
            raise clone
        return clone

    @contextlib.contextmanager
    def fork(self) -> Iterator[Workspace]:
        """A running fork for the block, destroyed after it."""
        ws = self.fork_one()
        try:
            yield ws
        finally:
            ws.destroy()

    def release(self) -> None:
        with self._lock:
            if self._snapshot is not None:
                self._snapshot.release()
                self._snapshot = None


_machines: dict[type, Prepared] = {}
_machines_lock = threading.Lock()


def _release_machines() -> None:
    with _machines_lock:
        for prepared in _machines.values():
            prepared.release()
        _machines.clear()


atexit.register(_release_machines)

try:
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import RuleBasedStateMachine
except ImportError:  # pragma: no cover - hypothesis is optional for the plain fixtures
    RuleBasedStateMachine = object  # type: ignore[assignment,misc]
    settings = None  # type: ignore[assignment]

# A fork takes a few hundred milliseconds and the first example of a session also prepares
# the snapshot: Hypothesis's 200 ms deadline would fail every such test on timing alone.
PROFILE = "bunshinfork"
if settings is not None:
    settings.register_profile(PROFILE, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class ForkedStateMachine(RuleBasedStateMachine):  # type: ignore[misc,valid-type]
    """A Hypothesis state machine whose every example starts in `self.workspace`: a fork of
    a snapshot prepared once per session (by `setup`, from `spec`), destroyed at teardown.
    `memory` is the engine of that snapshot and of the fork."""

    spec: WorkspaceSpec | None = None
    memory = "auto"

    @classmethod
    def setup(cls, ws: Workspace) -> None:
        """Prepare the workspace every example starts from (runs once per session)."""

    @classmethod
    def prepared(cls) -> Prepared:
        with _machines_lock:
            if cls not in _machines:
                _machines[cls] = Prepared(cls.spec, cls.setup, cls.memory)
            return _machines[cls]

    def __init__(self) -> None:
        super().__init__()
        self.workspace = type(self).prepared().fork_one()

    def teardown(self) -> None:
        self.workspace.destroy()


# ---- fixtures ----


@pytest.fixture(scope="session")
def bunshin_spec() -> WorkspaceSpec | None:
    """What `bunshin_prepared` is created from (override it; None: WorkspaceSpec())."""
    return None


@pytest.fixture(scope="session")
def bunshin_setup() -> Setup | None:
    """How `bunshin_prepared` is set up before it is snapshotted (override it)."""
    return None


@pytest.fixture(scope="session")
def bunshin_memory() -> str:
    """The memory engine `bunshin_prepared` is snapshotted and forked with."""
    return "auto"


@pytest.fixture(scope="session")
def bunshin_prepared(bunshin_spec: WorkspaceSpec | None, bunshin_setup: Setup | None,
                     bunshin_memory: str) -> Iterator[Prepared]:
    prepared = Prepared(bunshin_spec, bunshin_setup, bunshin_memory)
    try:
        yield prepared
    finally:
        prepared.release()


@pytest.fixture
def bunshin_fork(bunshin_prepared: Prepared) -> Iterator[Workspace]:
    with bunshin_prepared.fork() as ws:
        yield ws


@pytest.fixture
def bunshin_workspace(bunshin_spec: WorkspaceSpec | None) -> Iterator[Workspace]:
    with Workspace.create(bunshin_spec) as ws:
        yield ws


def pytest_configure(config: Any) -> None:
    """Hypothesis without its deadline (see PROFILE), unless the suite chose a profile itself
    (--hypothesis-profile, or load_profile in its conftest)."""
    if settings is not None and settings.get_current_profile_name() == "default" and \
            not config.getoption("hypothesis_profile", None):
        settings.load_profile(PROFILE)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """State machines' snapshots outlive their tests (every example forks them): drop them."""
    _release_machines()
