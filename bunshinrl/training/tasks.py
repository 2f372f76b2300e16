"""A verifiable task suite for GRPO on live-forked workspaces.

Every reward is computed from the final workspace state, never from the transcript: files with
the required content, a service that was configured and started and answers with the right body,
a buggy script fixed so that a reference test (the verifier's own copy, not the workspace's file,
so deleting the test does not help) passes. Three families, two tasks each, all small and fast.

Each task lists the candidate actions a constrained decoder chooses from (correct steps,
plausible mistakes, harmless probes, FINAL), a step budget, and a known solution for tests.
The tasks are plain bunshinrl Tasks: the engine calls the verifier once the agent has finished,
through the same cache and speculation as every other call.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bunshinfork import BunshinError, Workspace

from ..calls.task import REWARD_TOOL, Task, Verdict, by_id, parse_reward
from ..calls.tools import Tool, command_observation, string_params
from ..policies.actions import FINAL, call

Verifier = Callable[[Workspace], Verdict]


# ---- tools ----

def _run(ws: Workspace, cmd: str, timeout: float = 30) -> tuple[str, str, int]:
    r = ws.commands.run(cmd, timeout=timeout)
    return r.stdout, r.stderr, r.exit_code  # type: ignore[union-attr]


def _shell(ws: Workspace, args: dict[str, Any]) -> str:
    return command_observation(*_run(ws, str(args["cmd"])))


def _read_file(ws: Workspace, args: dict[str, Any]) -> str:
    path = str(args["path"])
    try:
        return str(ws.files.read(path))
    except BunshinError:
        # A fixed message: bunshinfork's own error text names host paths and workspace ids,
        # which would make two executions from the same state observe different things.
        return f"[error] cannot read {path}"


def _write_file(ws: Workspace, args: dict[str, Any]) -> str:
    path, content = str(args["path"]), str(args["content"])
    try:
        ws.files.write(path, content)
    except BunshinError:
        return f"[error] cannot write {path}"
    return f"wrote {len(content.encode())} bytes to {path}"


def _http_get(port: int) -> Callable[[Workspace, dict[str, Any]], str]:
    def execute(ws: Workspace, args: dict[str, Any]) -> str:
        path = str(args.get("path") or "/")
        if not path.startswith("/"):
            path = "/" + path
        url = shlex.quote(f"http://127.0.0.1:{port}{path}")
        out, _err, code = _run(ws, f"curl -s -m 5 -w '\\n[status %{{http_code}}]' {url}")
        return out if code == 0 else f"[error] no service answering on 127.0.0.1:{port} (curl exit {code})"

    return execute


def shell_tool() -> Tool:
    return Tool("shell", _shell, description="Run a shell command in the workspace; returns its output.",
                      parameters=string_params("cmd"))


def file_tools() -> list[Tool]:
    return [
        Tool("read_file", _read_file, description="Read a text file.", parameters=string_params("path")),
        Tool("write_file", _write_file, description="Write a text file (parents are created).",
             parameters=string_params("path", "content")),
    ]


def http_tool(port: int) -> Tool:
    return Tool("http_get", _http_get(port),
                description=f"GET a path from the workspace's own service on 127.0.0.1:{port}.",
                parameters=string_params("path"))


# ---- tasks ----

def _write_setup(files: Mapping[str, str], then: str | None = None) -> Callable[[Workspace], None]:
    def setup(ws: Workspace) -> None:
        for path, content in files.items():
            ws.files.write(path, content)
        if then:
            out, err, code = _run(ws, then)
            if code:
                raise RuntimeError(f"task setup failed: {command_observation(out, err, code)}")

    return setup


# -- files: required content on disk --

def _files_verifier(required: Mapping[str, str]) -> Verifier:
    def verify(ws: Workspace) -> tuple[float, str]:
        lines, good = [], 0
        for path, want in required.items():
            try:
                got = str(ws.files.read(path))
            except BunshinError:
                got = None
            ok = got is not None and got.strip() == want
            good += ok
            lines.append(f"{'ok' if ok else 'wrong'} {path}")
        return good / len(required), "\n".join(lines)

    return verify


def files_task(task_id: str, required: Mapping[str, str], wrong: Mapping[str, str], shell_paths: Sequence[str],
               readme_dir: str) -> Task:
    """Write each of `required`'s files with its content. Paths in shell_paths are best written
    with the shell (printf), the others with write_file; `wrong` holds a plausible wrong content
    per path."""
    correct, mistakes = [], []
    for path, want in required.items():
        if path in shell_paths:
            correct.append(call("shell", cmd=f"printf '{want}\\n' > {path}"))
            mistakes.append(call("shell", cmd=f"printf '{wrong[path]}\\n' > {path}"))
        else:
            correct.append(call("write_file", path=path, content=want + "\n"))
            mistakes.append(call("write_file", path=path, content=wrong[path] + "\n"))
    first = next(iter(required))
    probes = [call("shell", cmd=f"ls {readme_dir}"), call("read_file", path=first),
              call("shell", cmd=f"cat {readme_dir}/README")]
    spec = ", ".join(f"{p} containing the line {v!r}" for p, v in required.items())
    readme = {f"{readme_dir}/README": f"Put the requested files in {readme_dir}.\n"}
    return Task(
        id=task_id, family="files", prompt=f"Create {spec}.",
        tools=[shell_tool(), *file_tools()], setup=_write_setup(readme), verify=_files_verifier(required),
        budget=4, actions=(*correct, *mistakes, *probes, FINAL), solution=(*correct, FINAL), setup_files=readme,
    )


# -- service: configured, started, answering --

_SERVER = textwrap.dedent('''
    import http.server, json, sys
    port = int(sys.argv[1])
    try:
        with open("/root/svc/config.json") as f:
            body = str(json.load(f)["body"])
    except Exception:
        body = "unconfigured"  # the config is read once, at start: configure first, then start
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass
        def do_GET(self):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')

# Restarts cleanly (a second start applies a new config) and returns only once the service
# answers, so the observation is the same on every execution.
_START = textwrap.dedent('''
    #!/bin/sh
    sh /root/svc/stop.sh >/dev/null
    setsid python3 /root/svc/server.py __PORT__ >/root/svc/server.log 2>&1 </dev/null &
    echo $! > /root/svc/pid
    i=0
    while [ $i -lt 200 ]; do
        if curl -sf -m 1 http://127.0.0.1:__PORT__/ >/dev/null; then echo "service listening on __PORT__"; exit 0; fi
        i=$((i + 1)); sleep 0.025
    done
    echo "service failed to start"; exit 1
''').lstrip()

_STOP = textwrap.dedent('''
    #!/bin/sh
    if [ -f /root/svc/pid ]; then
        pid=$(cat /root/svc/pid); kill "$pid" 2>/dev/null
        while kill -0 "$pid" 2>/dev/null; do sleep 0.01; done
        rm -f /root/svc/pid
    fi
    echo "service stopped"
''').lstrip()


def _service_verifier(port: int, body: str) -> Verifier:
    def verify(ws: Workspace) -> tuple[float, str]:
        out, _err, code = _run(ws, f"curl -s -m 5 http://127.0.0.1:{port}/")
        if code != 0:
            return 0.0, f"nothing answers on 127.0.0.1:{port}"
        if out == body:
            return 1.0, f"127.0.0.1:{port} answers {body!r}"
        # Partial credit: the service runs, but was started before it was configured (or wrongly).
        return 0.2, f"127.0.0.1:{port} answers {out[:80]!r}, expected {body!r}"

    return verify


def service_task(task_id: str, port: int, body: str, wrong: str) -> Task:
    cfg = "/root/svc/config.json"
    files = {
        "/root/svc/server.py": _SERVER,
        "/root/svc/start.sh": _START.replace("__PORT__", str(port)),
        "/root/svc/stop.sh": _STOP,
        "/root/svc/README": f"server.py reads {cfg} ({{\"body\": ...}}) when it starts; start.sh (re)starts it "
                            f"on 127.0.0.1:{port}.\n",
    }
    write_cfg = call("write_file", path=cfg, content=json.dumps({"body": body}))
    start = call("shell", cmd="sh /root/svc/start.sh")
    actions = (
        write_cfg, call("write_file", path=cfg, content=json.dumps({"body": wrong})), start,
        call("http_get", path="/"), call("read_file", path="/root/svc/README"),
        call("shell", cmd="sh /root/svc/stop.sh"), FINAL,
    )
    return Task(
        id=task_id, family="service",
        prompt=f"Configure the service to answer {body!r} and start it on port {port}.",
        tools=[shell_tool(), *file_tools(), http_tool(port)], setup=_write_setup(files),
        verify=_service_verifier(port, body), budget=4, actions=actions, solution=(write_cfg, start, FINAL),
        setup_files=files,
    )


# -- fix: a script whose test must pass --

_CALC = "def add(a, b):\n    return __ADD__\n\n\ndef mul(a, b):\n    return __MUL__\n"
_CASES = {"add": [(2, 3, 5), (-1, 1, 0), (10, 5, 15)], "mul": [(3, 4, 12), (0, 5, 0), (2, 2, 4)]}
_TEST = textwrap.dedent('''
    import sys
    # The source itself, never an import: a .pyc written by an earlier run would be reused when a
    # same-size edit lands within the same second as that run, and report the old code.
    ns = {}
    try:
        with open("/root/proj/calc.py") as f:
            exec(compile(f.read(), "/root/proj/calc.py", "exec"), ns)
    except Exception as e:
        print(f"calc.py does not load: {type(e).__name__}: {e}")
    CASES = __CASES__
    ok = total = 0
    for name, cases in CASES.items():
        for a, b, want in cases:
            total += 1
            try:
                got = ns[name](a, b)
            except Exception as e:
                got = f"{type(e).__name__}"
            if got == want:
                ok += 1
            else:
                print(f"FAIL {name}({a}, {b}) = {got}, expected {want}")
    print(f"tests ok: {ok}/{total}")
    sys.exit(0 if ok == total else 1)
''')


def _fix_verifier(functions: Sequence[str]) -> Verifier:
    cases = {f: _CASES[f] for f in functions}
    # The verifier's own copy of the test, piped in: what the workspace did to its test file
    # does not count.
    script = _TEST.replace("__CASES__", repr(cases))

    def verify(ws: Workspace) -> tuple[float, str]:
        out, err, _code = _run(ws, f"cd /root/proj && python3 - <<'EOF'\n{script}\nEOF")
        m = re.search(r"tests ok: (\d+)/(\d+)", out)
        if m is None:
            return 0.0, "the tests did not run: " + (err.strip().splitlines() or ["no output"])[-1][:200]
        return int(m.group(1)) / int(m.group(2)), m.group(0)

    return verify


def fix_task(task_id: str, bugs: Sequence[str]) -> Task:
    """calc.py with a bug in each function of `bugs` (add, mul); the test covers those functions."""
    add_expr = "a - b" if "add" in bugs else "a + b"
    mul_expr = "a * b + 1" if "mul" in bugs else "a * b"
    calc = _CALC.replace("__ADD__", add_expr).replace("__MUL__", mul_expr)
    files = {"/root/proj/calc.py": calc,
             "/root/proj/test_calc.py": _TEST.replace("__CASES__", repr({f: _CASES[f] for f in bugs}))}
    fix_add = call("shell", cmd="sed -i 's/return a - b/return a + b/' /root/proj/calc.py")
    fix_mul = call("shell", cmd="sed -i 's/return a \\* b + 1/return a * b/' /root/proj/calc.py")
    fixes = [f for f, b in ((fix_add, "add"), (fix_mul, "mul")) if b in bugs]
    actions = (
        call("shell", cmd="python3 /root/proj/test_calc.py"), call("read_file", path="/root/proj/calc.py"),
        fix_add, fix_mul, call("shell", cmd="sed -i 's/return a + b/return a - b/' /root/proj/calc.py"),
        call("write_file", path="/root/proj/calc.py", content="def add(a, b):\n    return a * b\n"),
        call("shell", cmd="rm -f /root/proj/test_calc.py"), FINAL,
    )
    what = " and ".join(f"{b}()" for b in bugs)
    return Task(
        id=task_id, family="fix",
        prompt=f"Fix {what} in /root/proj/calc.py so that python3 /root/proj/test_calc.py passes.",
        tools=[shell_tool(), *file_tools()], setup=_write_setup(files), verify=_fix_verifier(bugs),
        budget=4, actions=actions, solution=(*fixes, FINAL), setup_files=files,
    )


def suite() -> list[Task]:
    """The built-in suite: two tasks per family."""
    return [
        files_task("files-ab", {"/root/out/a.txt": "alpha", "/root/out/b.txt": "beta"},
                   {"/root/out/a.txt": "beta", "/root/out/b.txt": "alpha"}, shell_paths=(), readme_dir="/root/out"),
        files_task("files-motd", {"/root/etc/motd": "welcome", "/root/etc/mode": "prod"},
                   {"/root/etc/motd": "goodbye", "/root/etc/mode": "dev"}, shell_paths=("/root/etc/motd",),
                   readme_dir="/root/etc"),
        service_task("service-pong", 8081, "pong", "ping"),
        service_task("service-hello", 8082, "hello world", "hello"),
        fix_task("fix-add", ["add"]),
        fix_task("fix-both", ["add", "mul"]),
    ]


def families(tasks: Sequence[Task]) -> list[str]:
    return sorted({t.family for t in tasks})


__all__ = ["FINAL", "REWARD_TOOL", "by_id", "families", "files_task", "fix_task", "parse_reward", "service_task",
           "suite"]
