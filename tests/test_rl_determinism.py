"""check_family: every tool of a task family run in two forks of one state, observations compared,
before the family is used with the prefix cache (issue 37 #2)."""

from __future__ import annotations

from typing import Any

import pytest
from rl_support import no_own_leaks  # noqa: F401 (fixture, used by name)

from bunshinfork import Workspace
from bunshinrl import FamilyNotDeterministic, Task, Tool, ToolCall, check_family
from bunshinrl.calls.tools import command_observation
from bunshinrl.envs import coding

pytestmark = pytest.mark.usefixtures("no_own_leaks")

C = ToolCall
# A `wmctrl -lpGx` listing as the desktop prints it: id, desktop, pid, geometry, WM_CLASS (whose
# instance holds spaces for Chromium), the client host, the title. HOST is filled per fork.
WMCTRL = ("0x01200003  0 118    0    0 1280 800  chromium-browser (/root/.config/chromium-gui).Chromium-browser "
          "HOST Editor help - Chromium\n"
          "0x01400004  0 131   40   40  900 600  mousepad.Mousepad HOST notes.txt - Mousepad\n")


def _sh(ws: Workspace, cmd: str) -> str:
    r = ws.commands.run(cmd, timeout=30)
    return command_observation(r.stdout, r.stderr, r.exit_code)  # type: ignore[union-attr]


def old_windows(listing: str) -> str:
    """The GUI template's parser before 7daa851: split each `wmctrl -lpGx` line in 10 and take
    the 10th as the title, so a WM_CLASS instance with spaces shifts the client host into it."""
    titles = []
    for line in listing.splitlines():
        parts = line.split(None, 9)
        if len(parts) >= 9:
            titles.append(f"{parts[0]} {parts[7].partition('.')[0]}: {parts[9] if len(parts) > 9 else ''}")
    return "\n".join(titles)


def list_windows_old(ws: Workspace, args: dict[str, Any]) -> str:
    # The client host is the workspace's hostname, as wmctrl prints it.
    return old_windows(WMCTRL.replace("HOST", _sh(ws, "hostname").strip()))


def list_windows_old_fork_specific(ws: Workspace, args: dict[str, Any]) -> str:
    # The same parser where the host column holds something each fork has its own of (as the
    # hostname was before clones kept their source's): what the parser leaks now differs.
    return old_windows(WMCTRL.replace("HOST", _sh(ws, "cat /proc/sys/kernel/random/uuid").strip()))


def fixture_task() -> Task:
    tools = [
        Tool("greet", lambda ws, a: _sh(ws, "echo hello; cat /root/seen 2>/dev/null")),
        # Claims determinism, prints a token each fork draws afresh.
        Tool("fork_token", lambda ws, a: _sh(ws, "cat /proc/sys/kernel/random/uuid")),
        Tool("clock", lambda ws, a: _sh(ws, "date +%s%N"), deterministic=False),
        Tool("list_windows", list_windows_old),
        Tool("list_windows_fork_specific", list_windows_old_fork_specific),
        Tool("never_named", lambda ws, a: "x"),
    ]
    return Task("determinism-fixture", "check me", tools, lambda ws: ws.files.write("/root/seen", "setup ran"),
                actions=("greet{}", "fork_token{}", "clock{}", "list_windows{}", "FINAL"))


def test_check_family_flags_fork_specific_tools_and_strict_raises() -> None:
    task = fixture_task()
    report = check_family(task, [C("list_windows_fork_specific")])
    assert report.differing_tools == ["fork_token", "list_windows_fork_specific"], report.summary()
    diff = next(d for d in report.differing if d.tool == "fork_token")
    assert diff.first != diff.second and len(diff.first.strip()) == 36  # both observations, as seen
    # Clones keep their source's hostname (the identity rule), so the old parser's leak of the
    # client host into Chromium's title no longer differs between forks: not flagged.
    assert "list_windows{}" in report.checked
    assert "list_windows" not in report.differing_tools
    assert report.declared == ["clock"] and report.unchecked == ["never_named"]
    assert "greet{}" in report.checked and not report.ok
    with pytest.raises(FamilyNotDeterministic, match="fork_token"):
        check_family(task, strict=True)


def test_check_family_passes_the_code_family() -> None:
    task = coding.make_env(0)
    report = check_family(task, [C("ls"), C("cat", {"path": "README.md"}), C("grep", {"pattern": "return"}),
                                 C("run_tests"), C("clean")], strict=True)
    assert report.ok and len(report.checked) == 5 and report.unchecked == ["build", "edit"], report.summary()
