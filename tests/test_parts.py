"""bunshinfork's subsystems are parts with one contract: create, fork, gc and doctor go through
the registered parts only, and only memory/ knows the memory engines by name."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bunshinfork
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


def _imports(name: str, path: Path, modules: dict[str, Path] | set[str],
             source: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in `path` (or `source`, as if it
    were that file), TYPE_CHECKING ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
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


# ---- layering: the core below workspace.py, the entrances above it ----

# The entrances: the asyncio tree, E2B's tree, E2B's HTTP server and the command line. Only they
# and the package's face import them.
ENTRANCES = ("bunshinfork.aio", "bunshinfork.e2b", "bunshinfork.sandbox", "bunshinfork.serve", "bunshinfork.cli")


def _entrance(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in ENTRANCES)


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {t for t, _ in _imports(name, path, modules) if t != name} for name, path in modules.items()}


def _below(graph: dict[str, set[str]], top: str) -> set[str]:
    """Every module `top` imports, directly or through others."""
    seen: set[str] = set()
    stack = [top]
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_nothing_below_workspace_imports_an_entrance() -> None:
    modules = _modules()
    graph = _graph(modules)
    core = _below(graph, "bunshinfork.workspace")
    # The core really is below it (the rule cannot pass by finding nothing there).
    for name in ("pipeline", "contract", "state", "process", "memory", "fs", "network", "cgroups"):
        assert f"bunshinfork.{name}" in core, name
    assert sorted(m for m in core if _entrance(m)) == []
    for name in core:
        reached = sorted(t for t in graph[name] if _entrance(t))
        assert reached == [], f"{name} imports {reached}"
    # And no other module does, but the entrances and the package's face.
    others = {name: sorted(t for t in targets if _entrance(t)) for name, targets in graph.items()
              if not _entrance(name) and name != "bunshinfork"}
    assert {n: ts for n, ts in others.items() if ts} == {}
    # The check sees such an import.
    fake = _below({"bunshinfork.workspace": {"bunshinfork.pipeline"}, "bunshinfork.pipeline": {"bunshinfork.aio"}},
                  "bunshinfork.workspace")
    assert any(_entrance(m) for m in fake)


def _native_imports(source: str) -> list[int]:
    """Lines that import the compiled module bunshinfork._native, however spelled."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hit = any(a.name.split(".")[-1] == "_native" for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            hit = (node.module or "").split(".")[-1] == "_native" or any(a.name == "_native" for a in node.names)
        elif isinstance(node, ast.Call):  # importlib.import_module("bunshinfork._native")
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            hit = called in ("import_module", "__import__") and any(
                isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.endswith("._native")
                for a in node.args)
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return lines


def test_only_native_imports_the_compiled_module() -> None:
    found = {name: lines for name, path in _modules().items()
             if name != "bunshinfork.native" and (lines := _native_imports(path.read_text()))}
    assert found == {}, f"import bunshinfork.native instead of _native: {found}"
    assert _native_imports((PACKAGE / "native.py").read_text())  # the one that does
    for spelled in ("from .._native import ffi\n", "from bunshinfork import _native\n", "import bunshinfork._native\n",
                    "importlib.import_module('bunshinfork._native')\n"):
        assert _native_imports(spelled) == [1], spelled


PUBLIC_MODULES = ("bunshinfork.aio", "bunshinfork.aio.commands", "bunshinfork.aio.files", "bunshinfork.aio.pool",
                  "bunshinfork.aio.workspace", "bunshinfork.commands", "bunshinfork.files", "bunshinfork.hosts",
                  "bunshinfork.images.reference", "bunshinfork.images.templates", "bunshinfork.images.warm",
                  "bunshinfork.templates", "bunshinfork.users")


def _public_sdk() -> dict[str, set[str] | None]:
    """What e2b/, serve/ and bunshinrl may import of bunshinfork, by module: the names the package's face exports, from
    the module that defines each; every public name of bunshinfork.errors; the face itself
    (None: any of its exported names)."""
    allowed: dict[str, set[str] | None] = {"bunshinfork": None, "bunshinfork.errors": None}
    # The SDK's other public modules: the asyncio tree, and those whose objects a Workspace's
    # public attributes hand out (ws.commands, ws.pty, ws.files, the accounts files the
    # commands run as), the template store (`bunshin template`), the image reference grammar
    # (serve's template allowlist compares names as it parses them), this process's host and a
    # named host's teardown (hosts: a pool of hosts, bunshinrl.cluster), and the agent workspaces
    # (templates: the X11 and Wayland desktops and the web shop, a documented feature of the SDK,
    # docs/architecture.md, whose package face is its API; not its _modules); any of their public
    # names.
    allowed |= dict.fromkeys(PUBLIC_MODULES)
    for name in bunshinfork.__all__:
        obj = getattr(bunshinfork, name)
        home = getattr(obj, "__module__", None) if not isinstance(obj, type(bunshinfork)) else obj.__name__
        if home and home.startswith("bunshinfork") and allowed.get(home, set()) is not None:
            allowed.setdefault(home, set()).add(getattr(obj, "__name__", name))  # type: ignore[union-attr]
    return allowed


def _beyond_the_sdk(name: str, path: Path, modules: set[str], source: str | None = None,
                    own: tuple[str, ...] = ("bunshinfork.e2b", "bunshinfork.serve")) -> list[str]:
    """The imports of bunshinfork in `path` beyond the public SDK; those of `own` (the importer's
    own tree: e2b/ and serve/ for themselves) are not counted."""
    allowed = _public_sdk()
    out = []
    for target, names in _imports(name, path, modules, source):
        if (own and target.startswith(own)) or not target.startswith("bunshinfork"):
            continue
        if target not in allowed:
            out += [f"{name} imports {target}.{n}" for n in names] or [f"{name} imports {target}"]
            continue
        exported = allowed[target]
        if target == "bunshinfork":
            exported = set(bunshinfork.__all__)
        elif target == "bunshinfork.errors":
            exported = {n for n in vars(bunshinfork.errors) if not n.startswith("_")}
        elif target in PUBLIC_MODULES:
            out += [f"{name} imports {target}.{n}" for n in names if n.startswith("_")]
            continue
        assert exported is not None
        out += [f"{name} imports {target}.{n}" for n in names if n not in exported]
    return out


def test_e2b_imports_only_the_public_sdk() -> None:
    """e2b/ is a client of the SDK as E2B's users are: it imports what bunshinfork exports (and
    its errors), never the core. Until e2b/ exists this checks nothing there."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        # E2B's HTTP server (serve/) is held to the same rule: it serves E2B through e2b/.
        if name.startswith(("bunshinfork.e2b", "bunshinfork.serve")):
            found += _beyond_the_sdk(name, path, set(modules))
    assert found == []
    # The check itself: the face's names and the errors pass; the core does not.
    fake = PACKAGE / "e2b" / "probe.py"
    ok = "from ..workspace import Workspace\nfrom ..errors import SpecError\nfrom .. import Sandbox\n"
    assert _beyond_the_sdk("bunshinfork.e2b.probe", fake, set(modules), ok) == []
    bad = "from ..state import Record\nfrom ..workspace import _capture\nfrom .. import pipeline\n"
    assert len(_beyond_the_sdk("bunshinfork.e2b.probe", fake, set(modules), bad)) == 3



def test_bunshinrl_imports_only_the_public_sdk() -> None:
    """bunshinrl is a client of bunshinfork as its users are (issue 37): it imports what the
    package's face exports, bunshinfork.errors and the public modules (PUBLIC_MODULES), never the
    core: a pool host's teardown is bunshinfork.teardown_host() / reap_orphans(), a speculation's
    egress hold Workspace.hold_egress(), a saved snapshot's size bunshinfork.tree_bytes()."""
    sdk = set(_modules())
    found = []
    for name, path in _rl_modules().items():
        found += _beyond_the_sdk(name, path, sdk, own=())
    assert found == []
    # The check itself, from a file of bunshinrl: the face, the errors and a public module pass;
    # the core, a private name of a public module and e2b/'s insides do not.
    fake = RL_PACKAGE / "cluster" / "probe.py"
    ok = ("from bunshinfork import Workspace, HostConfig\nfrom bunshinfork.errors import ForkError\n"
          "from bunshinfork.templates import start_gui\nfrom bunshinfork.host import HostConfig\n")
    assert _beyond_the_sdk("bunshinrl.cluster.probe", fake, sdk, ok, own=()) == []
    bad = ("from bunshinfork import native, state\nfrom bunshinfork.host import HOST\n"
           "from bunshinfork.network import egress\nfrom bunshinfork.templates import _common\n"
           "from bunshinfork.e2b.dispatch import dispatch\n")
    assert len(_beyond_the_sdk("bunshinrl.cluster.probe", fake, sdk, bad, own=())) == 6


# ---- no module reads another object's _attribute ----

def _private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every `x._name` where x is not self, cls, super(), type(self), a
    module the file imports, nor the class the expression sits in (dunder names are not private)."""
    tree = ast.parse(source)
    modules = set(vars(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.update(a.asname or a.name for a in node.names if a.name[:1].islower() or a.name.startswith("_"))
    reads: list[tuple[int, str]] = []

    def own(value: ast.expr, classes: tuple[str, ...]) -> bool:
        if isinstance(value, ast.Name):
            return value.id in ("self", "cls") or value.id in modules or value.id in classes
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            return value.func.id == "super" or (value.func.id == "type" and len(value.args) == 1
                                                and isinstance(value.args[0], ast.Name) and value.args[0].id == "self")
        return False

    def visit(node: ast.AST, classes: tuple[str, ...]) -> None:
        if isinstance(node, ast.ClassDef):
            classes = (*classes, node.name)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and not own(node.value, classes):
            reads.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, classes)

    visit(tree, ())
    return reads


def test_no_module_reads_another_objects_private_attribute() -> None:
    found = {name: reads for name, path in _modules().items()
             if (reads := _private_reads(path.read_text()))}
    assert found == {}, f"reads of another object's _attribute: {found}"
    # The check itself: what it catches, and what it lets pass.
    assert [e for _, e in _private_reads("def f(ws):\n    return ws._rec, a.b._c, f()._d\n")] == \
        ["ws._rec", "a.b._c", "f()._d"]
    fine = ("import os\nfrom . import native as _n\n\nclass A:\n    def f(self):\n        "
            "return self._x, os._exit, _n._y, super()._z, type(self)._w, A._v, self.__class__\n")
    assert _private_reads(fine) == []


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
        assert _stage(log, "restore") == [*pipeline.RESTORE, "probe"]
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


def _spells_proc_root(text: str) -> bool:
    """Whether a string (an f-string's values as {}) names /proc/<something>/root."""
    i = text.find("/proc/")
    while i >= 0:
        seg, sep, after = text[i + len("/proc/"):].partition("/")
        if sep and seg and after.startswith("root") and (len(after) == 4 or after[4] in "/{%"):
            return True
        i = text.find("/proc/", i + 1)
    return False


def _proc_root_lines(source: str) -> list[int]:
    """Lines that reach a workspace by /proc/<pid>/root: in one string or f-string, or pieced
    together (os.path.join, Path's /, +) from "/proc" and "root". Docstrings may name it."""
    tree = ast.parse(source)
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            if _spells_proc_root(text):
                out.add(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if _spells_proc_root(node.value):
                out.add(node.lineno)
        elif isinstance(node, (ast.Call, ast.BinOp)):
            pieces = [n.value.strip("/") for n in ast.walk(node)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            if "proc" in pieces and any(p.split("/")[0] == "root" for p in pieces):
                out.add(node.lineno)
    return sorted(out)


def test_only_inroot_reaches_into_a_workspace_by_a_host_path() -> None:
    """A path joined onto /proc/<init>/root is resolved from the host's root at the first absolute
    symlink inside (issue 36: a workspace's /.bunshin led into another's, its /home to the host's
    /tmp). bunshinfork.inroot resolves under the workspace's root; nothing else opens it."""
    found = {}
    for package in (PACKAGE, PACKAGE.parent / "bunshinrl"):
        for path in sorted(package.rglob("*.py")):
            if path != PACKAGE / "inroot.py" and (lines := _proc_root_lines(path.read_text())):
                found[str(path.relative_to(PACKAGE.parent))] = lines
    assert found == {}, f"reach a workspace's files through bunshinfork.inroot, not /proc/<pid>/root: {found}"
    assert _proc_root_lines((PACKAGE / "inroot.py").read_text())  # the one that does
    for spelled in ('f"/proc/{pid}/root{inside}"\n', '"/proc/%d/root" % pid\n', 'os.open(f"/proc/{p}/root", 0)\n',
                    'os.path.join("/proc", str(pid), "root")\n', 'Path("/proc") / str(pid) / "root" / "home"\n',
                    '"/proc/" + str(pid) + "/root/x"\n', 'x = "/proc/self/root"\n'):
        assert _proc_root_lines(spelled) == [1], spelled
    assert _proc_root_lines('"""reached through /proc/<init>/root"""\nf"/proc/{pid}/fd/{n}"\n"/proc/1/rootx"\n') == []


# ---- bunshinrl: the same import rules, and its folders as floors ----

RL_PACKAGE = PACKAGE.parent / "bunshinrl"
# bunshinrl's folders, lowest first (bunshinrl/README.md's table): a module imports its own floor
# and those below it, never one above; the package's face, demo and grpo (training's old name)
# stand above them all.
RL_FLOORS = ("_async", "calls", "states", "prefix", "speculation", "rollout", "policies", "envs", "training",
             "adapters", "cluster")


def _rl_modules() -> dict[str, Path]:
    out = {}
    for path in sorted(RL_PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(RL_PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _rl_floor(module: str) -> int:
    parts = module.split(".")
    return RL_FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in RL_FLOORS else len(RL_FLOORS)


def _rl_findings(name: str, path: Path, modules: dict[str, Path],
                 source: str | None = None) -> tuple[set[str], list[str], list[str]]:
    """(modules imported, private names taken from another module, imports reaching a floor up)."""
    edges, private, upward = set(), [], []
    for target, names in _imports(name, path, modules, source):
        if target != name:
            edges.add(target)
        private += [f"{name} imports {target}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__") and not target.startswith(name + ".")]
        if _rl_floor(target) > _rl_floor(name):
            upward.append(f"{name} imports {target}")
    return edges, private, upward


def test_bunshinrl_has_no_cycle_no_private_import_and_floors_one_way() -> None:
    modules = _rl_modules()
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    upward: list[str] = []
    for name, path in modules.items():
        graph[name], p, u = _rl_findings(name, path, modules)
        private += p
        upward += u
    assert private == []
    assert upward == [], "a floor of bunshinrl reaches up (see RL_FLOORS)"

    def reaches(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return [*trail, nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
        return None

    cycles = [c for m in modules if (c := reaches(m))]
    assert cycles == [], cycles[0]
    # Only the face, its shared asyncio helpers and the demo's entry point are loose.
    loose = sorted(m for m, p in modules.items() if p.parent == RL_PACKAGE and m != "bunshinrl")
    assert loose == ["bunshinrl._async", "bunshinrl.demo"]
    # The checker finds what it is for.
    task = RL_PACKAGE / "calls" / "task.py"
    _, p, u = _rl_findings("bunshinrl.calls.task", task, modules,
                           "from ..rollout.core import Rollout\nfrom ..prefix.cache import _ewma\n")
    assert u == ["bunshinrl.calls.task imports bunshinrl.rollout.core",
                 "bunshinrl.calls.task imports bunshinrl.prefix.cache"]
    assert p == ["bunshinrl.calls.task imports bunshinrl.prefix.cache._ewma"]


# ---- bunshinrl: no reads of another object's privates, small files, a core that sequences ----

# The rollout core: the modules split from rollout/core.py (issue 37). The engine, wiring and
# audit drive it from above and are not counted.
RL_CORE = ("core", "services", "starts", "sample", "sample_state", "warm", "rewind", "captures", "speculating")
RL_MAX_LINES = 400
RL_MAX_CACHE_VERBS = 8


def _cache_verbs(source: str) -> set[str]:
    """The methods called on the prefix cache (`cache.x(...)` or `<anything>.cache.x(...)`)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if (isinstance(owner, ast.Name) and owner.id == "cache") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "cache"):
                out.add(node.func.attr)
    return out


def _state_assignments(source: str) -> list[int]:
    """Lines assigning a sample's state (`x.state = ...`, `x._state = ...`, `x.state.y = ...`)
    outside Rollout._enter, the one checked transition (None, "not started yet", may be set)."""
    out = []

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return list(node.targets)
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def touches_state(t: ast.expr) -> bool:
        while isinstance(t, ast.Attribute):
            if t.attr in ("state", "_state"):
                return True
            t = t.value
        return False

    def walk(node: ast.AST, in_enter: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_enter or (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == "_enter")
            value = getattr(child, "value", None)
            unset = isinstance(value, ast.Constant) and value.value is None  # "not started yet"
            if not inside and not unset and any(touches_state(t) for t in targets(child)):
                out.append(child.lineno)
            walk(child, inside)

    walk(ast.parse(source), False)
    return out


def test_bunshinrl_reads_no_private_attribute_of_another_object() -> None:
    """bunshinfork's rule (_private_reads), over bunshinrl."""
    found = {str(p.relative_to(RL_PACKAGE.parent)): reads for p in sorted(RL_PACKAGE.rglob("*.py"))
             if (reads := _private_reads(p.read_text()))}
    assert found == {}, "reach another object through its documented methods, not its _attributes"
    assert sorted(_private_reads("self.core._background(x)\ncache._lock\nws._rec.network\n")) == \
        [(1, "self.core._background"), (2, "cache._lock"), (3, "ws._rec")]
    assert _private_reads("self._x\ncls._y\nsuper()._z()\nx.__class__\n") == []


def test_bunshinrl_files_are_small() -> None:
    long = {str(p.relative_to(RL_PACKAGE.parent)): n for p in sorted(RL_PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > RL_MAX_LINES}
    assert long == {}, f"split these by concern (at most {RL_MAX_LINES} lines a file)"


def test_the_rollout_core_holds_few_of_the_caches_verbs_and_moves_state_only_by_transition() -> None:
    verbs: set[str] = set()
    assignments = {}
    for name in RL_CORE:
        source = (RL_PACKAGE / "rollout" / f"{name}.py").read_text()
        verbs |= _cache_verbs(source)
        if lines := _state_assignments(source):
            assignments[name] = lines
    assert len(verbs) <= RL_MAX_CACHE_VERBS, f"the core uses {len(verbs)} of the cache's verbs: {sorted(verbs)}"
    assert assignments == {}, "a sample's state changes only through Rollout._enter (sample_state.transition)"
    # The whole package assigns no state outside the transition either.
    others = {str(p.relative_to(RL_PACKAGE.parent)): lines for p in sorted(RL_PACKAGE.rglob("*.py"))
              if (lines := _state_assignments(p.read_text()))}
    assert others == {}
    # The checkers see what they are for.
    assert _cache_verbs("self.core.cache.begin(n, c)\ncache.attach(n, p)\nother.lookup(x)\n") == {"begin", "attach"}
    assert _state_assignments("r.state = Live(ws)\nself.state.shadow = t\nself._state = None\n"
                              "def _enter(self, new):\n    self._state = transition(self._state, new)\n") == [1, 2]


# ---- bunshinrl: one list of the engine's configurations ----

def _config_lists(source: str) -> list[int]:
    """Lines of a tuple, list or set literal naming Base, Spec and Full together (the list of
    configurations spelled out again), or an `x in ("Spec", "Full")`-style test of two of them
    (which parts a configuration turns on: configs.speculates, configs.caches)."""
    names = {"Base", "Spec", "Full"}

    def named(node: ast.AST) -> set[str]:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return {e.value for e in node.elts if isinstance(e, ast.Constant)} & names  # type: ignore[misc]
        return set()

    def membership(node: ast.AST) -> bool:
        return isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
            and any(len(named(c)) == 2 for c in node.comparators)

    return sorted(n.lineno for n in ast.walk(ast.parse(source))  # type: ignore[attr-defined]
                  if len(named(n)) == 3 or membership(n))


def test_one_list_of_configurations() -> None:
    """Base, Spec and Full are listed once, in bunshinrl/rollout/configs.py; every driver,
    benchmark and demo names them (and asks which parts each turns on) from there (issue 37)."""
    from bunshinrl.rollout import configs

    root = PACKAGE.parent
    found = {}
    for path in sorted([*RL_PACKAGE.rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        if path != RL_PACKAGE / "rollout" / "configs.py" and (lines := _config_lists(path.read_text())):
            found[str(path.relative_to(root))] = lines
    assert found == {}, f"name the configurations from bunshinrl.rollout.configs: {found}"
    assert _config_lists((RL_PACKAGE / "rollout" / "configs.py").read_text())  # the one list
    assert _config_lists('choices=("Base", "Spec", "Full")\nif c in ("Spec", "Full"):\n    pass\n') == [1, 2]
    assert _config_lists('for n in ("Base", "Full"):\n    pass\n') == []  # a pair compared, not the list
    assert configs.CONFIGS == ("Base", "Spec", "Full")
    assert [c for c in configs.CONFIGS if configs.speculates(c)] == ["Spec", "Full"]
    assert [c for c in configs.CONFIGS if configs.caches(c)] == ["Full"]
    with pytest.raises(ValueError, match="one of Base, Spec, Full"):
        configs.check_config("CRIU")


def test_one_agent_loop() -> None:
    """The loop that asks the policy and runs its calls is written once (rollout/agent_loop.py):
    RolloutEngine and ClusterEngine both run AgentLoop; only the policy contract's checker and
    the fault-injecting policy wrapper call a policy's act() elsewhere (issue 37)."""
    allowed = {RL_PACKAGE / "rollout" / "agent_loop.py", RL_PACKAGE / "calls" / "contract.py",
               RL_PACKAGE / "envs" / "faults.py"}
    callers = sorted(str(p.relative_to(RL_PACKAGE)) for p in RL_PACKAGE.rglob("*.py")
                     if p not in allowed and re.search(r"\.act\(", p.read_text()))
    assert callers == [], f"drive the policy through bunshinrl.rollout.agent_loop.AgentLoop: {callers}"
    for driver in ("rollout/engine.py", "cluster/engine.py"):
        assert "AgentLoop(" in (RL_PACKAGE / driver).read_text(), driver
