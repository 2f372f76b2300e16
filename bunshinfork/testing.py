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

For those who add a subsystem or a memory engine, check_part(part) and check_engine(engine)
check the contract every one must keep (as scikit-learn's check_estimator does for an
estimator): run them over the new one in a test.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from . import memory
from .contract import Build, Check, Part
from .errors import KernelFeatureError
from .memory.engines import ENGINES, Engine, best
from .memory.engines.base import KINDS
from .spec import WorkspaceSpec
from .state import Record, Status, new_id
from .workspace import Snapshot, Workspace

Setup = Callable[[Workspace], object]


# ---- contract checks for parts and engines ----


def _probes_never_raise(owner: str, probes: tuple[Callable[[], Check], ...]) -> None:
    for probe in probes:
        name = getattr(probe, "__name__", repr(probe))
        try:
            result = probe()
        except Exception as e:
            raise AssertionError(f"{owner}: probe {name} raised {type(e).__name__}: {e} (a probe reports a "
                                 "failed Check instead)") from e
        assert isinstance(result, Check), f"{owner}: probe {name} returned {result!r}, not a Check"
        assert isinstance(result.ok, bool) and isinstance(result.required, bool), \
            f"{owner}: probe {name}: ok and required must be bools: {result!r}"
        assert result.name and result.detail, f"{owner}: probe {name} must name itself and say why: {result!r}"


def _half_built() -> Build:
    """A Build whose record exists but no part has prepared anything yet: what a create that
    failed at its first step leaves for release."""
    ws_id = new_id()
    rec = Record(id=ws_id, status=Status.CREATING, creator_pid=os.getpid(), created_at=time.time(),
                 hostname=ws_id, spec=WorkspaceSpec())
    return Build(rec)


def check_part(part: Part) -> None:
    """Raise AssertionError where `part` breaks the subsystem contract (contract.py): it has a
    name; its probes return Checks and never raise, and check() returns one Check per probe;
    release() is idempotent and fine on a half-built Build; gc() returns a list of strings.

    gc() runs for real: it removes this part's host-wide leftovers, as `bunshin gc` does."""
    assert isinstance(part, Part), f"{part!r} is not a contract.Part"
    assert isinstance(part.name, str) and part.name, f"{part!r} has no name"
    owner = f"part {part.name!r}"
    assert isinstance(part.probes, tuple), f"{owner}: probes must be a tuple of callables"
    _probes_never_raise(owner, part.probes)
    checks = part.check()
    assert isinstance(checks, list) and all(isinstance(c, Check) for c in checks), \
        f"{owner}: check() must return a list of Checks, got {checks!r}"
    assert len(checks) >= len(part.probes), f"{owner}: check() dropped probes ({len(checks)} < {len(part.probes)})"
    b = _half_built()
    for attempt in ("first", "second"):
        try:
            part.release(b)
        except Exception as e:
            raise AssertionError(f"{owner}: the {attempt} release() of a half-built Build raised "
                                 f"{type(e).__name__}: {e}") from e
    removed = part.gc()
    assert isinstance(removed, list) and all(isinstance(r, str) for r in removed), \
        f"{owner}: gc() must return a list of strings, got {removed!r}"


def check_engine(engine: Engine) -> None:
    """Raise AssertionError where a memory `engine` breaks the engine contract (memory/engines/):
    it is registered under its name; its kind is one of base.KINDS; its rank is an int that no
    other engine shares, and ENGINES is in rank order; available() is a bool and the reason an
    unavailable engine gives is a non-empty str ("" when available); its probes return Checks and
    never raise; resolve() accepts it exactly where it is available and 'auto' is the best one."""
    assert isinstance(engine, Engine), f"{engine!r} is not a memory Engine"
    assert isinstance(engine.name, str) and engine.name, f"{engine!r} has no name"
    owner = f"engine {engine.name!r}"
    assert ENGINES.get(engine.name) is engine, f"{owner} is not registered in ENGINES under its name"
    assert engine.kind in KINDS, f"{owner}: kind {engine.kind!r} is none of {KINDS}"
    assert isinstance(engine.rank, int) and not isinstance(engine.rank, bool), f"{owner}: rank must be an int"
    ranks = [e.rank for e in ENGINES.values()]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks), \
        f"ENGINES must be in strictly increasing rank order, got {ranks}"
    ok = engine.available()
    assert isinstance(ok, bool), f"{owner}: available() returned {ok!r}, not a bool"
    why = engine.unavailable_reason()
    assert isinstance(why, str), f"{owner}: unavailable_reason() returned {why!r}, not a str"
    assert bool(why) != ok, f"{owner}: available()={ok} but its reason is {why!r}"
    _probes_never_raise(owner, engine.probes)
    if ok:
        assert memory.resolve(engine.name) == engine.name, f"{owner} is available but resolve() picks another"
    else:
        try:
            memory.resolve(engine.name)
        except KernelFeatureError as e:
            assert str(e) == why, f"{owner}: resolve() says {e} where the engine says {why}"
        else:
            raise AssertionError(f"{owner} is unavailable ({why}) but resolve() accepts it")
    top = best()
    assert memory.resolve("auto") == top.name and top.available(), "'auto' must be the best available engine"
    assert all(e.rank <= top.rank for e in ENGINES.values() if e.available()), \
        f"'auto' picked {top.name!r} over an available engine of higher rank"


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
