"""E2B's own Python SDK suite (../shared/e2b-python-sdk-tests, unchanged) against `bunshin serve`.

    python tests/e2b_suite/run.py [--mode http|domain|both] [--suite DIR] [--junit-dir DIR] [NODE ...]

The suite is copied to a temporary directory (pytest writes there) and run with its own
pytest.ini, the installed e2b SDK, no reruns, and the command line its README gives, in two modes:

- http: the sandbox and API suites, sync and async, in full, over plain HTTP (E2B_API_URL =
  E2B_SANDBOX_URL);
- domain: the files that need `<port>-<id>.<domain>` names and TLS (the port, network and create
  tests, and the SDK's URL unit tests) with only E2B_DOMAIN set, the server's certificate signed
  by a CA made for the run (SSL_CERT_FILE).

OFF-MACHINE.txt's tests are always deselected: they send packets to public addresses. The tests
in expected_failures.txt for the mode run as strict xfail (expected_plugin.py). The exit status is
non-zero on any unexpected failure, a listed test that passes, a server that does not stop cleanly
or one that leaves sandboxes behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPO = TESTS.parent
sys.path[:0] = [str(TESTS), str(HERE)]

import e2b_server_support as support  # noqa: E402
from expected_list import load  # noqa: E402

SUITE = Path(os.environ.get("BUNSHIN_E2B_SUITE", REPO.parent / "shared" / "e2b-python-sdk-tests"))
EXPECTED = HERE / "expected_failures.txt"
HTTP_PATHS = ("tests/sync/sandbox_sync", "tests/sync/api_sync", "tests/async/sandbox_async", "tests/async/api_async")
# The files whose tests fetch `https://<port>-<id>.<domain>` or check the URLs the SDK derives
# from E2B_DOMAIN: over plain HTTP those tests are excused ("plain-http"), here they must pass.
DOMAIN_PATHS = tuple(f"tests/{kind}/sandbox_{kind}/{name}" for kind in ("sync", "async")
                     for name in ("test_network.py", "test_create.py", "test_config_propagation.py"))
PATHS = {"http": HTTP_PATHS, "domain": DOMAIN_PATHS}
# The README's limit per test (the suite's pytest.ini says 30 s, tuned for E2B's cloud).
PER_TEST_TIMEOUT_S = 120
RUN_TIMEOUT_S = 1500


@dataclass
class Outcome:
    mode: str
    rc: int
    summary: str  # pytest's summary line: "N passed, M xfailed in T s"
    seconds: float
    log: str


def off_machine(suite: Path) -> list[str]:
    lines = (suite / "OFF-MACHINE.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def copy_suite(suite: Path, dest: Path) -> Path:
    """The suite's files as they are, in a directory pytest may write to."""
    copy = dest / "suite"
    shutil.copytree(suite, copy, copy_function=shutil.copyfile)
    for d, _, _ in os.walk(copy):
        os.chmod(d, 0o755)
    return copy


def pytest_command(copy: Path, mode: str, junit: Path | None, only: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-c", str(copy / "pytest.ini"), "--rootdir", str(copy),
           "-q", "-rfEX", "-p", "no:cacheprovider", "--timeout", str(PER_TEST_TIMEOUT_S),
           # No reruns, and none of bunshin's own pytest plugin: the suite runs as E2B runs it.
           "-p", "no:rerunfailures", "-p", "no:bunshinfork.testing",
           "-p", "expected_plugin", *(only or PATHS[mode])]
    for node in off_machine(copy):
        cmd += ["--deselect", node]
    if junit is not None:
        cmd += ["--junitxml", str(junit)]
    return cmd


def client_env(served: support.Served, mode: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "PYTEST_"))}
    env.update(served.env)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["BUNSHIN_E2B_EXPECTED"] = str(EXPECTED)
    env["BUNSHIN_E2B_MODE"] = mode
    return env


def _workspaces_of(pid: int) -> list[str]:
    from bunshinfork import state

    return [i for i in state.all_ids() if state.Record.load(i).creator_pid == pid]


@contextlib.contextmanager
def server(mode: str, work: Path) -> Iterator[tuple[support.Served, dict[str, str]]]:
    """`bunshin serve` for `mode` with its state, key and certificates under `work`: the server
    and what a client's environment needs beside its exports. On leaving it is stopped; a
    non-zero exit or a sandbox left behind raises."""
    key = work / "key"
    key.write_text("e2b-suite-" + os.urandom(8).hex() + "\n")
    (work / "state").mkdir()
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = {}
    if mode == "domain":
        from test_e2b_server_domain import DOMAIN, make_certs

        (work / "certs").mkdir()
        ca, cert, tls_key = make_certs(work / "certs")
        # Any free port: the SDKs carry it in E2B_DOMAIN (`bunshin.localhost:PORT`).
        extra_args = ("--tls-cert", str(cert), "--tls-key", str(tls_key), "--domain", DOMAIN)
        extra_env = {"SSL_CERT_FILE": str(ca), "NODE_EXTRA_CA_CERTS": str(ca)}
    served = support.start(work / "state", key, extra=extra_args)
    try:
        yield served, extra_env
    finally:
        stopped = served.stop()
        (work / "server.log").write_text("".join(served.log))
        left = _workspaces_of(served.proc.pid)
        if stopped != 0 or left:
            raise RuntimeError(f"bunshin serve exited {stopped} on SIGTERM, left {left} behind:\n"
                               + "".join(served.log[-50:]))


def run_mode(mode: str, suite: Path = SUITE, junit_dir: Path | None = None, only: tuple[str, ...] = ()) -> Outcome:
    """Start a server for `mode`, run the suite (or only these of its paths and node ids) against
    it, stop it; the pytest run's outcome."""
    load(EXPECTED)  # a malformed list fails here, before a server starts
    with tempfile.TemporaryDirectory(prefix=f"bunshin-e2b-suite-{mode}-") as tmp:
        work = Path(tmp)
        copy = copy_suite(suite, work)
        junit = None if junit_dir is None else junit_dir / f"e2b-suite-{mode}.xml"
        started = time.monotonic()
        log, rc = "", 1
        try:
            with server(mode, work) as (served, extra_env):
                proc = subprocess.run(pytest_command(copy, mode, junit, only), cwd=copy,
                                      env=client_env(served, mode, extra_env), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
                log, rc = proc.stdout, proc.returncode
        except RuntimeError as e:
            log, rc = f"{log}\n{e}", rc or 1
        finally:
            if junit_dir is not None and (work / "server.log").exists():
                shutil.copyfile(work / "server.log", junit_dir / f"e2b-suite-{mode}-server.log")
        seconds = time.monotonic() - started
    lines = [line for line in log.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line)),
                   lines[-1] if lines else "")
    return Outcome(mode, rc, summary.strip("= "), seconds, log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("http", "domain", "both"), default="both")
    p.add_argument("--suite", type=Path, default=SUITE)
    p.add_argument("--junit-dir", type=Path, default=None)
    p.add_argument("only", nargs="*", help="only these paths or node ids of the suite (default: the mode's)")
    args = p.parse_args(argv)
    if args.junit_dir is not None:
        args.junit_dir.mkdir(parents=True, exist_ok=True)
    rc = 0
    for mode in ("http", "domain") if args.mode == "both" else (args.mode,):
        out = run_mode(mode, args.suite, args.junit_dir, tuple(args.only))
        print(out.log)
        print(f"[e2b-suite] {mode}: {out.summary} (rc {out.rc}, {out.seconds:.0f} s)", flush=True)
        rc = rc or out.rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
