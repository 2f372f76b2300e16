"""Containment of host-side paths (issue 36): the host acts on a path inside a workspace only as
resolved under that workspace's root, never by joining it onto /proc/<init>/root.

- Control sockets: root in workspace A replaces /.bunshin with a symlink into workspace B's
  root. A host path join followed it, and A's next command ran in B. Bunshin's own paths are
  resolved with no symlink at all, and what is found must be a socket of A's root: A's next
  command fails with a typed error, and B never sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from fork_support import fork_of
from helpers import run_ok

from bunshinfork.errors import WorkspaceStateError
from bunshinfork.workspace import Workspace

KINDS = ["created", "clone", "resumed"]


@contextlib.contextmanager
def _subject(kind: str) -> Iterator[Workspace]:
    """A workspace of `kind`: created, a clone of a created one, or one paused to disk and resumed."""
    with Workspace.create() as src:
        if kind == "created":
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
