"""The CLI's runc/podman conventions, one test per convention: exec's argument rules and
-e/-w/-u/-i/-t, ps/ls -q/-a/--format json, pause/unpause/kill, rm -f, --root, and podman's
exit statuses (125, 126, 127, or the command's own)."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import select
import shutil
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_for
from test_cli import BUNSHIN, Created, cli, create, created, run_main, wait_gone  # noqa: F401  (fixture)

from bunshinfork import native, state
from bunshinfork.workspace import Workspace


@pytest.fixture
def ws_id(capsys: pytest.CaptureFixture[str], created: Created) -> str:  # noqa: F811
    return create(capsys, created)


def test_exec_options_end_at_the_command(capsys: pytest.CaptureFixture[str], ws_id: str) -> None:
    # No `--`: the command's own options (-la, -c) are its, not bunshin's.
    rc, out, _ = run_main(capsys, "exec", ws_id, "ls", "-la", "/.bunshin")
    assert rc == 0 and "ctl.sock" in out and out.startswith("total")
    rc, out, _ = run_main(capsys, "exec", ws_id, "sh", "-c", "echo $0 $1", "a", "-e")
    assert (rc, out) == (0, "a -e\n")
    # podman's place for options (before the id), bunshin's (between the id and the command),
    # attached values and combined short flags.
    rc, out, _ = run_main(capsys, "exec", "-e", "A=1", "-w", "/tmp", ws_id, "sh", "-c", 'echo "$A $PWD"')
    assert (rc, out) == (0, "1 /tmp\n")
    rc, out, _ = run_main(capsys, "exec", ws_id, "-eB=2", "--workdir=/etc", "--env", "C=3", "sh", "-c",
                          'echo "$B $C $PWD"')
    assert (rc, out) == (0, "2 3 /etc\n")


def test_exec_user(capsys: pytest.CaptureFixture[str], ws_id: str) -> None:
    rc, out, _ = run_main(capsys, "exec", "-u", "nobody", ws_id, "sh", "-c", "id -u; id -g; pwd")
    assert (rc, out) == (0, "65534\n65534\n/\n")  # nobody's home does not exist: podman starts it in /
    rc, _, err = run_main(capsys, "exec", "-u", "nosuchuser", ws_id, "true")
    assert rc == 125 and "nosuchuser" in err


def test_exec_interactive_stdin() -> None:
    with Workspace.create() as ws:
        proc = subprocess.run([str(BUNSHIN), "exec", "-i", ws.id, "sh", "-c", "tr a-z A-Z; echo end"],
                              input="hello\nworld\n", capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout) == (0, "HELLO\nWORLD\nend\n"), proc.stderr
        # Without -i the command's stdin is empty.
        proc = subprocess.run([str(BUNSHIN), "exec", ws.id, "cat"], input="ignored", capture_output=True,
                              text=True, timeout=60)
        assert (proc.returncode, proc.stdout) == (0, "")


def _read_until_exit(fd: int, proc: subprocess.Popen[bytes], timeout: float = 30) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every holder of the terminal closed it
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out


def test_exec_tty_interactive() -> None:
    """-it as from a terminal: raw keystrokes in, the shell's terminal output back, the window
    size passed on, and the shell's exit status."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    with Workspace.create() as ws:
        proc = subprocess.Popen([str(BUNSHIN), "exec", "-it", ws.id, "sh"], stdin=slave, stdout=slave,
                                stderr=slave, start_new_session=True)
        os.close(slave)
        try:
            os.write(master, b"stty size; tty; echo $((6*7)); exit 3\n")
            out = _read_until_exit(master, proc)
            assert proc.wait(timeout=30) == 3, out
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(master)
    text = out.decode(errors="replace")
    assert "33 101" in text and "/dev/pts/" in text and "42" in text, text


def test_exec_tty_without_interactive(capsys: pytest.CaptureFixture[str], ws_id: str) -> None:
    rc, out, _ = run_main(capsys, "exec", "-t", ws_id, "sh", "-c", "test -t 0 && test -t 1 && echo on-a-tty")
    assert rc == 0 and "on-a-tty" in out


def test_exit_statuses(capsys: pytest.CaptureFixture[str], ws_id: str) -> None:
    assert run_main(capsys, "exec", ws_id, "sh", "-c", "exit 42")[0] == 42  # the command's own
    rc, _, err = run_main(capsys, "exec", ws_id, "no-such-command")
    assert rc == 127 and "no-such-command" in err
    rc, _, err = run_main(capsys, "exec", ws_id, "/etc/passwd")
    assert rc == 126 and "Permission denied" in err
    rc, _, err = run_main(capsys, "exec", "-w", "/no/such/dir", ws_id, "true")
    assert rc == 126 and "/no/such/dir" in err
    assert run_main(capsys, "exec", "ws-000000000000", "true")[0] == 125
    assert run_main(capsys, "exec", ws_id, "--frobnicate", "true")[0] == 125
    # The wrong state: paused (refused at once, not after the init's reply timeout), then dead.
    assert run_main(capsys, "pause", ws_id)[0] == 0
    t0 = time.monotonic()
    rc, _, err = run_main(capsys, "exec", ws_id, "true")
    assert rc == 126 and "paused" in err and time.monotonic() - t0 < 5
    assert run_main(capsys, "unpause", ws_id)[0] == 0
    assert run_main(capsys, "exec", ws_id, "true")[0] == 0


def test_ps_quiet_all_and_json(capsys: pytest.CaptureFixture[str], created: Created) -> None:  # noqa: F811
    alive = create(capsys, created)
    dead = create(capsys, created)
    info = json.loads(run_main(capsys, "info", dead, "--json")[1])
    assert run_main(capsys, "kill", dead)[0] == 0  # KILL: the workspace ends; its record stays
    wait_gone(info["init_pid"])
    rc, out, _ = run_main(capsys, "ps", "-q")
    assert rc == 0 and alive in out.split() and dead not in out.split()
    assert all(line.startswith("ws-") for line in out.splitlines())
    rc, out, _ = run_main(capsys, "ps", "-a", "-q")
    assert {alive, dead} <= set(out.split())
    rc, out, _ = run_main(capsys, "ls", "-a", "--format", "json")
    states = {w["id"]: w["state"] for w in json.loads(out)}
    assert (states[alive], states[dead]) == ("running", "dead")
    assert json.loads(run_main(capsys, "ps", "--json")[1]) == json.loads(run_main(capsys, "ps", "--format",
                                                                                    "json")[1])
    # rm of a dead one needs no -f; a running one does.
    assert run_main(capsys, "rm", dead)[:2] == (0, dead + "\n")
    assert run_main(capsys, "rm", alive)[0] == 2 and (state.RUN_ROOT / alive).exists()
    assert run_main(capsys, "rm", "-f", alive)[0] == 0 and not (state.RUN_ROOT / alive).exists()


def test_pause_unpause(capsys: pytest.CaptureFixture[str], ws_id: str) -> None:
    assert run_main(capsys, "pause", ws_id) == (0, ws_id + "\n", "")
    assert json.loads(run_main(capsys, "info", ws_id, "--json")[1])["state"] == "paused"
    assert run_main(capsys, "pause", ws_id)[0] == 126  # the wrong state: paused already
    assert run_main(capsys, "unpause", ws_id) == (0, ws_id + "\n", "")
    assert json.loads(run_main(capsys, "info", ws_id, "--json")[1])["state"] == "running"
    assert run_main(capsys, "unpause", ws_id)[0] == 126


def test_kill_forwards_signals(capsys: pytest.CaptureFixture[str], ws_id: str) -> None:
    ws = Workspace.connect(ws_id)
    ws.commands.run("trap 'echo got-term > /tmp/term; exit 0' TERM; echo ready > /tmp/ready; "
                    "while :; do sleep 0.05; done", background=True)
    wait_for(lambda: ws.files.exists("/tmp/ready"), timeout=10)
    assert run_main(capsys, "kill", "-s", "TERM", ws_id)[0] == 0
    # TERM went to every process; once they are gone the init ends the workspace too.
    wait_for(lambda: not ws.is_running(), timeout=15)
    assert run_main(capsys, "rm", ws_id)[0] == 0
    assert run_main(capsys, "kill", "-s", "NOSUCHSIG", ws_id)[0] == 125


def test_root_option(capsys: pytest.CaptureFixture[str], created: Created) -> None:  # noqa: F811
    root = Path(f"/run/bunshin-roottest-{secrets.token_hex(4)}")
    try:
        rc, out, err = run_main(capsys, "--root", str(root), "create")
        assert rc == 0, err
        ws_id = out.strip()
        assert (root / ws_id / "state.json").exists() and not (state.RUN_ROOT / ws_id).exists()
        assert root != state.RUN_ROOT  # restored after the command
        assert run_main(capsys, "--root", str(root), "ps", "-q")[1].split() == [ws_id]
        assert ws_id not in run_main(capsys, "ps", "-q")[1].split()
        assert run_main(capsys, "exec", ws_id, "true")[0] == 125  # not under the default root
        assert run_main(capsys, "--root", str(root), "exec", ws_id, "true")[0] == 0
        # The installed script, with the option before the subcommand as runc takes it.
        proc = cli("--root", str(root), "ps", "--format", "json")
        assert proc.returncode == 0 and [w["id"] for w in json.loads(proc.stdout)] == [ws_id]
        assert run_main(capsys, "--root", str(root), "rm", "-f", ws_id)[0] == 0
        assert not (root / ws_id).exists()
    finally:
        if os.path.ismount(root):
            native.umount2(str(root), native.MNT_DETACH)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_stray_sigwinch_handler() -> Iterator[None]:
    before = signal.getsignal(signal.SIGWINCH)
    yield
    assert signal.getsignal(signal.SIGWINCH) == before
