"""The `bunshin` command line, driven through main() in-process and through the installed script.

Tests that remove "everything" (rm --all, gc) run against a private state root, because other
sessions may be using /run/bunshin on the same host at the same time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshinfork import doctor, native, state, workspace
from bunshinfork.cli import main
from bunshinfork.errors import BunshinError
from bunshinfork.workspace import Workspace

BUNSHIN = Path(sys.executable).with_name("bunshin")
ID_RE = re.compile(r"^ws-[0-9a-f]{12}$")


class Created:
    """Ids this test created; whatever a failing test did not remove is destroyed at teardown."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def add(self, ws_id: str) -> str:
        self.ids.append(ws_id)
        return ws_id

    def cleanup(self) -> None:
        for ws_id in self.ids:
            with contextlib.suppress(BunshinError):
                Workspace.connect(ws_id).destroy()
        # Workspaces whose init died cannot be connected to; gc takes those apart.
        if any((state.RUN_ROOT / ws_id).exists() for ws_id in self.ids):
            workspace.gc()


@pytest.fixture
def created() -> Iterator[Created]:
    c = Created()
    yield c
    c.cleanup()


@pytest.fixture
def private_root(monkeypatch: pytest.MonkeyPatch, created: Created) -> Iterator[Path]:
    """A state root of this test's own: in-process through state.RUN_ROOT, subprocesses through the env."""
    root = Path(f"/run/bunshin-clitest-{secrets.token_hex(4)}")
    monkeypatch.setattr(state, "RUN_ROOT", root)
    monkeypatch.setenv("BUNSHIN_RUN_ROOT", str(root))
    state.run_root()
    try:
        yield root
    finally:
        created.cleanup()
        leftover = state.all_ids()
        if os.path.ismount(root):
            native.umount2(str(root), native.MNT_DETACH)
        # Without its own tmpfs (a host whose /run is not on /), the state lies in the directory.
        shutil.rmtree(root, ignore_errors=True)
        assert leftover == [], f"workspaces left in {root}: {leftover}"


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def create(capsys: pytest.CaptureFixture[str], created: Created, *argv: str) -> str:
    rc, out, err = run_main(capsys, "create", *argv)
    assert rc == 0, err
    ws_id = out.strip()
    assert ID_RE.match(ws_id), out
    assert out == ws_id + "\n", "create must print only the id"
    return created.add(ws_id)


def wait_gone(pid: int, timeout: float = 15.0) -> None:
    """Until the pid is reaped: a zombie still looks like a live init to the state records."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, f"pid {pid} was not reaped within {timeout}s"
        time.sleep(0.02)


def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BUNSHIN), *argv], capture_output=True, text=True, timeout=timeout)


# ---- in-process ----


def test_create_exec_ls_info_memory_rm(capsys: pytest.CaptureFixture[str], created: Created) -> None:
    ws_id = create(capsys, created, "--hostname", "clibox", "--memory", "256M", "--pids", "64",
                   "--env", "GREETING=hello world")

    rc, out, err = run_main(capsys, "exec", ws_id, "--", "sh", "-c", 'echo "a b"; echo oops >&2; exit 7')
    assert (rc, out, err) == (7, "a b\n", "oops\n")

    # Options after the id, and the spec's environment reaching the command.
    rc, out, _ = run_main(capsys, "exec", ws_id, "--cwd", "/tmp", "--env", "X=1=2", "--timeout", "30", "--",
                          "sh", "-c", 'echo "$PWD|$X|$GREETING|$(hostname)"')
    assert (rc, out) == (0, "/tmp|1=2|hello world|clibox\n")

    # An argument that looks like shell syntax arrives as one literal argument.
    rc, out, _ = run_main(capsys, "exec", ws_id, "--", "printf", "[%s]", "$HOME; echo no", "'q'")
    assert (rc, out) == (0, "[$HOME; echo no]['q']")

    # A `--` inside the command survives, with or without the separating `--`.
    assert run_main(capsys, "exec", ws_id, "--", "echo", "a", "--", "b")[:2] == (0, "a -- b\n")
    assert run_main(capsys, "exec", ws_id, "echo", "a", "--", "b")[:2] == (0, "a -- b\n")

    rc, out, _ = run_main(capsys, "ls")
    assert rc == 0
    header, *rows = out.splitlines()
    assert header.split()[:5] == ["ID", "STATE", "HOSTNAME", "ROOTFS", "PID"]
    row = next(r.split() for r in rows if r.startswith(ws_id))
    assert row[1:4] == ["running", "clibox", "host"]

    rc, out, _ = run_main(capsys, "ls", "--json")
    listed = {w["id"]: w for w in json.loads(out)}
    assert listed[ws_id]["state"] == "running"
    assert listed[ws_id]["memory"]["cgroup_usage"] > 0

    rc, out, _ = run_main(capsys, "info", ws_id, "--json")
    info = json.loads(out)
    assert rc == 0
    assert (info["id"], info["hostname"], info["state"]) == (ws_id, "clibox", "running")
    assert (info["memory_limit"], info["pids_limit"]) == (256 << 20, 64)
    assert info["init_pid"] > 1

    rc, out, _ = run_main(capsys, "info", ws_id)
    assert rc == 0 and f"id:           {ws_id}" in out and "256.0M" in out

    rc, out, _ = run_main(capsys, "memory", ws_id, "--json")
    mem = json.loads(out)
    assert rc == 0
    assert mem["processes"] >= 1 and mem["rss"] >= mem["uss"] > 0
    assert all(k.isdigit() for k in mem["per_process"])
    assert mem["host"]["total"] == sum(mem["host"][k] for k in ("anon", "shmem", "page_cache", "kernel", "stores"))
    assert mem["host"]["total"] > 0
    rc, out, _ = run_main(capsys, "memory", ws_id)
    assert rc == 0 and out.startswith("host cost:") and "\nrss:" in out

    # podman's rm: a running workspace needs -f.
    rc, out, err = run_main(capsys, "rm", ws_id)
    assert (rc, out) == (2, "") and "rm -f" in err
    rc, out, err = run_main(capsys, "rm", "-f", ws_id)
    assert (rc, out, err) == (0, ws_id + "\n", "")
    assert not (state.RUN_ROOT / ws_id).exists()
    rc, out, _ = run_main(capsys, "ls", "--json")
    assert ws_id not in {w["id"] for w in json.loads(out)}


def test_exec_timeout_is_an_error(capsys: pytest.CaptureFixture[str], created: Created) -> None:
    ws_id = create(capsys, created)
    t0 = time.monotonic()
    rc, out, err = run_main(capsys, "exec", ws_id, "--timeout", "0.5", "--",
                            "sh", "-c", "echo started; sleep 30")
    assert time.monotonic() - t0 < 10
    assert rc == 124  # coreutils timeout's status
    assert out == "started\n"  # streamed before the kill
    assert err.startswith("bunshin: error:") and "timed out" in err
    # The workspace survives its command's timeout.
    assert run_main(capsys, "exec", ws_id, "--", "true")[0] == 0
    assert run_main(capsys, "rm", "-f", ws_id)[0] == 0


def test_user_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # podman's statuses: 125 for an error of bunshin itself, 1 for rm of an unknown id.
    rc, out, err = run_main(capsys, "exec", "ws-000000000000", "--", "true")
    assert (rc, out) == (125, "")
    assert err.startswith("bunshin: error: ") and "ws-000000000000" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1

    for cmd, status in ((["info", "ws-000000000000"], 125), (["memory", "ws-000000000000", "--json"], 125),
                        (["rm", "ws-000000000000"], 1)):
        rc, out, err = run_main(capsys, *cmd)
        assert rc == status and err.startswith("bunshin: error: ") and "Traceback" not in err, (cmd, err)

    rc, out, err = run_main(capsys, "create", "--memory", "abc")
    assert (rc, out) == (125, "")
    assert err.startswith("bunshin: error: ") and "--memory" in err and "abc" in err

    rc, _, err = run_main(capsys, "create", "--memory", "1M")
    assert rc == 125 and "below" in err

    rc, _, err = run_main(capsys, "create", "--nat")
    assert rc == 125 and "--network bridge" in err

    rc, _, err = run_main(capsys, "create", "--userns")
    assert rc == 125 and "userns" in err and "rootfs" in err

    rc, _, err = run_main(capsys, "create", "--hostname", "not a hostname")
    assert rc == 125 and err.startswith("bunshin: error: ")


def test_usage_errors_return_125(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["frobnicate"], ["create", "--pids", "many"], ["create", "--network", "wifi"],
                 ["create", "--env", "NOVALUE"], ["exec", "ws-000000000000"],
                 ["exec", "ws-000000000000", "--timeout", "-1", "--", "true"], ["rm"],
                 ["rm", "--all", "ws-000000000000"], ["info", "../../etc"]):
        rc, out, err = run_main(capsys, *argv)
        assert rc == 125, (argv, err)
        assert "usage:" in err and "Traceback" not in err, (argv, err)
    rc, out, _ = run_main(capsys, "--help")
    assert rc == 0 and "exec" in out and "doctor" in out


def test_rm_all(capsys: pytest.CaptureFixture[str], created: Created, private_root: Path) -> None:
    a = create(capsys, created)
    b = create(capsys, created)
    dead = create(capsys, created)
    # A workspace whose init died is removed too (through gc: it can no longer be connected to).
    info = json.loads(run_main(capsys, "info", dead, "--json")[1])
    os.kill(info["init_pid"], signal.SIGKILL)
    wait_gone(info["init_pid"])

    rc, out, err = run_main(capsys, "rm", "-af")
    assert rc == 0, err
    assert sorted(out.split()) == sorted([a, b, dead])
    assert state.all_ids() == []
    rc, out, _ = run_main(capsys, "ls", "--json")
    assert json.loads(out) == []


def test_gc_removes_workspace_with_killed_init(capsys: pytest.CaptureFixture[str], created: Created,
                                               private_root: Path) -> None:
    # Created by a process that has exited, as a crashed creator would leave it.
    proc = cli("create")
    assert proc.returncode == 0, proc.stderr
    ws_id = created.add(proc.stdout.strip())
    keep = create(capsys, created)

    info = json.loads(run_main(capsys, "info", ws_id, "--json")[1])
    os.kill(info["init_pid"], signal.SIGKILL)
    wait_gone(info["init_pid"])

    # A workspace in the wrong state (its init is gone): podman's 126.
    rc, out, err = run_main(capsys, "exec", ws_id, "--", "true")
    assert rc == 126 and "gc" in err

    rc, out, err = run_main(capsys, "gc")
    assert rc == 0, err
    assert f"workspace {ws_id}" in out.splitlines()
    assert keep not in out
    assert not (private_root / ws_id).exists()
    assert (private_root / keep).exists()

    rc, out, _ = run_main(capsys, "gc", "--json")
    assert rc == 0 and json.loads(out)["workspaces"] == []
    assert run_main(capsys, "rm", "-f", keep)[0] == 0


def test_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(capsys, "doctor")
    lines = out.splitlines()
    assert len(lines) == len(doctor.CHECKS)
    assert all(re.match(r"^(OK|WARN|FAIL)\s", line) for line in lines)
    criu = next(line for line in lines if re.match(r"^\w+\s+criu\s", line))
    assert criu.startswith("OK") and "4.2.1" in criu
    criu_check = next(line for line in lines if "criu check" in line)
    assert criu_check.startswith("OK") and "Looks good" in criu_check
    assert rc == (1 if any(line.startswith("FAIL") for line in lines) else 0)
    assert rc == 0  # the test host is set up by scripts/setup.sh

    rc, out, _ = run_main(capsys, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(out)}
    assert checks["criu check"]["ok"] and checks["criu check"]["detail"] == "Looks good."
    assert checks["root"]["ok"] and checks["namespaces"]["ok"] and checks["overlayfs"]["ok"]
    assert all(set(c) == {"name", "ok", "detail", "required", "level"} for c in checks.values())


def test_doctor_checks_are_typed() -> None:
    checks = doctor.run_checks()
    assert all(isinstance(c, doctor.Check) for c in checks)
    by_name = {c.name: c for c in checks}
    assert by_name["cgroups"].ok and by_name["cgroups"].detail.startswith(("v1", "v2"))
    assert by_name["bunshin-init"].ok
    cow = by_name["/dev/bunshin"]
    assert not cow.required
    if not cow.ok:
        assert "make -C kernel" in cow.detail and "ksm" in cow.detail


# ---- the installed console script ----


def test_console_script_end_to_end(created: Created) -> None:
    assert BUNSHIN.exists(), f"{BUNSHIN} is missing; pip install -e ."
    proc = cli("create")
    assert proc.returncode == 0, proc.stderr
    ws_id = created.add(proc.stdout.strip())
    assert ID_RE.match(ws_id) and proc.stdout == ws_id + "\n"

    proc = cli("exec", ws_id, "--", "sh", "-c", 'echo "a b"; echo e >&2; exit 7')
    assert (proc.returncode, proc.stdout, proc.stderr) == (7, "a b\n", "e\n")

    proc = cli("ls")
    assert proc.returncode == 0 and any(line.split()[:2] == [ws_id, "running"]
                                        for line in proc.stdout.splitlines())

    proc = cli("info", ws_id, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["id"] == ws_id
    proc = cli("memory", ws_id, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["pss"] > 0

    # Output keeps flowing to a reader that leaves early, and the command is then stopped.
    proc = subprocess.run(f"{BUNSHIN} exec {ws_id} -- yes | head -n 2", shell=True, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout == "y\ny\n" and "Traceback" not in proc.stderr

    proc = cli("exec", "ws-000000000000", "--", "true")
    assert proc.returncode == 125 and proc.stderr.startswith("bunshin: error:")
    assert "Traceback" not in proc.stderr

    proc = cli("rm", "-f", ws_id)
    assert (proc.returncode, proc.stdout) == (0, ws_id + "\n"), proc.stderr
    assert not (state.RUN_ROOT / ws_id).exists()


def test_fork_and_snapshot(capsys: pytest.CaptureFixture[str], created: Created, tmp_path: Path) -> None:
    ws_id = create(capsys, created)
    assert run_main(capsys, "exec", ws_id, "--", "sh", "-c", "echo before > /root/f")[0] == 0
    rc, out, err = run_main(capsys, "fork", ws_id, "-n", "2", "--memory", "copy")
    assert rc == 0, err
    clones = out.split()
    assert len(clones) == 2 and all(ID_RE.match(c) for c in clones)
    for c in clones:
        created.add(c)
        assert run_main(capsys, "exec", c, "--", "cat", "/root/f")[1] == "before\n"
    rc, out, err = run_main(capsys, "snapshot", ws_id, "--out", str(tmp_path / "snap"))
    assert rc == 0, err
    assert out.strip() == str(tmp_path / "snap")
    rc, out, err = run_main(capsys, "fork", "--snapshot", str(tmp_path / "snap"), "--json")
    assert rc == 0, err
    (clone,) = json.loads(out)["clones"]
    created.add(clone)
    assert run_main(capsys, "exec", clone, "--", "cat", "/root/f")[1] == "before\n"
    # Neither a workspace nor a snapshot named: a usage error, nothing forked.
    assert run_main(capsys, "fork")[0] == 125
    rc, _, err = run_main(capsys, "fork", "ws-000000000000")
    assert rc == 125 and "ws-000000000000" in err and "Traceback" not in err
