"""bunshinfork's Sandbox against the installed e2b SDK: every public method, property and
parameter of e2b.Sandbox, e2b.AsyncSandbox, their commands, files and pty modules, their
handles, and CommandResult, EntryInfo, SandboxInfo and friends must exist in bunshinfork with
the same name, parameters (order, kind, default), sync/async nature and return shape. What
cannot apply to one host is listed below with the reason; nothing else may be missing.

The walk goes over the real package (`import e2b`), so an e2b upgrade that adds a method or
a parameter fails here until bunshinfork follows or lists it.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import typing
from typing import Any

import e2b
import pytest
from e2b.sandbox_async.commands.command import Commands as E2BAsyncCommands
from e2b.sandbox_async.commands.pty import Pty as E2BAsyncPty
from e2b.sandbox_async.filesystem.filesystem import Filesystem as E2BAsyncFilesystem
from e2b.sandbox_sync.commands.command import Commands as E2BCommands
from e2b.sandbox_sync.commands.pty import Pty as E2BPty
from e2b.sandbox_sync.filesystem.filesystem import Filesystem as E2BFilesystem

import bunshinfork
from bunshinfork import aio, commands, files, state, watch
from bunshinfork.e2b import sandbox

E2B_VERSION = "2.63.0"

TRANSPORT = "E2B's cloud transport (API and envd URLs, domains, access tokens); a local sandbox has none"
# Members of E2B's classes that cannot apply to one host, with the reason. The test fails if
# one of them turns up implemented (then it must be compared), or if any other is missing.
NOT_LOCAL: dict[str, dict[str, str]] = {
    "Sandbox": {
        "__init__": "E2B's constructor is deprecated ('use Sandbox.create()') and takes cloud connection options",
        "connection_config": TRANSPORT,
        "envd_api_url": TRANSPORT,
        "envd_direct_url": TRANSPORT,
        "sandbox_domain": TRANSPORT,
        "traffic_access_token": TRANSPORT,
        "download_url": "a signed HTTPS URL of envd's file endpoint in E2B's cloud; files go through openat2 here",
        "upload_url": "a signed HTTPS URL of envd's file endpoint in E2B's cloud; files go through openat2 here",
        "get_mcp_url": "the MCP gateway of E2B's cloud templates",
        "get_mcp_token": "the MCP gateway of E2B's cloud templates",
        "mcp_port": "the MCP gateway of E2B's cloud templates",
        "default_mcp_template": "the MCP gateway of E2B's cloud templates",
        "git": "deprecated by E2B: 'Run git with sandbox.commands.run() instead'",
    },
    "Commands": {"__init__": "built by the sandbox from its envd connection"},
    "Filesystem": {"__init__": "built by the sandbox from its envd connection"},
    "Pty": {"__init__": "built by the sandbox from its envd connection"},
    "CommandHandle": {"__init__": "built from envd's RPC event stream"},
    "WatchHandle": {"__init__": "built from envd's RPC watcher"},
}
NOT_LOCAL["AsyncSandbox"] = NOT_LOCAL["Sandbox"]
NOT_LOCAL["AsyncCommandHandle"] = NOT_LOCAL["CommandHandle"]
NOT_LOCAL["AsyncWatchHandle"] = NOT_LOCAL["WatchHandle"]

# Parameters bunshinfork accepts and ignores, with the reason (the signature walk checks they
# are there; the semantics tests check the ones it refuses rather than ignore).
IGNORED_PARAMETERS = {
    "opts": "E2B's API options (api_key, domain, region, request headers, proxy): no cloud to reach",
    "request_timeout": "a deadline for one HTTP request to envd; local calls have their own (the init's reply "
                       "timeout)",
    "gzip": "compression of E2B's file transfers; nothing is transferred",
    "use_octet_stream": "E2B's upload encoding; nothing is uploaded",
    "stream_idle_timeout": "an idle timeout of E2B's download stream; a local read does not stall",
    "secure": "deprecated by E2B; envd access is always secured",
    "idempotency_key": "retries of E2B's create request; a local create is not retried",
    "logger": "E2B's HTTP request logging: bunshinfork logs create/kill to it instead",
    "allow_network_mounts": "watching NFS/SMB/FUSE paths; a workspace has no network mounts",
}

# E2B's classes and bunshinfork's; the modules of a sandbox are compared by its instances.
PAIRS = [
    (e2b.Sandbox, bunshinfork.Sandbox),
    (e2b.AsyncSandbox, bunshinfork.AsyncSandbox),
    (E2BCommands, commands.Commands),
    (E2BAsyncCommands, aio.AsyncCommands),
    (E2BFilesystem, files.Files),
    (E2BAsyncFilesystem, aio.AsyncFiles),
    (E2BPty, commands.Pty),
    (E2BAsyncPty, aio.AsyncPty),
    (e2b.CommandHandle, bunshinfork.CommandHandle),
    (e2b.AsyncCommandHandle, bunshinfork.AsyncCommandHandle),
    (e2b.WatchHandle, bunshinfork.WatchHandle),
    (e2b.AsyncWatchHandle, bunshinfork.AsyncWatchHandle),
]
DATACLASSES = [
    (e2b.CommandResult, bunshinfork.CommandResult),
    (e2b.EntryInfo, bunshinfork.EntryInfo),
    (e2b.WriteInfo, bunshinfork.WriteInfo),
    (e2b.SandboxInfo, bunshinfork.SandboxInfo),
    (e2b.ProcessInfo, bunshinfork.ProcessInfo),
    (e2b.PtySize, bunshinfork.PtySize),
    (e2b.SandboxQuery, bunshinfork.SandboxQuery),
    (e2b.SandboxMetrics, bunshinfork.SandboxMetrics),
    (e2b.SnapshotInfo, bunshinfork.SnapshotInfo),
    (e2b.FilesystemEvent, bunshinfork.FilesystemEvent),
]
ENUMS = [(e2b.FileType, bunshinfork.FileType), (e2b.SandboxState, bunshinfork.SandboxState),
         (e2b.FilesystemEventType, bunshinfork.FilesystemEventType)]
EXCEPTIONS = ["SandboxException", "TimeoutException", "InvalidArgumentException", "NotFoundException",
              "FileNotFoundException", "SandboxNotFoundException", "CommandExitException"]

# What a name in one of E2B's return annotations is called here.
RENAMED = {"Filesystem": {"Files", "AsyncFiles"}, "Commands": {"Commands", "AsyncCommands"}, "Pty": {"Pty", "AsyncPty"},
           "FileStreamReader": {"FileStreamReader", "AsyncFileStreamReader"}}
TYPING_WORDS = {"Optional", "Union", "List", "list", "Dict", "dict", "Literal", "Any", "None", "NoneType", "typing",
                "Callable", "Awaitable", "Coroutine", "Generic", "OutputT", "T", "Unpack", "ApiParams", "Sequence",
                "Iterable", "AsyncIterable", "IO", "Mapping", "tuple", "Tuple", "ForwardRef"}
# E2B's handles and results are generic in their output type (str, or None without retained
# output); bunshinfork's carry `str | None` in the same fields.
GENERIC_OUTPUT = re.compile(r"\b(CommandResult|CommandHandle|AsyncCommandHandle)\[[^\[\]]*(\[[^\]]*\])?[^\]]*\]")


def _members(cls: type) -> list[str]:
    names = [n for n in dir(cls) if not n.startswith("_")]
    names += [n for n in ("__init__", "__enter__", "__exit__", "__aenter__", "__aexit__", "__iter__", "__aiter__")
              if n in vars(cls) or any(n in vars(b) for b in cls.__mro__[1:-1] if b.__module__.startswith("e2b"))]
    return sorted(set(names))


def _kind(raw: Any) -> str:
    if isinstance(raw, property):
        return "property"
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if type(raw).__name__ in ("class_method_variant", "instance_or_class", "async_instance_or_class"):
        return "instance-or-class"
    if callable(raw):
        return "method"
    return "value"


def _sandbox_instance(cls: type) -> Any:
    """A Sandbox object over a record (no workspace behind it): its modules are attributes."""
    rec = state.Record(id="ws-000000000000", status="running", creator_pid=0, created_at=0.0, hostname="x",
                       spec=bunshinfork.WorkspaceSpec())
    sbx = bunshinfork.Sandbox(bunshinfork.Workspace(rec))
    return sbx if cls is bunshinfork.Sandbox else cls(sbx)


def _leaves(annotation: Any, owner: str) -> set[str]:
    """The class names a return annotation mentions, without typing's scaffolding."""
    if annotation is inspect.Signature.empty or annotation is None:
        return set()
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    text = GENERIC_OUTPUT.sub(r"\1", text)
    names = {t.rsplit(".", 1)[-1] for t in re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", text)}
    names = {owner if n in ("Self", "S", "W") else n for n in names}
    return names - TYPING_WORDS


def _e2b_returns(cls: type, name: str) -> set[str]:
    fn = inspect.getattr_static(cls, name)
    fn = getattr(fn, "method", None) or getattr(fn, "__func__", None) or fn
    found = _leaves(inspect.signature(fn).return_annotation, cls.__name__)
    for ov in typing.get_overloads(fn):
        found |= _leaves(inspect.signature(ov).return_annotation, cls.__name__)
    return found


def _our_returns(cls: type, name: str) -> set[str]:
    raw = inspect.getattr_static(cls, name)
    fn = getattr(raw, "method", None) or getattr(raw, "__func__", None) or raw
    ann = inspect.signature(fn).return_annotation
    return _leaves(ann, cls.__name__)


def _params(fn: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]


def _compare_signature(where: str, theirs: Any, ours: Any) -> list[str]:
    problems = []
    tp, op = _params(theirs), _params(ours)
    named_theirs = [p for p in tp if p.kind is not p.VAR_KEYWORD]
    if any(p.kind is p.VAR_KEYWORD for p in tp) and not any(p.kind is p.VAR_KEYWORD for p in op):
        problems.append(f"{where}: E2B takes **{tp[-1].name}, bunshinfork takes no **kwargs")
    named_ours = [p for p in op if p.kind is not p.VAR_KEYWORD]
    for i, t in enumerate(named_theirs):
        if i >= len(named_ours):
            problems.append(f"{where}: parameter {t.name!r} missing")
            continue
        o = named_ours[i]
        if (o.name, o.kind) != (t.name, t.kind):
            problems.append(f"{where}: parameter {i} is {o.name!r} ({o.kind.name}), E2B's is {t.name!r} "
                            f"({t.kind.name})")
        elif t.default is not t.empty and o.default != t.default:
            problems.append(f"{where}: {t.name}={o.default!r}, E2B's default is {t.default!r}")
    for extra in named_ours[len(named_theirs):]:
        if extra.default is extra.empty and extra.kind is not extra.VAR_POSITIONAL:
            problems.append(f"{where}: extra parameter {extra.name!r} has no default (E2B's calls would fail)")
    return problems


@pytest.fixture(scope="module", autouse=True)
def _installed_version() -> None:
    assert e2b.__version__ if hasattr(e2b, "__version__") else True
    from importlib.metadata import version

    assert version("e2b") == E2B_VERSION, "the conformance lists were written against this e2b version"


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=lambda c: getattr(c, "__qualname__", str(c)))
def test_members_and_signatures(theirs: type, ours: type) -> None:
    not_local = NOT_LOCAL.get(theirs.__name__, {})
    assert all(reason for reason in not_local.values())
    problems: list[str] = []
    instance = _sandbox_instance(ours) if issubclass(ours, bunshinfork.Sandbox | bunshinfork.AsyncSandbox) else None
    for name in _members(theirs):
        where = f"{theirs.__name__}.{name}"
        if name in not_local:
            continue
        raw_theirs = inspect.getattr_static(theirs, name)
        try:
            raw_ours = inspect.getattr_static(ours, name)
        except AttributeError:
            if instance is not None and hasattr(instance, name):
                continue  # a module of the sandbox, set per instance (compared in its own pair)
            problems.append(f"{where}: missing in {ours.__name__}")
            continue
        kind_theirs, kind_ours = _kind(raw_theirs), _kind(raw_ours)
        if kind_theirs != kind_ours:
            problems.append(f"{where}: a {kind_ours} in bunshinfork, a {kind_theirs} in E2B")
            continue
        if kind_theirs == "value":
            if raw_ours != raw_theirs:
                problems.append(f"{where} = {raw_ours!r}, E2B's is {raw_theirs!r}")
            continue
        if kind_theirs == "property":
            continue
        # A method usable on an instance or, given an id, on the class: compare what it wraps.
        fn_theirs = raw_theirs.method if kind_theirs == "instance-or-class" else getattr(theirs, name)
        fn_ours = raw_ours.method if kind_ours == "instance-or-class" else getattr(ours, name)
        if inspect.iscoroutinefunction(fn_theirs) != inspect.iscoroutinefunction(fn_ours):
            problems.append(f"{where}: {'async' if inspect.iscoroutinefunction(fn_theirs) else 'sync'} in E2B")
        problems += _compare_signature(where, fn_theirs, fn_ours)
        want = _e2b_returns(theirs, name)
        have = _our_returns(ours, name)
        missing = {n for n in want if not ({n} | RENAMED.get(n, set())) & have}
        if missing:
            problems.append(f"{where}: returns {sorted(have)}, E2B's returns {sorted(want)}")
    # Listed as not local: must really be absent, or it should be compared.
    for name in not_local:
        if name != "__init__" and hasattr(ours, name):
            problems.append(f"{theirs.__name__}.{name} is listed as not local but bunshinfork has it")
    assert problems == [], "\n".join(problems)


def test_the_sandbox_modules_are_the_compared_classes() -> None:
    for sbx_cls, mods in ((bunshinfork.Sandbox, (commands.Commands, files.Files, commands.Pty)),
                          (bunshinfork.AsyncSandbox, (aio.AsyncCommands, aio.AsyncFiles, aio.AsyncPty))):
        sbx = _sandbox_instance(sbx_cls)
        assert (type(sbx.commands), type(sbx.files), type(sbx.pty)) == mods


@pytest.mark.parametrize(("theirs", "ours"), DATACLASSES, ids=lambda c: c.__name__)
def test_dataclass_shapes(theirs: type, ours: type) -> None:
    t_fields = dataclasses.fields(theirs)
    o_fields = dataclasses.fields(ours)
    assert [f.name for f in o_fields[:len(t_fields)]] == [f.name for f in t_fields]
    for t, o in zip(t_fields, o_fields, strict=False):
        assert o.kw_only == t.kw_only, t.name
        t_default = t.default is not dataclasses.MISSING or t.default_factory is not dataclasses.MISSING
        o_default = o.default is not dataclasses.MISSING or o.default_factory is not dataclasses.MISSING
        assert t_default == o_default, f"{theirs.__name__}.{t.name}: default in one only"
        if t.default is not dataclasses.MISSING:
            assert o.default == t.default, t.name
    for extra in o_fields[len(t_fields):]:
        assert extra.default is not dataclasses.MISSING or extra.default_factory is not dataclasses.MISSING, extra


@pytest.mark.parametrize(("theirs", "ours"), ENUMS, ids=lambda c: c.__name__)
def test_enums(theirs: type[enum.Enum], ours: type[enum.Enum]) -> None:
    assert {m.name: m.value for m in theirs} == {m.name: m.value for m in ours}


def test_exceptions_have_e2b_names_and_relations() -> None:
    for name in EXCEPTIONS:
        assert issubclass(getattr(bunshinfork, name), Exception), name
    for a in EXCEPTIONS:
        for b in EXCEPTIONS:
            if issubclass(getattr(e2b, a), getattr(e2b, b)):
                assert issubclass(getattr(bunshinfork, a), getattr(bunshinfork, b)), f"{a} is a {b} in E2B"
    # E2B's CommandExitException is also the command's result.
    assert issubclass(bunshinfork.CommandExitException, bunshinfork.CommandResult)


def test_defaults_of_the_front_door() -> None:
    assert bunshinfork.Sandbox.default_sandbox_timeout == e2b.Sandbox.default_sandbox_timeout == 300
    assert bunshinfork.Sandbox.default_template == e2b.Sandbox.default_template
    from e2b.connection_config import default_username

    assert bunshinfork.Sandbox.conventions.default_user == default_username == "user"
    assert bunshinfork.Sandbox.conventions.login_shell and bunshinfork.Sandbox.conventions.raise_on_exit
    # Workspace keeps bunshin's own: root, no lifetime, fork(count, memory).
    conv = bunshinfork.Workspace.conventions
    assert conv.default_user is None and not conv.raise_on_exit and not conv.login_shell
    assert list(inspect.signature(bunshinfork.Workspace.fork).parameters)[:3] == ["self", "count", "memory"]
    assert list(inspect.signature(bunshinfork.Sandbox.fork).parameters)[:3] == ["self", "timeout", "count"]
    # A Sandbox has a Workspace (composition): the workspace serves E2B's conventions.
    sbx = _sandbox_instance(bunshinfork.Sandbox)
    assert not issubclass(bunshinfork.Sandbox, bunshinfork.Workspace)
    assert isinstance(sbx.workspace, bunshinfork.Workspace)
    assert sbx.workspace.conventions == bunshinfork.Sandbox.conventions and sbx.commands is sbx.workspace.commands


def test_ignored_parameters_are_really_there() -> None:
    """Each accepted-and-ignored parameter exists somewhere in the compared surface."""
    seen: set[str] = set()
    for theirs, ours in PAIRS:
        for name in _members(theirs):
            fn = getattr(ours, name, None)
            if callable(fn):
                with contextlib_suppress():
                    seen |= set(inspect.signature(fn).parameters)
    assert set(IGNORED_PARAMETERS) <= seen, set(IGNORED_PARAMETERS) - seen
    assert all(IGNORED_PARAMETERS.values())


def contextlib_suppress() -> Any:
    import contextlib

    return contextlib.suppress(TypeError, ValueError)


# watch, sandbox: imported so their names resolve in annotations the walk reads.
_ = (watch, sandbox)
