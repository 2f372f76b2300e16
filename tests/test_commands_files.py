"""ws.commands (foreground, background, streaming, timeouts) and ws.files (path confinement)."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import run_ok, wait_for, ws_processes

from bunshinfork.commands import CommandHandle, CommandResult
from bunshinfork.errors import (
    CommandError,
    CommandTimeout,
    FileOperationError,
    WorkspaceFileNotFound,
)
from bunshinfork.workspace import Workspace


@pytest.fixture
def ws() -> Iterator[Workspace]:
    w = Workspace.create(env={"SPEC_VAR": "from-spec", "OVERRIDE": "spec"})
    try:
        yield w
    finally:
        w.destroy()


def _run(ws: Workspace, cmd: str | list[str], **kw: object) -> CommandResult:
    r = ws.commands.run(cmd, **kw)  # type: ignore[arg-type]
    assert isinstance(r, CommandResult)
    return r


def _bg(ws: Workspace, cmd: str, **kw: object) -> CommandHandle:
    h = ws.commands.run(cmd, background=True, **kw)  # type: ignore[arg-type]
    assert isinstance(h, CommandHandle)
    return h


# ---- foreground commands ----


@pytest.mark.parametrize("code", [0, 1, 3, 42, 255])
def test_exit_codes(ws: Workspace, code: int) -> None:
    r = _run(ws, f"exit {code}")
    assert (r.exit_code, r.signal, r.ok) == (code, None, code == 0)


def test_death_by_signal(ws: Workspace) -> None:
    r = _run(ws, "kill -TERM $$")
    assert (r.exit_code, r.signal) == (143, 15)


def test_stdout_and_stderr_are_separate(ws: Workspace) -> None:
    r = _run(ws, "echo out1; echo err1 >&2; echo out2; echo err2 >&2")
    assert r.stdout == "out1\nout2\n"
    assert r.stderr == "err1\nerr2\n"


def test_stdin_is_empty(ws: Workspace) -> None:
    # `cat` would block forever on an inherited terminal or pipe.
    r = _run(ws, "cat", timeout=5)
    assert (r.stdout, r.exit_code) == ("", 0)


def test_defaults_env_and_cwd(ws: Workspace) -> None:
    r = run_ok(ws, 'pwd; echo "$HOME|$USER|$LANG|$PATH"')
    path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert r.stdout.splitlines() == ["/root", f"/root|root|C.UTF-8|{path}"]
    r = run_ok(ws, 'pwd; echo "$FOO"', env={"FOO": "bar baz"}, cwd="/tmp")
    assert r.stdout == "/tmp\nbar baz\n"


def test_spec_env(ws: Workspace) -> None:
    assert run_ok(ws, 'echo "$SPEC_VAR $OVERRIDE"').stdout == "from-spec spec\n"
    # A call's env wins over the spec's.
    assert run_ok(ws, 'echo "$SPEC_VAR $OVERRIDE"', env={"OVERRIDE": "call"}).stdout == "from-spec call\n"
    # Background commands get it too.
    assert _bg(ws, 'echo "$SPEC_VAR"').wait(timeout=10).stdout == "from-spec\n"


def test_argv_list_is_not_shell_parsed(ws: Workspace) -> None:
    r = run_ok(ws, ["printf", "%s|", "a b", "$HOME", "*", "; echo no"])
    assert r.stdout == "a b|$HOME|*|; echo no|"


def test_timeout_kills_the_process_group(ws: Workspace) -> None:
    marker = 30000 + secrets.randbelow(1000)
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout) as ei:
        ws.commands.run(f"echo started; sleep {marker} & sleep {marker + 1}", timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert isinstance(ei.value, TimeoutError)
    assert ei.value.stdout == "started\n"

    def killed() -> bool:
        return not any(f"sleep {marker}" in p or f"sleep {marker + 1}" in p for p in ws_processes(ws))

    wait_for(killed, timeout=5)
    assert run_ok(ws, "echo alive").stdout == "alive\n"


def test_timeout_holds_while_output_flows(ws: Workspace) -> None:
    # A socket timeout only fires on silence; an endless writer read by a slow consumer is never
    # silent, so the deadline must be checked between frames too.
    outcome: list[object] = []

    def run() -> None:
        t0 = time.monotonic()
        try:
            ws.commands.run("yes", timeout=1, on_stdout=lambda _: time.sleep(0.002))
        except CommandTimeout:
            outcome.append(time.monotonic() - t0)
        except Exception as e:  # destroy() below ends a runaway call
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the command outlived its timeout by 9 s"
    (elapsed,) = outcome
    assert isinstance(elapsed, float) and elapsed < 2.0
    wait_for(lambda: not any(p == "yes" for p in ws_processes(ws)))


def test_foreground_returns_while_a_daemon_it_started_runs(ws: Workspace) -> None:
    # The daemon inherits stdout, so the pipe never reaches EOF: the reply must not wait for it,
    # even when it keeps writing.
    for daemon in ("sleep 100", "while true; do echo tick; sleep 0.01; done"):
        t0 = time.monotonic()
        r = run_ok(ws, f"({daemon}) & echo started", timeout=10)
        assert time.monotonic() - t0 < 2
        assert "started" in r.stdout.splitlines()  # a tick may come first
    procs = ws_processes(ws)
    assert any(p.startswith("sleep 100") for p in procs)
    assert any("tick" in p for p in procs)
    # The command's own output is never cut short, however slowly the client reads it.
    slow = run_ok(ws, "seq 100000; sleep 100 &", on_stdout=lambda _: time.sleep(0.01))
    assert slow.stdout == "".join(f"{i}\n" for i in range(1, 100001))


def test_output_streams_incrementally(ws: Workspace) -> None:
    seen: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def recorder(kind: str) -> Callable[[str], None]:
        def cb(text: str) -> None:
            with lock:
                seen.append((time.monotonic(), kind, text))
        return cb

    r = _run(ws, "for i in 1 2 3; do echo line$i; echo err$i >&2; sleep 0.4; done",
             on_stdout=recorder("out"), on_stderr=recorder("err"))
    end = time.monotonic()
    assert r.stdout == "line1\nline2\nline3\n" and r.stderr == "err1\nerr2\nerr3\n"
    assert "".join(t for _, k, t in seen if k == "out") == r.stdout
    assert "".join(t for _, k, t in seen if k == "err") == r.stderr
    first_out = next(ts for ts, k, t in seen if k == "out" and "line1" in t)
    first_err = next(ts for ts, k, t in seen if k == "err" and "err1" in t)
    # The first lines arrived while the command still had ~0.8 s to run.
    assert end - first_out > 0.6 and end - first_err > 0.6
    assert len([1 for _, k, _ in seen if k == "out"]) >= 3


def test_large_output_is_intact(ws: Workspace) -> None:
    n = 1 << 20  # 10-byte lines: 10 MiB
    script = (
        f"import sys\nsys.stdout.write(''.join(f'{{i:09d}}\\n' for i in range({n})))\n"
        "print('done', file=sys.stderr)"
    )
    r = run_ok(ws, ["python3", "-c", script], timeout=60)
    expected = "".join(f"{i:09d}\n" for i in range(n))
    assert len(r.stdout) == 10 << 20
    assert r.stdout == expected
    assert r.stderr == "done\n"


def test_utf8_split_across_chunks(ws: Workspace) -> None:
    chunks: list[str] = []
    # "€" is e2 82 ac and "😀" f0 9f 98 80: each is cut between two writes.
    r = run_ok(ws, r"printf '\xe2\x82'; sleep 0.3; printf '\xac\xf0\x9f'; sleep 0.3; printf '\x98\x80\n'",
               on_stdout=chunks.append)
    assert r.stdout == "€😀\n"
    assert len(chunks) >= 2, "the output was not split; the test proves nothing"
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == "€😀\n"


def test_missing_cwd_or_binary_raise(ws: Workspace) -> None:
    with pytest.raises(CommandError, match="/no/such/dir"):
        ws.commands.run("true", cwd="/no/such/dir")
    with pytest.raises(CommandError, match="no-such-binary"):
        ws.commands.run(["no-such-binary-xyz"])
    with pytest.raises(CommandError, match="no-such-binary"):
        ws.commands.run(["no-such-binary-xyz"], background=True)
    with pytest.raises(CommandError):
        ws.commands.run([])
    # Through a shell, a missing binary is the shell's ordinary 127.
    assert _run(ws, "no-such-binary-xyz").exit_code == 127
    assert run_ok(ws, "echo still-usable").stdout == "still-usable\n"


# ---- background commands ----


def test_background_wait(ws: Workspace) -> None:
    h = _bg(ws, "echo hi; sleep 0.2; echo err >&2; exit 7")
    assert h.pid > 1
    r = h.wait(timeout=10)
    assert (r.stdout, r.stderr, r.exit_code, r.signal) == ("hi\n", "err\n", 7, None)
    assert h.wait() is r
    # Its output directory inside the workspace is cleaned up.
    assert not ws.files.exists(f"/.bunshin/cmd/{h.cmd_id}")


def test_background_wait_timeout(ws: Workspace) -> None:
    h = _bg(ws, "echo partial; sleep 100")
    wait_for(lambda: ws.files.exists(f"/.bunshin/cmd/{h.cmd_id}/stdout")
             and ws.files.read(f"/.bunshin/cmd/{h.cmd_id}/stdout") == "partial\n")
    with pytest.raises(CommandTimeout) as ei:
        h.wait(timeout=0.2)
    assert ei.value.stdout == "partial\n"
    assert h.kill()


def test_background_kill(ws: Workspace) -> None:
    h = _bg(ws, "sleep 1000 & sleep 1001")
    wait_for(lambda: any("sleep 1001" in p for p in ws_processes(ws)))
    assert h.kill() is True
    r = h.wait(timeout=10)
    assert (r.exit_code, r.signal) == (137, 9)
    # The whole process group went, and a second kill has nothing to signal.
    wait_for(lambda: not any(p.startswith("sleep 100") for p in ws_processes(ws)))
    assert h.kill() is False


def test_background_streams_before_exit(ws: Workspace) -> None:
    got: list[str] = []
    h = _bg(ws, "echo first; sleep 30; echo never", on_stdout=got.append)
    wait_for(lambda: "".join(got) == "first\n", timeout=5)
    h.kill()
    assert h.wait(timeout=10).stdout == "first\n"


# ---- files ----


def test_write_read_text_and_bytes(ws: Workspace) -> None:
    info = ws.files.write("/tmp/t.txt", "héllo\n")
    assert (info.name, info.path, info.type, info.size) == ("t.txt", "/tmp/t.txt", "file", 7)
    assert ws.files.read("/tmp/t.txt") == "héllo\n"
    assert run_ok(ws, "cat /tmp/t.txt").stdout == "héllo\n"
    blob = bytes(range(256)) * 1024
    ws.files.write("/root/blob.bin", blob)
    assert ws.files.read("/root/blob.bin", format="bytes") == blob
    digest = hashlib.sha256(blob).hexdigest()
    assert run_ok(ws, "sha256sum /root/blob.bin").stdout.split()[0] == digest
    # Files written inside are readable from outside, and overwriting truncates.
    run_ok(ws, "printf inside > /root/from-inside")
    assert ws.files.read("from-inside") == "inside"  # relative: under /root
    ws.files.write("from-inside", "x")
    assert ws.files.read("/root/from-inside") == "x"


def test_write_creates_parents(ws: Workspace) -> None:
    ws.files.write("/srv/a/b/c/d.txt", "deep")
    assert run_ok(ws, "cat /srv/a/b/c/d.txt").stdout == "deep"
    assert [e.type for e in ws.files.list("/srv/a/b")] == ["dir"]


def test_write_of_a_file_consumed_at_once_still_reports_it(ws: Workspace) -> None:
    """A workspace process that takes a request file as soon as it appears (reads and unlinks
    it, as agents' watchers and the sparse-file holder do) does not turn a write into an error."""
    ws.commands.run("exec python3 -c \"import os\nwhile True:\n    try: os.unlink('/tmp/inbox/ask')\n"
                    "    except FileNotFoundError: pass\"", background=True)
    run_ok(ws, "mkdir -p /tmp/inbox")
    for i in range(30):
        info = ws.files.write("/tmp/inbox/ask", "x" * i, metadata={"n": str(i)})
        assert (info.name, info.path, info.type, info.size, info.metadata) == (
            "ask", "/tmp/inbox/ask", "file", i, {"n": str(i)})


def test_list_exists_make_dir_remove(ws: Workspace) -> None:
    assert ws.files.make_dir("/data/sub") is True
    assert ws.files.make_dir("/data/sub") is False
    ws.files.write("/data/f.txt", "12345")
    run_ok(ws, "ln -s f.txt /data/link")
    entries = {e.name: e for e in ws.files.list("/data")}
    # envd's view: a symlink has its target's type, and the target resolved (Lrwxrwxrwx its own).
    assert {n: e.type for n, e in entries.items()} == {"f.txt": "file", "link": "file", "sub": "dir"}
    assert (entries["link"].symlink_target, entries["link"].permissions) == ("/data/f.txt", "Lrwxrwxrwx")
    assert entries["f.txt"].size == 5 and entries["f.txt"].path == "/data/f.txt"
    assert {e.name for e in ws.files.list(".")} == set(run_ok(ws, "ls -A /root").stdout.split())
    assert ws.files.exists("/data/f.txt") and not ws.files.exists("/data/nope")
    # Removing a symlink leaves its target.
    ws.files.remove("/data/link")
    assert not ws.files.exists("/data/link") and ws.files.exists("/data/f.txt")
    ws.files.write("/data/sub/x/y.txt", "y")
    ws.files.remove("/data")
    assert not ws.files.exists("/data")
    assert _run(ws, "test -e /data").exit_code == 1


def test_file_errors_are_typed(ws: Workspace) -> None:
    with pytest.raises(WorkspaceFileNotFound) as ei:
        ws.files.read("/no/such/file")
    assert isinstance(ei.value, FileNotFoundError) and ei.value.errno == errno.ENOENT
    ws.files.remove("/no/such/file")  # envd's os.RemoveAll: nothing there is no error
    with pytest.raises(WorkspaceFileNotFound):
        ws.files.list("/no/such/dir")
    with pytest.raises(FileOperationError) as e2:
        ws.files.read("/etc")
    assert e2.value.errno == errno.EISDIR
    with pytest.raises(FileOperationError) as e3:
        ws.files.list("/etc/passwd")
    assert e3.value.errno == errno.ENOTDIR
    with pytest.raises(FileOperationError):
        ws.files.make_dir("/etc/passwd")
    with pytest.raises(FileOperationError):
        ws.files.write("/etc/passwd/child", "x")
    with pytest.raises(FileOperationError):
        ws.files.remove("/")
    assert ws.files.exists("/etc/passwd")


def test_symlinks_cannot_escape(ws: Workspace) -> None:
    host_hostname = Path("/etc/hostname").read_text()
    ws_hostname = f"{ws.id}\n"
    assert host_hostname != ws_hostname
    run_ok(ws, "ln -s /etc/hostname /root/abs && ln -s ../../../../../../../etc/hostname /root/rel "
               "&& ln -s / /root/rootlink && ln -s /etc /root/etclink")
    assert ws.files.read("/root/abs") == ws_hostname
    assert ws.files.read("/root/rel") == ws_hostname
    assert ws.files.read("/root/rootlink/etc/hostname") == ws_hostname
    assert ws.files.read("../../../../../etc/hostname") == ws_hostname
    # The root seen through the link is the workspace's: it has /.bunshin and no /work.
    names = {e.name for e in ws.files.list("/root/rootlink")}
    assert ".bunshin" in names and "work" not in names
    # Writes through links land inside the workspace too.
    probe = f"bunshin-escape-{secrets.token_hex(4)}"
    ws.files.write(f"/root/etclink/{probe}", "x")
    ws.files.write(f"/root/rootlink/tmp/{probe}", "x")
    ws.files.make_dir(f"/root/rootlink/{probe}/d")
    assert not os.path.exists(f"/etc/{probe}") and not os.path.exists(f"/tmp/{probe}")
    assert not os.path.exists(f"/{probe}")
    assert run_ok(ws, f"cat /etc/{probe} /tmp/{probe}").stdout == "xx"
    # Removing a link to / removes the link only.
    ws.files.remove("/root/rootlink")
    assert ws.files.exists("/etc/hostname") and ws.files.exists("/.bunshin/init")


def test_proc_magic_links_are_not_followed(ws: Workspace) -> None:
    # /proc/<pid>/root and /proc/<pid>/cwd jump across mount namespaces when followed from the host.
    run_ok(ws, "ln -s /proc/1/root/etc/passwd /root/magic")
    try:
        content = ws.files.read("/root/magic")
    except FileOperationError as e:
        # ELOOP: the magic link is refused; EACCES: the init's /proc entries are closed to the
        # files API, as they are to root inside (it has no CAP_SYS_PTRACE).
        assert e.errno in (errno.ELOOP, errno.EACCES)
    else:
        assert content != Path("/etc/passwd").read_text()
