"""Containment of host-side paths (issue 36): the host acts on a path inside a workspace only as
resolved under that workspace's root, never by joining it onto /proc/<init>/root.

- Control sockets: root in workspace A replaces /.bunshin with a symlink into workspace B's
  root. A host path join followed it, and A's next command ran in B. Bunshin's own paths are
  resolved with no symlink at all, and what is found must be a socket of A's root: A's next
  command fails with a typed error, and B never sees it.
- Homes: an image's (or a snapshot's) /etc/passwd names a home under a /home that is an
  absolute symlink to a host directory. Sandbox.create made the home and chowned it by a
  host path, so the host's directory was given to the user. The home is resolved under the
  workspace's root and chowned by fd.
- The files API: it ran with the server's full root capabilities, only the fsuid changed:
  /proc/kallsyms gave real kernel addresses and /proc/1/environ the init's environment to
  `user`, and writes opened FIFOs and devices. It runs with the sandbox's credentials (the
  user's ids; root's file capabilities only) and writes and reads regular files only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fork_support import fork_of
from helpers import run_ok, wait_for

from bunshinfork.e2b.sandbox import ensure_default_user
from bunshinfork.errors import FileOperationError, WorkspaceStateError
from bunshinfork.workspace import Workspace

KINDS = ["created", "clone", "resumed", "userns"]
# Holds /tmp/fifo open for reading (and writing, so that it never reads an end) and keeps what
# arrives up to "done".
READER = """
import os
fd = os.open("/tmp/fifo", os.O_RDWR)
open("/tmp/ready", "w").close()
got = b""
while not got.endswith(b"done\\n"):
    got += os.read(fd, 4096)
open("/tmp/got", "wb").write(got)
"""


@contextlib.contextmanager
def _subject(kind: str, setup: Callable[[Workspace], object] = lambda ws: None) -> Iterator[Workspace]:
    """A workspace of `kind`: created, a clone of a created one, one paused to disk and resumed,
    or one in a user namespace; `setup` runs in it first (before the fork or the pause)."""
    with Workspace.create(rootfs="debian", userns=True) if kind == "userns" else Workspace.create() as src:
        setup(src)
        if kind in ("created", "userns"):
            yield src
        elif kind == "clone":
            with fork_of(src, 1) as clones:
                yield clones[0]
        else:
            src.pause_to_disk()
            src.resume_from_disk()
            yield src


@pytest.mark.parametrize("kind", KINDS)
def test_a_symlinked_control_dir_does_not_reach_another_workspace(kind: str) -> None:
    with Workspace.create() as b, _subject(kind) as a:
        run_ok(a, ["sh", "-c", f"mv /.bunshin /.bunshin.real && ln -s /proc/{b.init_pid}/root/.bunshin /.bunshin"])
        with pytest.raises(WorkspaceStateError, match="goes through a symlink"):
            a.commands.run("touch /ran-here")
        assert not b.files.exists("/ran-here")


def test_a_symlinked_input_dir_does_not_reach_another_workspace() -> None:
    """A command's stdin socket (/.bunshin/io/<pid>) is bunshin's path too: A's input for pid P
    never reaches B's command P."""
    with Workspace.create() as b, Workspace.create() as a:
        victim = b.commands.run("cat > /got", background=True, stdin=True)
        run_ok(a, ["sh", "-c", f"rm -rf /.bunshin/io && ln -s /proc/{b.init_pid}/root/.bunshin/io /.bunshin/io"])
        with pytest.raises(WorkspaceStateError, match="goes through a symlink"):
            a.commands.send_stdin(victim.pid, "from A")
        b.commands.close_stdin(victim.pid)
        victim.wait()
        assert b.files.read("/got") == ""


@pytest.mark.parametrize("kind", KINDS)
def test_a_symlinked_home_does_not_give_a_host_directory_away(tmp_path: Path, kind: str) -> None:
    victim = tmp_path / "host" / "user"
    victim.mkdir(parents=True)

    def plant(ws: Workspace) -> None:
        # What an image (or a sandbox whose snapshot becomes a template) ships: the user, and
        # a /home that points at the host's directory, spelled as the host spells it (and
        # made inside too, so that the home is made there).
        run_ok(ws, ["sh", "-c", "sed -i '/^user:/d' /etc/passwd && "
                    "echo 'user:x:1000:1000::/home/user:/bin/sh' >> /etc/passwd && "
                    f"rm -rf /home && mkdir -p {victim.parent} && ln -s {victim.parent} /home"])

    with _subject(kind, plant) as ws:
        ensure_default_user(ws, "user")
        assert os.stat(victim).st_uid == 0, "the host's directory was given to the sandbox's user"
        # The home the sandbox sees was made and given to its user, inside.
        assert ws.files.get_info("/home/user").owner == "user"


@pytest.mark.parametrize("kind", KINDS)
def test_the_files_api_sees_proc_as_the_sandbox_does(kind: str) -> None:
    with _subject(kind, lambda ws: ensure_default_user(ws, "user")) as ws:
        for who in ("root", "user"):
            inside = run_ok(ws, ["head", "-1", "/proc/kallsyms"], user=who).stdout.split()[0]
            assert set(inside) == {"0"}, inside  # no CAP_SYSLOG inside: zeroed
            read = str(ws.files.read("/proc/kallsyms", user=who)).split("\n", 1)[0].split()[0]
            assert read == inside, f"the files API as {who} read kernel addresses the sandbox cannot"
        assert ws.commands.run("cat /proc/1/environ", user="user").exit_code != 0
        with pytest.raises(FileOperationError, match="Permission denied"):
            ws.files.read("/proc/1/environ", user="user")


def test_the_files_api_writes_only_regular_files() -> None:
    with Workspace.create() as ws:
        # A FIFO with a reader (the write's open would not wait), and a device.
        run_ok(ws, ["mkfifo", "/tmp/fifo"])
        ws.files.write("/root/reader.py", READER)
        reader = ws.commands.run("python3 /root/reader.py", background=True)
        wait_for(lambda: ws.files.exists("/tmp/ready"))
        for path in ("/tmp/fifo", "/dev/null"):
            with pytest.raises(FileOperationError, match="not a regular file"):
                ws.files.write(path, "from the files API")
        run_ok(ws, ["sh", "-c", "echo done > /tmp/fifo"])
        reader.wait()
        assert ws.files.read("/tmp/got") == "done\n"
        # A regular file through a symlink still works, and a dangling one makes its target.
        run_ok(ws, ["sh", "-c", "ln -s /tmp/made /tmp/link && mkfifo /tmp/f2 && ln -s /tmp/f2 /tmp/link2"])
        ws.files.write("/tmp/link", "x")
        assert ws.files.read("/tmp/made") == "x" and ws.files.read("/tmp/link") == "x"
        with pytest.raises(FileOperationError, match="not a regular file"):
            ws.files.write("/tmp/link2", "y")
        with pytest.raises(FileOperationError, match="not a regular file"):
            ws.files.read("/tmp/link2")
