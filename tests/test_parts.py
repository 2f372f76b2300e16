"""bunshinfork's subsystems are parts with one contract: create, fork, gc and doctor go through
the registered parts only, and only memory/ knows the memory engines by name."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bunshinfork import Workspace, doctor, pipeline
from bunshinfork.cgroups import Cgroup
from bunshinfork.contract import Build, Capture, Captured, Check, Held, Part
from bunshinfork.memory import ENGINES
from bunshinfork.memory.engines import Engine
from bunshinfork.testing import check_engine, check_part

PACKAGE = Path(__file__).resolve().parent.parent / "bunshinfork"
ENGINE_NAMES = {"copy", "ksm", "cow"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in `path`, TYPE_CHECKING ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    yield sub, []  # `from . import x` imports the module x
                elif target in modules:
                    yield target, [a.name]


def test_no_import_cycle_and_no_private_imports() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for target, names in _imports(name, path, modules):
            if target != name:
                graph[name].add(target)
            # A package's face may hand on what its own modules define; nothing else takes
            # another module's private names.
            private += [f"{name} imports {target}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__") and not target.startswith(name + ".")]
    assert private == []

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return [*path, nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for m in modules if (c := cycle_from(m))]
    assert cycles == [], cycles[0]


def _engine_branches(tree: ast.AST) -> list[int]:
    """Lines that compare a value with a memory engine's name, or match on one."""

    def names(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in ENGINE_NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names(e) for e in node.elts)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(names(x) for x in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue) \
                and names(node.pattern.value):
            lines.append(node.pattern.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) \
                and any(k is not None and names(k) for k in node.value.keys):
            lines.append(node.lineno)
    return lines


def test_only_memory_branches_on_the_engine_name() -> None:
    found = {}
    for name, path in _modules().items():
        if name == "bunshinfork.memory" or name.startswith("bunshinfork.memory."):
            continue
        if lines := _engine_branches(ast.parse(path.read_text())):
            found[name] = lines
    assert found == {}, f"outside memory/, these lines branch on a memory engine's name: {found}"
    # The check itself sees such a branch.
    assert _engine_branches(ast.parse("if memory == 'cow':\n    pass\n")) == [1]
    assert _engine_branches(ast.parse("x = engine in ('ksm', 'copy')\n")) == [1]


# ---- the pipeline goes through the registered parts ----


class Recorder(Part):
    """Wraps a registered part and records every call the pipeline makes on it."""

    def __init__(self, inner: Part, log: list[tuple[str, str]]) -> None:
        self.inner = inner
        self.name = inner.name
        self.probes = inner.probes
        self.log = log

    def prepare(self, b: Build) -> None:
        self.log.append((self.name, "prepare"))
        self.inner.prepare(b)

    def capture(self, c: Capture) -> None:
        self.log.append((self.name, "capture"))
        self.inner.capture(c)

    def restore(self, b: Build) -> None:
        self.log.append((self.name, "restore"))
        self.inner.restore(b)

    def release(self, held: Held) -> None:
        self.log.append((self.name, "release " + type(held).__name__))
        self.inner.release(held)

    def gc(self) -> list[str]:
        self.log.append((self.name, "gc"))
        return self.inner.gc()

    def check(self) -> list[Check]:
        self.log.append((self.name, "check"))
        return self.inner.check()


class Probe(Part):
    """A sixth subsystem registered beside the five: it sees every stage, with what it holds."""

    name = "probe"

    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log
        self.seen: dict[str, Any] = {}
        self.probes = (self._check,)

    @staticmethod
    def _check() -> Check:
        return Check("probe", True, "asked by doctor", required=False)

    def prepare(self, b: Build) -> None:
        self.log.append((self.name, "prepare"))
        # Every part before it has recorded its state; the workspace is already running.
        assert b.rec.fs and b.rec.cgroups and b.rec.process and b.rec.network and b.source is None
        self.seen["created"] = b.rec.id

    def capture(self, c: Capture) -> None:
        self.log.append((self.name, "capture"))
        assert c.source.cgroups is not None
        self.seen["frozen during capture"] = Cgroup(c.source.cgroups).frozen()

    def restore(self, b: Build) -> None:
        self.log.append((self.name, "restore"))
        assert b.source is not None and b.rec.process and b.rec.parent == b.source.meta.source
        self.seen["restored"] = b.rec.id

    def release(self, held: Held) -> None:
        self.log.append((self.name, "release " + type(held).__name__))
        self.seen.setdefault("released", []).append(held.rec.id if isinstance(held, Build) else held.meta.id)

    def gc(self) -> list[str]:
        self.log.append((self.name, "gc"))
        return ["probe-leftover"]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[str, str]], Probe]:
    log: list[tuple[str, str]] = []
    probe = Probe(log)
    monkeypatch.setattr(pipeline, "PARTS", (*(Recorder(p, log) for p in pipeline.PARTS), probe))
    return log, probe


def _stage(log: list[tuple[str, str]], stage: str) -> list[str]:
    return [name for name, s in log if s == stage]


def test_create_fork_gc_and_doctor_go_through_the_parts(recorded: tuple[list[tuple[str, str]], Probe]) -> None:
    log, probe = recorded
    assembly = [p.name for p in pipeline.PARTS]
    assert assembly == ["fs", "cgroups", "memory", "process", "network", "probe"]

    ws = Workspace.create()
    try:
        assert _stage(log, "prepare") == assembly
        assert probe.seen["created"] == ws.id
        ws.files.write("/root/f", "before the fork\n")

        log.clear()
        snap = ws.snapshot("copy")
        assert _stage(log, "capture") == [*pipeline.CAPTURE, "probe"]
        assert probe.seen["frozen during capture"] is True
        assert not ws._cgroup().frozen()

        log.clear()
        (clone,) = snap.fork(1)
        assert isinstance(clone, Workspace), clone
        assert _stage(log, "restore") == assembly
        assert probe.seen["restored"] == clone.id
        assert clone.files.read("/root/f") == "before the fork\n"

        log.clear()
        clone.destroy()
        snap.release()
        assert _stage(log, "release Build") == assembly[::-1]
        assert _stage(log, "release Captured") == assembly[::-1]
        assert probe.seen["released"] == [clone.id, snap.id]
    finally:
        ws.destroy()

    log.clear()
    removed = pipeline.gc()
    # The process part first: a CRIU whose caller died may still be restoring into what the others remove.
    assert _stage(log, "gc") == ["process", *(n for n in assembly if n != "process")]
    assert removed["probe"] == ["probe-leftover"]

    log.clear()
    checks = doctor.run_checks()
    assert _stage(log, "check") == assembly[:-1]  # the probe part is a plain Part: its own check()
    assert any(c.name == "probe" and c.detail == "asked by doctor" for c in checks)


def test_a_failing_part_releases_every_part(recorded: tuple[list[tuple[str, str]], Probe],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in the last stage of create undoes every stage, through the parts."""
    log, probe = recorded

    def refuse(b: Build) -> None:
        raise RuntimeError("probe refuses")

    monkeypatch.setattr(probe, "prepare", refuse)
    with pytest.raises(RuntimeError, match="probe refuses"):
        Workspace.create()
    assert _stage(log, "release Build") == [p.name for p in pipeline.PARTS][::-1]


def test_captured_state_is_typed() -> None:
    """A snapshot's meta and a workspace's record load back as the dataclasses they were saved as."""
    from bunshinfork.state import Record, SnapshotMeta

    with Workspace.create() as ws, ws.snapshot("copy") as snap:
        rec = Record.load(ws.id)
        assert rec == ws._rec
        meta = SnapshotMeta.load(snap.dir)
        assert meta.memory == "copy" and meta.fs is not None and meta.fs.layer is not None
        assert isinstance(Captured(meta, snap.dir).meta.spec, type(rec.spec))


# ---- every registered part and engine keeps the contract (bunshinfork.testing) ----


@pytest.mark.parametrize("part", pipeline.PARTS, ids=lambda p: p.name)
def test_every_part_keeps_the_contract(part: Part) -> None:
    check_part(part)


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_keeps_the_contract(name: str) -> None:
    check_engine(ENGINES[name])


class _Sloppy(Part):
    """A part that breaks the contract in the ways check_part looks for, one at a time."""

    name = "sloppy"

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.released = 0
        self.probes = (self._probe,)

    def _probe(self) -> Check:
        if self.fault == "probe":
            raise OSError("no such file")
        return Check("sloppy", True, "fine", required=False)

    def release(self, held: Held) -> None:
        self.released += 1
        if self.fault == "release" and self.released > 1:
            raise RuntimeError("released twice")
        if self.fault == "half-built" and isinstance(held, Build):
            assert held.rec.fs is not None

    def gc(self) -> list[str]:
        return None if self.fault == "gc" else []  # type: ignore[return-value]


@pytest.mark.parametrize(("fault", "says"), [("probe", "probe _probe raised OSError"),
                                             ("release", "second release"), ("half-built", "first release"),
                                             ("gc", "gc\\(\\) must return a list")])
def test_check_part_catches_a_broken_part(fault: str, says: str) -> None:
    with pytest.raises(AssertionError, match=says):
        check_part(_Sloppy(fault))
    check_part(_Sloppy("none"))  # and passes one that keeps it


class _Liar(Engine):
    """An engine that says it is available while giving a reason it is not."""

    name = "liar"
    rank = 99

    def unavailable_reason(self) -> str:
        return "no such device"

    def available(self) -> bool:
        return True


def test_check_engine_catches_a_broken_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    liar = _Liar()
    with pytest.raises(AssertionError, match="not registered"):
        check_engine(liar)
    monkeypatch.setitem(ENGINES, liar.name, liar)
    with pytest.raises(AssertionError, match="available\\(\\)=True but its reason"):
        check_engine(liar)
    monkeypatch.setattr(_Liar, "available", lambda self: False)
    monkeypatch.setattr(_Liar, "rank", ENGINES["copy"].rank)
    with pytest.raises(AssertionError, match="rank order"):
        check_engine(liar)
