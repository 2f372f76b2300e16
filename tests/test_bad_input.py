"""Bad input never reaches the host (Hypothesis, over the SDK and the CLI).

Each example feeds odd input (paths with "..", planted symlinks, NULs and huge sizes; specs
with odd values; commands with odd bytes; random command lines) and expects a typed error
or a correct result, never an untyped exception. Around each example the host's mounts,
cgroups, this process's fds and children, and a canary directory tree are compared, and the
canary's secret never comes back through the files API.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import run_ok
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bunshinfork import state
from bunshinfork.cgroups import leftover_cgroups
from bunshinfork.cli import main
from bunshinfork.commands import CommandResult
from bunshinfork.errors import BunshinError, WorkspaceNotFound
from bunshinfork.process.restore import _children
from bunshinfork.spec import WorkspaceSpec
from bunshinfork.workspace import Workspace

CANARY = Path("/var/tmp/bunshin-canary")
SECRET = b"canary-secret-7f3a"
# Symlinks planted inside the workspace, each aimed at the canary (or the host root) the way an
# agent trying to escape would: absolute, relative with too many "..", through /proc, in loops.
PLANTED = {
    "/root/to-canary": str(CANARY),
    "/root/to-secret": str(CANARY / "secret"),
    "/root/up": "../../../../../../../../" + str(CANARY).lstrip("/"),
    "/root/to-root": "/",
    "/root/via-proc": f"/proc/{os.getpid()}/root{CANARY}",
    "/root/self": "/proc/self/root/var/tmp",
    "/root/loop-a": "loop-b",
    "/root/loop-b": "loop-a",
    "/tmp/dir-link": "/root",
}
SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        dirs.sort()
        for name in sorted(dirs + files):
            p = Path(dirpath, name)
            st_ = p.lstat()
            h.update(f"{p.relative_to(root)}|{st_.st_mode}|{st_.st_size}|{st_.st_mtime_ns}\n".encode())
            if p.is_file() and not p.is_symlink():
                h.update(p.read_bytes())
            elif p.is_symlink():
                h.update(os.readlink(p).encode())
    return h.hexdigest()


def _mounts() -> list[str]:
    # Mount ids and the optional fields change with peers elsewhere; the rest is the mount.
    return sorted(" ".join(line.split()[3:5]) + " " + line.split(" - ")[1]
                  for line in Path("/proc/self/mountinfo").read_text().splitlines())


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return out


def host_state(pidfds: bool = True) -> dict[str, Any]:
    fds = _fds() if pidfds else {k: v for k, v in _fds().items() if v != "anon_inode:[pidfd]"}
    return {"mounts": _mounts(), "cgroups": sorted(leftover_cgroups()), "fds": fds,
            "children": _children(), "canary": _tree_digest(CANARY), "workspaces": sorted(state.all_ids())}


@pytest.fixture(scope="module")
def canary() -> Iterator[Path]:
    shutil.rmtree(CANARY, ignore_errors=True)
    (CANARY / "sub").mkdir(parents=True)
    (CANARY / "secret").write_bytes(SECRET)
    (CANARY / "sub" / "file").write_bytes(SECRET * 3)
    os.symlink("../secret", CANARY / "sub" / "link")
    try:
        yield CANARY
    finally:
        shutil.rmtree(CANARY, ignore_errors=True)


@pytest.fixture(scope="module")
def planted(canary: Path) -> Iterator[Workspace]:
    """One workspace for all file examples, with the escape symlinks planted from inside, and a
    fifo that nothing reads or writes."""
    with Workspace.create() as ws:
        _plant(ws)
        yield ws


def _plant(ws: Workspace) -> None:
    """The planted links and fifos, and /root that holds them (a command's default cwd), made
    again where an example removed them: a remove of "/root" or "." is a correct result."""
    run_ok(ws, "mkdir -p -m 700 /root", cwd="/")
    for link, target in PLANTED.items():
        run_ok(ws, ["ln", "-sfn", target, link], cwd="/")
    run_ok(ws, "for f in /root/fifo /tmp/fifo; do [ -p $f ] || mkfifo $f; done", cwd="/")


def checked(op: Callable[[], Any], pidfds: bool = True) -> Any:
    """Run one example: a typed error or a result, and the host exactly as it was (a destroyed
    workspace's init is reaped, and its pidfd closed, by a background thread: allow a moment).
    pidfds=False: the example may keep a pidfd of a workspace it created and destroyed."""
    before = host_state(pidfds)
    try:
        result = op()
    except BunshinError as e:
        result = e
    deadline = time.monotonic() + 5
    while (after := host_state(pidfds)) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    event(type(result).__name__)
    return result


# ---- the files API through planted symlinks ----

COMPONENTS = st.sampled_from(["..", ".", "", "root", "tmp", "etc", "var", "to-canary", "to-secret", "up",
                              "to-root", "via-proc", "self", "loop-a", "dir-link", "secret", "sub", "file",
                              "link", "bunshin-canary", "new", "x" * 300, "dev", "zero", "full", "ptmx",
                              "fifo", "proc", "1", "root", "sys"])
ODD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
PATHS = st.one_of(
    st.lists(st.one_of(COMPONENTS, ODD_TEXT), min_size=1, max_size=8).map("/".join),
    st.lists(st.one_of(COMPONENTS, ODD_TEXT), min_size=1, max_size=8).map(lambda c: "/" + "/".join(c)),
    st.just("a\0b"), st.just("/root/to-canary/secret\0"), st.just("x" * 5000), st.just(""),
)
DATA = st.one_of(st.binary(max_size=2048), st.text(max_size=256), st.sampled_from([b"", b"\0" * 65536]))


def _no_secret(value: Any) -> None:
    if isinstance(value, (bytes, str)):
        raw = value if isinstance(value, bytes) else value.encode(errors="surrogateescape")
        assert SECRET not in raw, "the canary's content came back through the files API"
    elif isinstance(value, list):
        assert not any(e.name in ("secret", "sub") and e.path.startswith(str(CANARY)) for e in value)
        names = {e.name for e in value}
        assert not ({"secret", "sub"} <= names), "a listing showed the canary directory"


@SETTINGS
@given(op=st.sampled_from(["read", "read_bytes", "write", "list", "exists", "remove", "make_dir"]),
       path=PATHS, data=DATA)
def test_files_api_never_reaches_the_host(planted: Workspace, op: str, path: str, data: bytes | str) -> None:
    ws = planted
    calls: dict[str, Callable[[], Any]] = {
        "read": lambda: ws.files.read(path),
        "read_bytes": lambda: ws.files.read(path, format="bytes"),
        "write": lambda: ws.files.write(path, data),
        "list": lambda: ws.files.list(path),
        "exists": lambda: ws.files.exists(path),
        "remove": lambda: ws.files.remove(path),
        "make_dir": lambda: ws.files.make_dir(path),
    }
    try:
        result = checked(calls[op])
    except UnicodeDecodeError:
        return  # read(format="text") of a binary file: the caller asked for text
    _no_secret(result)
    if "\0" in path:
        assert isinstance(result, BunshinError), f"{op}({path!r}) must refuse a NUL, got {result!r}"
    if op == "write" and not isinstance(result, BunshinError):
        raw = data.encode() if isinstance(data, str) else data
        assert ws.files.read(path, format="bytes") == raw
    # The planted links are still there for the next example (a remove of one is put back).
    _plant(ws)


# ---- specs ----

ODD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                       ODD_TEXT, st.sampled_from(["..", "/", "../../", "a\0b", "-1", "1e9G", "docker:",
                                                  "docker:../x", "/nonexistent"]),
                       st.lists(st.integers(), max_size=2), st.dictionaries(ODD_TEXT, ODD_TEXT, max_size=2))
# Per field, values a user might mean (so that some workspaces are made) among the odd ones.
SPEC_VALUES = {
    "rootfs": st.sampled_from(["host", str(CANARY), "/etc", "/"]),
    "hostname": st.sampled_from(["box", "a" * 63, "a" * 64, "-x", "x\n", "bad_name"]),
    "memory_limit": st.sampled_from(["64M", "1G", 1 << 40, 16 << 20, "0.5G", "15M", 0]),
    "pids_limit": st.sampled_from([4, 64, 10**6, 3, 2**63]),
    "network": st.sampled_from(["none", "bridge ", "host"]),
    "env": st.dictionaries(st.sampled_from(["A", "PATH", "LD_PRELOAD", "X=Y", ""]), st.sampled_from(["1", "/x", "\0"]),
                           max_size=2),
    "cgroup": st.sampled_from(["auto", "v1", "v2", "v3"]),
    "ksm": st.booleans(), "mount_sysfs": st.booleans(), "privileged": st.booleans(), "nat": st.booleans(),
    "userns": st.booleans(),
}
ODD_DIRS = st.sampled_from(["relative", ".", "..", "a\0b", "/nonexistent-bunshin", str(CANARY / "secret"), ""])


@SETTINGS
@given(fields=st.fixed_dictionaries({}, optional={f: v | ODD_VALUES for f, v in SPEC_VALUES.items()}),
       bogus=st.booleans(), storage_dir=st.one_of(st.none(), ODD_DIRS))
def test_odd_specs_are_typed_errors(canary: Path, fields: dict[str, Any], bogus: bool, storage_dir: str | None
                                    ) -> None:
    # A storage_dir that exists is used as asked (a layer directory is made in it): only odd
    # ones here. "debian" would debootstrap.
    if storage_dir is not None:
        fields["storage_dir"] = storage_dir
    if bogus:
        fields["bogus"] = 1
    if fields.get("rootfs") == "debian":
        fields["rootfs"] = "debian:sid"

    def create() -> None:
        with Workspace.create(WorkspaceSpec(), **fields) as ws, contextlib.suppress(BunshinError):
            ws.commands.run("echo ok", timeout=20)

    checked(create)


# ---- commands ----

COMMANDS = st.one_of(st.text(max_size=200), st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
                     st.lists(st.text(max_size=20), min_size=1, max_size=4),
                     st.sampled_from(["a\0b", "x" * 200_000, "cd ..; cd ..; ls /", "\udcff", ["echo", "a\0b"], []]))


@SETTINGS
@given(cmd=COMMANDS,
       cwd=st.sampled_from([None, None, None, "/", "/tmp", "..", "../..", "/root/to-canary", "/root/fifo"]) | PATHS,
       env=st.sampled_from([None, None, None, {"A": "1"}]) | st.dictionaries(ODD_TEXT, ODD_TEXT, max_size=2))
def test_odd_commands_are_typed_errors_or_results(planted: Workspace, cmd: Any, cwd: str | None,
                                                  env: dict[str, str] | None) -> None:
    result = checked(lambda: planted.commands.run(cmd, cwd=cwd, env=env, timeout=20))
    assert isinstance(result, (CommandResult, BunshinError)), result
    assert run_ok(planted, "echo alive").stdout == "alive\n"


# ---- the command line ----

ARGS = st.one_of(ODD_TEXT, st.sampled_from(["--", "-", "--all", "--json", "--timeout", "0", "-1", "nan",
                                            "--memory", "1e99G", "--pids", "3", "--cwd", "../..", "--env", "=",
                                            "a\0b", "ws-000000000000", "../ws", ".hidden", "x" * 5000,
                                            "--template", "--image", "--from", "docker:../x", "oci:rel", "ls", "rm"]))
SUBCOMMANDS = st.sampled_from(["create", "exec", "ls", "info", "memory", "rm", "doctor", "nosuch", "--help",
                               "--version", "fork", "snapshot", "template"])


@SETTINGS
@given(argv=st.tuples(SUBCOMMANDS, st.lists(ARGS, max_size=5)).map(lambda t: [t[0], *t[1]]))
def test_odd_command_lines_exit_cleanly(planted: Workspace, argv: list[str]) -> None:
    if argv[0] == "rm" and "--all" in argv:
        return  # other sessions' workspaces live in the same state root
    if argv[0] in ("exec", "info", "memory", "rm", "fork", "snapshot") and len(argv) > 1 and argv[1] == "--":
        argv.insert(1, planted.id)  # reach a real workspace sometimes
    if argv[0] == "rm":
        argv = [a for a in argv if a != planted.id]
    before = set(state.all_ids())

    def run() -> int:
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse: usage errors and --help
                rc = e.code if isinstance(e.code, int) else 2
        assert "Traceback" not in err.getvalue(), err.getvalue()
        # A create that succeeded made a workspace: take it apart again.
        for ws_id in set(state.all_ids()) - before:
            Workspace.connect(ws_id).destroy()
        assert isinstance(rc, int), (rc, out.getvalue())
        return rc

    # `bunshin create` in-process keeps the new workspace's pidfd (a real CLI process exits).
    checked(run, pidfds=False)
    assert planted.is_running()


@pytest.mark.parametrize("ws_id", ["x" * 5000, "..", "../ws", "", "a\0b", "ws-\udcff" * 80])
def test_ids_that_cannot_name_a_workspace_name_none(ws_id: str) -> None:
    """Found by the command-line example above: `bunshin rm` of a 5000-byte id raised the
    OSError of its too-long path (ENAMETOOLONG) instead of saying there is no such workspace."""
    with pytest.raises(WorkspaceNotFound):
        Workspace.connect(ws_id)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            rc = main(["rm", ws_id])
        except SystemExit as e:
            rc = e.code
    # The CLI refuses what is not an id's form as a usage error (podman's 125); an id of the
    # right form (the long one) is looked up, and names no workspace (status 1).
    said = err.getvalue()
    if ws_id.isalnum():
        assert rc == 1 and "no workspace" in said, said
    else:
        assert (rc, "no workspace" in said or "is not a workspace id" in said) in ((1, True), (125, True)), said
