"""E2B's semantics through bunshinfork.Sandbox: the lifetime, timeout=0, CommandExitException,
the login shell, the non-root user that exists in the sandbox, envs and cwd, E2B's commands,
pty and files modules, by-id class calls, snapshots as templates, pause to disk (memory freed,
processes back on connect) and the lifecycle that pauses at the deadline; and Workspace
keeping bunshin's own (root, no lifetime, fork(count), pause() a freeze)."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import HOG, HOG_READY, ask_hog, wait_for

from bunshinfork import (
    CommandExitException,
    CommandHandle,
    CommandResult,
    FileOperationError,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
    SpecError,
    Workspace,
    host_memory,
    state,
)
from bunshinfork.errors import CommandTimeout
from bunshinfork.images import templates as template_store


@pytest.fixture
def sbx() -> Iterator[Sandbox]:
    s = Sandbox.create(envs={"FROM_CREATE": "yes"}, metadata={"suite": "test_sandbox"})
    try:
        yield s
    finally:
        s.kill()


def test_default_lifetime_and_info(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert (info.end_at - info.started_at).total_seconds() == pytest.approx(300, abs=2)
    assert (info.sandbox_id, info.template_id, info.state, info.metadata) == (
        sbx.sandbox_id, "base", SandboxState.RUNNING, {"suite": "test_sandbox"})
    assert Sandbox.get_info(sbx.sandbox_id) == sbx.get_info()  # the class variant, by id


def test_the_lifetime_is_enforced() -> None:
    s = Sandbox.create(timeout=2)
    try:
        wait_for(lambda: not s.is_running(), timeout=60, interval=0.1)
    finally:
        assert s.kill() in (True, False)


def test_set_timeout_and_connect_extend(sbx: Sandbox) -> None:
    Sandbox.set_timeout(sbx.sandbox_id, 30)
    assert (sbx.get_info().end_at.timestamp() - time.time()) == pytest.approx(30, abs=2)
    sbx.connect(timeout=10)  # shorter than what is left: unchanged
    assert (sbx.get_info().end_at.timestamp() - time.time()) == pytest.approx(30, abs=2)
    sbx.connect(timeout=120)
    assert (sbx.get_info().end_at.timestamp() - time.time()) == pytest.approx(120, abs=2)


def test_default_user_login_shell_envs_and_cwd(sbx: Sandbox) -> None:
    r = sbx.commands.run('id -un; echo "$HOME $PWD $FROM_CREATE"; shopt -q login_shell && echo login')
    assert r.stdout == "user\n/home/user /home/user yes\nlogin\n"
    assert "user:x:" in sbx.files.read("/etc/passwd", user="root")  # a real account of the sandbox
    r = sbx.commands.run("echo $PER_CMD; pwd; id -u", envs={"PER_CMD": "1"}, cwd="/tmp", user="root")
    assert r.stdout == "1\n/tmp\n0\n"
    assert sbx.commands.run("ls -ld ~", user="user").stdout.split()[2] == "user"


def test_command_exit_exception(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    e = ei.value
    assert isinstance(e, CommandResult)
    assert (e.stdout, e.stderr, e.exit_code, e.error) == ("out\n", "err\n", 3, "exit status 3")
    assert "exited with code 3" in str(e)
    h = sbx.commands.run("exit 5", background=True)
    with pytest.raises(CommandExitException):
        h.wait()
    # A Workspace returns the result instead, as bunshin's API always has.
    with Workspace.create() as ws:
        assert ws.commands.run("exit 3").exit_code == 3
        assert ws.commands.run("id -u").stdout == "0\n"


def test_timeout_zero_is_no_limit(sbx: Sandbox) -> None:
    assert sbx.commands.run("sleep 1.2; echo done", timeout=0).stdout == "done\n"
    with pytest.raises(CommandTimeout):
        sbx.commands.run("sleep 30", timeout=0.5)


def test_background_stdin_list_connect_kill(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat", background=True, stdin=True)
    assert isinstance(h, CommandHandle)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert listed[h.pid].cmd == "/bin/bash" and listed[h.pid].args == ["-l", "-c", "cat"]
    assert listed[h.pid].cwd == "/home/user" and listed[h.pid].envs["USER"] == "user"
    sbx.commands.send_stdin(h.pid, "one\n")
    h.send_stdin(b"two\n")
    again = sbx.commands.connect(h.pid)
    h.close_stdin()
    assert h.wait().stdout == "one\ntwo\n"
    assert again.wait().stdout == "one\ntwo\n"
    long = sbx.commands.run("sleep 100", background=True)
    assert sbx.commands.kill(long.pid) is True
    with pytest.raises(CommandExitException) as ei:
        long.wait()
    assert ei.value.error == "signal: killed"
    assert sbx.commands.kill(long.pid) is False
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999999)


def test_iterating_a_handle(sbx: Sandbox) -> None:
    h = sbx.commands.run("echo a; echo b >&2; echo c", background=True)
    events = list(h)
    assert "".join(o for o, _, _ in events if o) == "a\nc\n"
    assert "".join(e for _, e, _ in events if e) == "b\n"


def test_pty(sbx: Sandbox) -> None:
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(term.pid, b"stty size; id -un; exit 7\n")
    out = bytearray()
    with pytest.raises(CommandExitException) as ei:
        term.wait(on_pty=out.extend)
    assert ei.value.exit_code == 7
    assert b"40 120" in out and b"user" in out


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("notes/a.txt", io.BytesIO(b"from a file object"), metadata={"Kind": "note"})
    assert (info.name, info.path, info.type) == ("a.txt", "/home/user/notes/a.txt", FileType.FILE)
    sbx.files.write_files([{"path": "notes/b.txt", "data": "b"}, {"path": "notes/c.bin", "data": iter([b"c", b"d"])}])
    entry = sbx.files.get_info("notes/a.txt")
    assert (entry.owner, entry.group, entry.size, entry.permissions) == ("user", "user", 18, "-rw-r--r--")
    assert entry.metadata == {"kind": "note"}
    assert sbx.files.read("notes/c.bin", format="bytes") == bytearray(b"cd")
    assert [e.name for e in sbx.files.list("notes")] == ["a.txt", "b.txt", "c.bin"]
    assert {e.path for e in sbx.files.list("/home/user", depth=2)} >= {"/home/user/notes/a.txt"}
    moved = sbx.files.rename("notes/b.txt", "notes/renamed.txt")
    assert moved.path == "/home/user/notes/renamed.txt" and not sbx.files.exists("notes/b.txt")
    assert sbx.files.make_dir("notes/sub") is True and sbx.files.make_dir("notes/sub") is False
    # The default user cannot write where it may not; root can.
    with pytest.raises(FileOperationError) as ei:
        sbx.files.write("/etc/owned-by-root", "x")
    assert ei.value.errno == 13
    sbx.files.write("/etc/owned-by-root", "x", user="root")
    assert sbx.files.get_info("/etc/owned-by-root").owner == "root"


def test_watch_dir(sbx: Sandbox) -> None:
    w = sbx.files.watch_dir("/home/user", recursive=True, include_entry=True)
    sbx.commands.run("mkdir -p deep/er && echo x > deep/er/f && echo y > top && rm top")
    seen = []

    def got_all() -> bool:
        seen.extend(w.get_new_events())
        return {"deep/er/f", "top"} <= {e.name for e in seen}

    wait_for(got_all, timeout=10)
    kinds = {(e.name, e.type.value) for e in seen}
    assert ("top", "create") in kinds and ("top", "remove") in kinds and ("deep/er/f", "create") in kinds
    assert next(e for e in seen if e.name == "deep/er/f").entry is not None
    w.stop()
    with pytest.raises(FileOperationError):
        w.get_new_events()


def test_fork_takes_e2b_parameters(sbx: Sandbox) -> None:
    sbx.commands.run("echo carried > state.txt")
    forks = sbx.fork(timeout=60, count=2)
    try:
        assert all(isinstance(f, Sandbox) for f in forks)
        for f in forks:
            assert f.commands.run("cat state.txt").stdout == "carried\n"
            assert (f.get_info().end_at.timestamp() - time.time()) == pytest.approx(60, abs=5)
            assert f.get_info().metadata == {"suite": "test_sandbox"}
        (one,) = Sandbox.fork(sbx.sandbox_id)  # by id; count and timeout take E2B's defaults
        forks.append(one)
        assert (one.get_info().end_at.timestamp() - time.time()) == pytest.approx(300, abs=5)
        with pytest.raises(InvalidArgumentException):
            sbx.fork(count=21)
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()


def test_by_id_and_list(sbx: Sandbox) -> None:
    assert Sandbox.kill("ws-000000000000") is False
    with pytest.raises(NotFoundException):
        Sandbox.connect("ws-000000000000")
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "test_sandbox"})).next_items()
    assert [i.sandbox_id for i in listed] == [sbx.sandbox_id]
    assert Sandbox.pause(sbx.sandbox_id) is True and sbx.pause() is False
    assert Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()[0].sandbox_id == sbx.sandbox_id
    Sandbox.connect(sbx.sandbox_id)
    assert sbx.get_info().state == SandboxState.RUNNING
    metrics = sbx.get_metrics()
    assert len(metrics) == 1 and metrics[0].mem_used > 0 and metrics[0].cpu_count >= 1


def test_pause_frees_memory_and_connect_resumes() -> None:
    """E2B's pause: the state goes to disk and the memory back to the host (bunshin's host-cost
    accounting, as `bunshin serve`'s test measures it); connect() brings the processes back with
    their memory and the files as they were, under the same id."""
    with Sandbox.create(timeout=120) as sbx:
        sbx.commands.run(HOG, background=True)
        sbx.commands.run(HOG_READY)
        sbx.files.write("/home/user/kept.txt", "kept")
        (before,) = sbx.get_metrics()
        assert before.mem_used >= 200 << 20 and host_memory([sbx.workspace]).total >= 200 << 20
        assert sbx.pause() is True and sbx.pause() is False
        assert sbx.get_info().state == SandboxState.PAUSED and not sbx.is_running()
        assert sbx.get_metrics() == [] and host_memory([sbx.workspace]).total == 0
        # Only its record is left (its own status), and its state is on disk, not in the state root's tmpfs.
        rec = sbx.workspace.record
        assert rec.status is state.Status.PAUSED and sbx.workspace.info().state == "paused-to-disk"
        assert rec.saved is not None and not Path(rec.saved).is_relative_to(state.RUN_ROOT)
        assert Path(rec.saved).is_dir() and not list(Path(rec.dir).glob("*/"))
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in [i.sandbox_id for i in paused]
        same = Sandbox.connect(sbx.sandbox_id)  # by id: another object, as another process would
        assert same.sandbox_id == sbx.sandbox_id and same.is_running()
        assert ask_hog(same) == str(200 << 20)
        assert same.files.read("/home/user/kept.txt") == "kept"
        assert (same.get_info().end_at.timestamp() - time.time()) == pytest.approx(300, abs=5)  # E2B's default
        assert not Path(rec.saved).exists()
        # The first object sees it running again.
        assert sbx.is_running() and sbx.commands.run("echo back").stdout == "back\n"
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_on_timeout_pause_and_connect() -> None:
    sbx = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        assert sbx.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        sbx.files.write("/tmp/kept.txt", "kept")
        wait_for(lambda: sbx.get_info().state == SandboxState.PAUSED, timeout=60, interval=0.1)
        assert not sbx.is_running() and sbx.workspace.info().state == "paused-to-disk"
        sbx.connect(timeout=60)
        assert sbx.files.read("/tmp/kept.txt") == "kept"
        assert (sbx.get_info().end_at.timestamp() - time.time()) == pytest.approx(60, abs=3)
        sbx.set_timeout(1)  # moves the deadline it pauses at
        wait_for(lambda: sbx.get_info().state == SandboxState.PAUSED, timeout=60, interval=0.1)
        saved = Path(str(sbx.workspace.record.saved))
        assert saved.is_dir()
    finally:
        assert sbx.kill() is True
    assert not saved.exists()  # a paused sandbox's kill removes its saved state too


def test_snapshots_as_templates(sbx: Sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(template_store, "ROOT", tmp_path / "snapshots")
    sbx.commands.run("echo remembered > memo; (sleep 1000 &)")
    info = sbx.create_snapshot(name="my-template")
    assert info.names == ["my-template"]
    assert [s.snapshot_id for s in sbx.list_snapshots().next_items()] == [info.snapshot_id]
    for template in (info.snapshot_id, "my-template"):
        with Sandbox.create(template) as copy:
            assert copy.commands.run("cat memo; pgrep -c sleep").stdout == "remembered\n1\n"
            assert copy.get_info().template_id == template
    assert Sandbox.delete_snapshot(info.snapshot_id) is True
    assert Sandbox.delete_snapshot(info.snapshot_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.create("my-template")


def test_a_saved_template_takes_envs_and_metadata(sbx: Sandbox, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Sandbox.create(<saved template>, envs=...): the clone's commands get the envs on top of the
    snapshot's own, in this process and through Sandbox.connect; a bad name leaves no clone."""
    monkeypatch.setattr(template_store, "ROOT", tmp_path / "snapshots")
    info = sbx.create_snapshot()
    with Sandbox.create(info.snapshot_id, envs={"ADDED": "yes", "FROM_CREATE": "over"},
                        metadata={"k": "v"}) as copy:
        assert copy.commands.run('echo "$ADDED $FROM_CREATE"').stdout == "yes over\n"
        assert copy.get_info().metadata == {"k": "v"}
        assert Sandbox.connect(copy.sandbox_id).commands.run("echo $ADDED").stdout == "yes\n"
    assert sbx.commands.run('echo "${ADDED:-none} $FROM_CREATE"').stdout == "none yes\n"
    before = {w.id for w in Workspace.list()}
    with pytest.raises(SpecError):
        Sandbox.create(info.snapshot_id, envs={"A=B": "x"})
    assert {w.id for w in Workspace.list()} == before
    assert Sandbox.delete_snapshot(info.snapshot_id) is True


def test_cloud_only_options_are_refused_or_ignored() -> None:
    for kwargs in ({"mcp": {"github": {}}}, {"network": {"egress_proxy": {"address": "p:1080"}}},
                   {"iam": {"tokens": {"a": 1}}}, {"volume_mounts": {"/data": "vol"}},
                   {"lifecycle": {"on_timeout": "pause", "auto_resume": True}}, {"lifecycle": {"on_timeout": "stop"}}):
        with pytest.raises(InvalidArgumentException):
            Sandbox.create(**kwargs)  # type: ignore[arg-type]
    # Transport options configure E2B's cloud: accepted and ignored.
    with Sandbox.create(api_key="e2b_x", domain="example.com", request_timeout=5, secure=True,
                        lifecycle={"on_timeout": "kill"}, timeout=60) as s:
        assert s.commands.run("echo ok", request_timeout=1).stdout == "ok\n"


def test_workspace_keeps_bunshin_semantics() -> None:
    with Workspace.create() as ws:
        assert ws._rec.lifetime.deadline == 0
        assert ws.commands.run("id -un; pwd; shopt -q login_shell || echo plain").stdout == "root\n/root\nplain\n"
        (clone,) = ws.fork(1, "copy")  # count first
        try:
            assert type(clone) is Workspace and clone._rec.lifetime.deadline == 0
        finally:
            clone.destroy()
