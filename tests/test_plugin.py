"""The pytest plugin as a user's project meets it: a separate test directory, no conftest of
ours, no -p option, nothing imported from this repository's tests; the plugin comes in
through its installed pytest11 entry point."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

PROJECT_CONFTEST = '''
import pytest

@pytest.fixture(scope="session")
def bunshin_setup():
    def setup(ws):
        ws.files.write("/root/app.cfg", "mode=test")
        ws.commands.run("exec sleep 100000", background=True)  # a process every fork carries
    return setup
'''

PROJECT_TESTS = '''
from hypothesis import given, settings, strategies as st, HealthCheck
from hypothesis.stateful import invariant, rule

from bunshinfork import Workspace
from bunshinfork.testing import ForkedStateMachine


def test_fresh_workspace(bunshin_workspace):
    assert isinstance(bunshin_workspace, Workspace)
    assert not bunshin_workspace.files.exists("/root/app.cfg")


def test_fork_of_the_prepared_workspace(bunshin_fork):
    assert bunshin_fork.files.read("/root/app.cfg") == "mode=test"
    assert bunshin_fork.commands.run("pgrep -c sleep").stdout == "1\\n"
    bunshin_fork.files.write("/root/dirty", "x")


def test_the_next_fork_is_clean(bunshin_fork):
    assert not bunshin_fork.files.exists("/root/dirty")


@settings(max_examples=5)  # the plugin's Hypothesis profile has no deadline: a fork takes longer
@given(name=st.text(alphabet="abc", min_size=1, max_size=4))
def test_every_example_starts_from_the_snapshot(bunshin_prepared, name):
    with bunshin_prepared.fork() as ws:
        assert [e.name for e in ws.files.list("/root")] == ["app.cfg"]  # nothing from earlier examples
        ws.files.write(f"/root/{name}", "x")


class Counter(ForkedStateMachine):
    @classmethod
    def setup(cls, ws):
        ws.files.write("/root/n", "0")

    def __init__(self):
        super().__init__()
        self.n = 0

    @rule()
    def bump(self):
        self.workspace.commands.run("echo $(( $(cat /root/n) + 1 )) > /root/n")
        self.n += 1

    @invariant()
    def matches(self):
        assert int(self.workspace.files.read("/root/n")) == self.n


Counter.TestCase.settings = settings(max_examples=4, stateful_step_count=3, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
TestCounter = Counter.TestCase
'''


def test_the_entry_point_is_installed() -> None:
    (ep,) = [e for e in entry_points(group="pytest11") if e.value == "bunshinfork.testing"]
    assert ep.name == "bunshinfork.testing"


# The plugin's documented example (README sent its long sections to docs/).
README = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def readme_example() -> str:
    """The 20-line example of the docs' "Testing with bunshin" section."""
    section = README.read_text().split("## Testing with bunshin", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_users_project(tmp_path: Path) -> None:
    project = tmp_path / "userproject"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "conftest.py").write_text(textwrap.dedent(PROJECT_CONFTEST))
    (project / "tests" / "test_app.py").write_text(textwrap.dedent(PROJECT_TESTS))
    (project / "readme").mkdir()
    (project / "readme" / "test_readme.py").write_text(readme_example())  # its own bunshin_setup
    # As a user's CI would keep it short (a profile of its own replaces the plugin's).
    (project / "readme" / "conftest.py").write_text(
        "from hypothesis import settings\n"
        "settings.register_profile('ci', max_examples=6, deadline=None)\nsettings.load_profile('ci')\n")
    (project / "pytest.ini").write_text("[pytest]\n")
    assert len(readme_example().splitlines()) <= 20
    for suite, passed in (("tests", "5 passed"), ("readme", "2 passed")):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite], cwd=project,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert passed in proc.stdout, proc.stdout
    # The fixtures are the plugin's, found through the entry point.
    fixtures = subprocess.run([sys.executable, "-m", "pytest", "--fixtures", "-q", "tests"], cwd=project,
                              capture_output=True, text=True, timeout=120).stdout
    assert "bunshin_fork" in fixtures and "bunshin_prepared" in fixtures and "bunshinfork/testing.py" in fixtures
