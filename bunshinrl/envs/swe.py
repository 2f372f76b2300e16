"""SWE task (the SWE-Gym stand-in): fix a bug injected into a real Python project, mpmath 1.3.0
(pure Python) from its PyPI sdist, tested by the project's own pytest suite (mpmath/tests, shipped
in the sdist).

    env = make_env(seed=0)
    ws = env.create()                        # /root/proj: the sdist's tree, one function broken
    env.call(ws, "run_tests")                # the named subset of the suite (SUBSET), real pytest
    env.call(ws, "run_tests", path="test_functions.py")   # or one of its files
    env.call(ws, "edit", path="mpmath/functions/functions.py", find="...", replace="...")
    env.reward(ws)                           # 1.0 once the last run of the subset passed

The project is pinned by name, version and sha256, and its sdist is fetched once with pip into a
cache (BUNSHIN_SDIST_CACHE, default /var/cache/bunshin/sdists). The workspace's python3 is the
host's, which has no pytest: pytest and its pure-Python requirements are copied into the
workspace from the site-packages this module runs under (VENDOR, on PYTHONPATH for the tests
only). Observations are normalised (no timings, no memory addresses) and the runs leave nothing
that differs from one run to the next (PYTHONHASHSEED=0, no bytecode, no pytest cache), so the
same state observes the same thing, which the prefix cache and speculation need.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bunshinfork import Workspace

from ..calls.cpu_slots import cpu_slot
from ..calls.task import Task
from ..calls.tools import Tool
from ._common import agent_tool, tools_of
from .project import PROJ, cat, edit, rel, sh, verdict

PROJECT, VERSION = "mpmath", "1.3.0"
SDIST_SHA256 = "7a28eb2a9774d00c7bc92411c19a89209d5da7c4c9a9e227be8330a23a25b91f"
VENDOR = "/root/.pytest-vendor"
TESTS = "mpmath/tests"
# The files run_tests runs by default: seconds of real work (the whole suite takes minutes).
SUBSET = ("test_basic_ops.py", "test_functions.py", "test_gammazeta.py", "test_elliptic.py")
LOG = f"{PROJ}/.test.log"  # the last run of the subset, which the reward reads
VENDORED = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
# The injected bugs, one per seed: (file, the correct line, the broken line, the test it fails).
BUGS = (
    ("mpmath/functions/functions.py", "return ctx.sin(x)/x\n", "return ctx.sin(x)/(2*x)\n", "test_sinc"),
    ("mpmath/functions/functions.py", "return ctx.sinpi(x)/(ctx.pi*x)", "return ctx.sinpi(x)/x", "test_sinc"),
)
_TIMING = re.compile(r" in \d+(?:\.\d+)?s(?: \([0-9:.]+\))?")
_ADDRESS = re.compile(r"0x[0-9a-f]{6,}")


def sdist() -> Path:
    """The pinned sdist, fetched with pip once and checked against its sha256."""
    cache = Path(os.environ.get("BUNSHIN_SDIST_CACHE", "/var/cache/bunshin/sdists"))
    path = cache / f"{PROJECT}-{VERSION}.tar.gz"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", "-d", str(cache), f"{PROJECT}=={VERSION}"], check=True, timeout=300)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {SDIST_SHA256}")
    return path


def project_files(seed: int) -> dict[str, bytes]:
    """The sdist's tree (its top folder stripped), with bug `seed % len(BUGS)` injected."""
    rel, good, bad, _test = BUGS[seed % len(BUGS)]
    out: dict[str, bytes] = {}
    with tarfile.open(sdist()) as tar:
        for m in tar.getmembers():
            if m.isfile():
                f = tar.extractfile(m)
                assert f is not None
                out[m.name.split("/", 1)[1]] = f.read()
    src = out[rel].decode()
    if src.count(good) != 1:
        raise RuntimeError(f"{rel}: the line to break is not unique: {good!r}")
    out[rel] = src.replace(good, bad).encode()
    return out


def vendor_tar() -> bytes:
    """pytest and its requirements as a tar, from the site-packages this module runs under."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in VENDORED:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.origin is None:
                continue  # py: pytest's shim, absent from older pytests
            origin = Path(spec.origin)
            top = origin.parent if origin.name == "__init__.py" else origin
            tar.add(str(top), arcname=top.name, filter=lambda t: None if "__pycache__" in t.name else t)
    return buf.getvalue()




def normalise(text: str) -> str:
    """pytest's output without what differs between runs of one state (timings, addresses)."""
    return _ADDRESS.sub("0x?", _TIMING.sub("", text))


@agent_tool
def ls(ws: Workspace, path: str = ".") -> str:
    """List the project's files (fast)."""
    return sh(ws, f"find {shlex.quote(rel(path))} -maxdepth 2 -name '*.py' | sort")


@agent_tool
def grep(ws: Workspace, pattern: str) -> str:
    """Search the package's sources (fast): matching lines and the 16 after each."""
    return sh(ws, f"grep -rn -A16 --include='*.py' -e {shlex.quote(pattern)} mpmath | grep -v '/tests/'")


@agent_tool
def run_tests(ws: Workspace, path: str = "") -> str:
    """Run the project's tests (seconds): its named subset, or one of its test files (path, under
    mpmath/tests)."""
    target = f"{TESTS}/{rel(path)}" if path else " ".join(f"{TESTS}/{f}" for f in SUBSET)
    env = f"PYTHONPATH={VENDOR} PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1"
    with cpu_slot():  # the suite is CPU-bound (bunshinrl.calls.cpu_slots)
        out = sh(ws, f"{env} python3 -m pytest -q -p no:cacheprovider -o console_output_style=classic "
                      f"{shlex.quote(target) if path else target} 2>&1 | tail -n 40", timeout=300)
    out = normalise(out)
    if not path:  # the reward reads the last run of the subset
        ws.files.write(LOG, out)
    return out


TOOLS: list[Tool] = tools_of((ls, cat, grep, edit, run_tests))


def verifier(seed: int) -> Callable[[Workspace], tuple[float, str]]:
    """1.0: the last run of the subset passed; 0.5: the bug is fixed but the subset was not run
    since; 0.0 otherwise."""
    rel, good, _bad, _test = BUGS[seed % len(BUGS)]

    def verify(ws: Workspace) -> tuple[float, str]:
        return verdict(ws, LOG, _passed, f"{PROJ}/{rel}", good, "the tests pass")

    return verify


def _passed(log: str) -> bool:
    summary = log.strip().splitlines()[-1] if log.strip() else ""  # pytest's last line
    return bool(re.match(r"\d+ passed", summary)) and "failed" not in summary and "error" not in summary


def make_env(seed: int = 0, **spec: Any) -> Task:
    """The bug-fix task of bug `seed` (BUGS, modulo their number) in mpmath 1.3.0."""
    files = project_files(seed)
    vendor = vendor_tar()

    def setup(ws: Workspace) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for rel, data in sorted(files.items()):
                info = tarfile.TarInfo(rel)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        ws.files.write("/root/proj.tar", buf.getvalue())
        ws.files.write("/root/vendor.tar", vendor)
        r = ws.commands.run(f"mkdir -p {PROJ} {VENDOR} && tar -xf /root/proj.tar -C {PROJ} && "
                            f"tar -xf /root/vendor.tar -C {VENDOR} && rm /root/proj.tar /root/vendor.tar", timeout=120)
        if r.exit_code:  # type: ignore[union-attr]
            raise RuntimeError(f"swe setup failed: {r.stderr}")  # type: ignore[union-attr]

    fp = hashlib.sha256(repr(("swe-v1", SDIST_SHA256, BUGS[seed % len(BUGS)],
                              hashlib.sha256(vendor).hexdigest())).encode()).hexdigest()[:16]
    prompt = (f"The Python project in {PROJ} ({PROJECT} {VERSION}) has a failing test. Find the bug, fix it with "
              "the edit tool and make the tests pass (run_tests). Tools: ls, cat, grep, edit, run_tests.")
    return Task(f"swe-fix-{seed}", prompt, TOOLS, setup, verifier(seed), spec=dict(spec), fingerprint=fp,
                family="swe")
