"""A coding-agent environment for benchmarks and tests: a small repository with a bug, a test
runner, a build, and an HTTP service the agent starts and queries inside its workspace.

Every tool observes only content (never times, pids, host names or ports chosen at random), so
two executions from the same workspace state observe the same thing, which is what makes them
reusable. Slow tools do real work (compiling, building an SQLite database, running tests,
aggregating over the service's data) followed by a fixed wait standing in for the heavier I/O a
real build or test suite would do: a 2-core host could not run a batch of truly CPU-bound tools
concurrently without measuring CPU contention instead of the rollout system.
"""

from __future__ import annotations

import json
import random
import shlex
import textwrap
import time
from typing import Any

from bunshinfork import Workspace

from .task import Task
from .tools import Tool, command_observation

PROJ = "/root/proj"
PORT = 8000
CATALOG_PORT = 8001

_SERVER = textwrap.dedent('''
    import csv, http.server, json, time, urllib.parse
    ROOT = "/root/proj"
    SERVED = {"n": 0}

    def items():
        with open(ROOT + "/app/data.csv") as f:
            return list(csv.DictReader(f))

    def core():
        ns = {}
        exec(open(ROOT + "/app/core.py").read(), ns)
        return ns

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            u = urllib.parse.urlparse(self.path)
            q = urllib.parse.parse_qs(u.query)
            if u.path == "/health":
                body = {"ok": True}
            else:
                SERVED["n"] += 1
                rows = items()
                if u.path == "/items":
                    body = rows[: int(q.get("limit", ["5"])[0])]
                elif u.path == "/stats":
                    prices = [int(r["price"]) for r in rows]
                    body = {"count": len(rows), "sum": sum(prices), "max": max(prices),
                            "requests_served": SERVED["n"]}
                elif u.path == "/search":
                    needle = q.get("q", [""])[0]
                    body = [r for r in rows if needle in r["name"]]
                elif u.path == "/report":
                    ns = core()
                    acc = 0
                    for r in rows:
                        for k in range(400):
                            acc = (acc * 31 + ns["score"](int(r["price"]), k)) % 1000003
                    time.sleep(__WAIT__)
                    body = {"checksum": acc, "rows": len(rows), "requests_served": SERVED["n"]}
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
            data = json.dumps(body, sort_keys=True).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    http.server.ThreadingHTTPServer(("127.0.0.1", __PORT__), H).serve_forever()
''')

# An always-on service that every initialized workspace already runs (like the shop database of
# a WebArena environment): it holds its catalog in memory, which is what forks share or copy.
_CATALOG = textwrap.dedent('''
    import hashlib, http.server, json, urllib.parse
    BLOCKS = [hashlib.sha256(str(i).encode()).digest() * 128 for i in range(__MIB__ * 256)]
    INDEX = {f"k{i}": hashlib.sha256(BLOCKS[i]).hexdigest()[:16] for i in range(0, len(BLOCKS), 64)}

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            u = urllib.parse.urlparse(self.path)
            key = urllib.parse.parse_qs(u.query).get("key", [""])[0]
            body = {"ok": True} if u.path == "/health" else {"key": key, "value": INDEX.get(key)}
            data = json.dumps(body, sort_keys=True).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    http.server.HTTPServer(("127.0.0.1", __PORT__), H).serve_forever()
''')

_RUNTESTS = textwrap.dedent('''
    import sys, time
    target = sys.argv[1] if len(sys.argv) > 1 else "all"
    ns = {}
    exec(open("/root/proj/app/core.py").read(), ns)
    exec(open("/root/proj/app/util.py").read(), ns)
    passed = failed = 0
    for line in open("/root/proj/tests/cases.txt"):
        mod, fn, arg, want = line.split()
        if target not in ("all", mod):
            continue
        args = [int(a) for a in arg.split(",")]
        # Real work per case, then the outcome.
        acc = 0
        for k in range(20000):
            acc = (acc + ns[fn](*args) * k) % 999983
        got = ns[fn](*args)
        if got == int(want):
            passed += 1
            print(f"PASS {mod}.{fn}({arg})")
        else:
            failed += 1
            print(f"FAIL {mod}.{fn}({arg}): expected {want}, got {got}")
    time.sleep(__WAIT__)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
''')

_BUILD = textwrap.dedent('''
    import csv, hashlib, os, py_compile, sqlite3, sys, time
    target = sys.argv[1] if len(sys.argv) > 1 else "all"
    os.makedirs("/root/proj/build", exist_ok=True)
    lines = []
    if target in ("all", "code"):
        for name in sorted(os.listdir("/root/proj/app")):
            if name.endswith(".py"):
                src = "/root/proj/app/" + name
                py_compile.compile(src, cfile="/root/proj/build/" + name + "c", doraise=True)
                lines.append(f"compiled {name} {hashlib.sha256(open(src, 'rb').read()).hexdigest()[:12]}")
    if target in ("all", "db"):
        db = "/root/proj/build/app.db"
        if os.path.exists(db):
            os.remove(db)
        con = sqlite3.connect(db)
        con.execute("create table items (id integer, name text, price integer)")
        with open("/root/proj/app/data.csv") as f:
            rows = [(int(r["id"]), r["name"], int(r["price"])) for r in csv.DictReader(f)]
        con.executemany("insert into items values (?, ?, ?)", rows)
        con.commit()
        total = con.execute("select count(*), sum(price) from items").fetchone()
        con.close()
        lines.append(f"database items={total[0]} total={total[1]}")
    time.sleep(__WAIT__)
    print("\\n".join(lines))
''')

WORDS = ["alpha", "bravo", "cargo", "delta", "ember", "fjord", "gamma", "harbor", "ivory", "jade", "kilo",
         "lumen", "mango", "nylon", "orbit", "pixel", "quartz", "radar", "sigma", "tango", "umber", "vivid",
         "wharf", "xenon", "yodel", "zephyr"]


def _params(rng: random.Random) -> tuple[int, int, int]:
    return rng.randint(2, 9), rng.randint(1, 20), rng.randint(3, 7)


def fixes(seed: int) -> list[dict[str, str]]:
    """Edits an agent might try on task `seed`: the correct fix of discount() first, then wrong ones."""
    _a, _b, c = _params(random.Random(f"repo-{seed}"))
    bug = f"x - x % {c}"
    return [
        {"path": "app/core.py", "find": bug, "replace": f"x - x // {c}"},
        {"path": "app/core.py", "find": bug, "replace": f"x - x // {c + 1}"},
        {"path": "app/core.py", "find": "price * ", "replace": "price + "},
    ]


def repository(seed: int) -> dict[str, str]:
    """The files of task `seed`'s repository: functions, a seeded bug, test cases, data."""
    rng = random.Random(f"repo-{seed}")
    a, b, c = _params(rng)
    core = textwrap.dedent(f'''
        """Pricing rules."""


        def scale(x):
            return x * {a} + {b}


        def score(price, k):
            # BUG: should add k, not subtract it
            return (price * {c} - k) % 97


        def discount(x):
            return x - x % {c}
    ''').lstrip()
    util = textwrap.dedent(f'''
        def clamp(x):
            return max(0, min(x, {a * 100}))


        def parity(x):
            return x % 2
    ''').lstrip()
    cases = []
    for _ in range(6):
        x = rng.randint(1, 50)
        cases.append(f"core scale {x} {x * a + b}")
    for _ in range(3):
        x = rng.randint(1, 50)
        cases.append(f"core score {x},0 {(x * c + 0) % 97}")  # k=0 passes either way
    for x in (60, 61):
        cases.append(f"core discount {x} {x - x // c}")  # fails until discount is fixed
    for _ in range(3):
        x = rng.randint(-50, 1000)
        cases.append(f"util clamp {x} {max(0, min(x, a * 100))}")
    rows = ["id,name,price"] + [f"{i},{rng.choice(WORDS)}-{i},{rng.randint(1, 500)}" for i in range(1, 61)]
    return {
        "README.md": f"# task {seed}\nFix the failing pricing tests, then check /report of the service.\n",
        "app/__init__.py": "",
        "app/core.py": core,
        "app/util.py": util,
        "app/data.csv": "\n".join(rows) + "\n",
        "tests/cases.txt": "\n".join(cases) + "\n",
        "server.py": _SERVER.replace("__PORT__", str(PORT)),
        "catalog.py": _CATALOG.replace("__PORT__", str(CATALOG_PORT)),
        "tools/runtests.py": _RUNTESTS,
        "tools/build.py": _BUILD,
    }


def _setup(seed: int, wait: float, catalog_mib: int) -> Any:
    def setup(ws: Workspace) -> None:
        for rel, text in repository(seed).items():
            text = text.replace("__WAIT__", repr(wait)).replace("__MIB__", str(catalog_mib))
            ws.files.write(f"{PROJ}/{rel}", text)
        ws.commands.run("python3 catalog.py", background=True, cwd=PROJ)
        probe = f"curl -sf http://127.0.0.1:{CATALOG_PORT}/health"
        deadline = time.monotonic() + 30
        while ws.commands.run(probe, timeout=10).exit_code != 0:  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise RuntimeError("the catalog service did not come up")
            time.sleep(0.05)
    return setup


def _sh(ws: Workspace, cmd: str, timeout: float = 60) -> str:
    r = ws.commands.run(cmd, timeout=timeout, cwd=PROJ)
    return command_observation(r.stdout, r.stderr, r.exit_code)  # type: ignore[union-attr]


def _path(args: dict[str, Any], key: str = "path") -> str:
    p = str(args.get(key, "."))
    if ".." in p.split("/"):
        raise ValueError(f"{key} may not leave the project: {p!r}")
    return p


def _ls(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, f"find {shlex.quote(_path(args))} -maxdepth 2 -not -name '*.pyc' | sort")


def _cat(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, f"head -c 3000 {shlex.quote(_path(args))}")


def _grep(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, f"grep -rn --include='*.py' --include='*.txt' -e {shlex.quote(str(args['pattern']))} . | sort")


def _edit(ws: Workspace, args: dict[str, Any]) -> str:
    path = f"{PROJ}/{_path(args)}"
    text = str(ws.files.read(path))
    n = text.count(args["find"])
    if n:
        ws.files.write(path, text.replace(args["find"], args["replace"]))
    return f"edited {args['path']}: {n} replacement(s)"


def _write(ws: Workspace, args: dict[str, Any]) -> str:
    ws.files.write(f"{PROJ}/{_path(args)}", str(args["content"]))
    return f"wrote {len(str(args['content']))} characters to {args['path']}"


def _run_tests(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, f"python3 tools/runtests.py {shlex.quote(str(args.get('target', 'all')))}")


def _build(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, f"python3 tools/build.py {shlex.quote(str(args.get('target', 'all')))}")


def _start_server(ws: Workspace, args: dict[str, Any]) -> str:
    probe = f"curl -sf http://127.0.0.1:{PORT}/health"
    if ws.commands.run(probe, timeout=10).exit_code == 0:  # type: ignore[union-attr]
        return "server already running"
    ws.commands.run("python3 server.py", background=True, cwd=PROJ)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if ws.commands.run(probe, timeout=10).exit_code == 0:  # type: ignore[union-attr]
            return f"server listening on port {PORT}"
        time.sleep(0.05)
    return "server did not come up"


def _query(ws: Workspace, args: dict[str, Any]) -> str:
    url = f"http://127.0.0.1:{PORT}{args.get('path', '/')}"
    return _sh(ws, f"curl -s --max-time 30 {shlex.quote(url)}")


def _lookup(ws: Workspace, args: dict[str, Any]) -> str:
    url = f"http://127.0.0.1:{CATALOG_PORT}/lookup?key={args.get('key', '')}"
    return _sh(ws, f"curl -s --max-time 30 {shlex.quote(url)}")


def _sql(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, f"python3 -c {shlex.quote(_SQL)} {shlex.quote(str(args['query']))}")


_SQL = ("import sqlite3, sys\n"
        "try:\n"
        "    con = sqlite3.connect('file:build/app.db?mode=ro', uri=True)\n"
        "    print(con.execute(sys.argv[1]).fetchall())\n"
        "except Exception as e:\n"
        "    print('error:', e)\n")


def _clock(ws: Workspace, args: dict[str, Any]) -> str:
    return _sh(ws, "date +%s%N")


def _schema(required: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": {n: {"type": "string"} for n in (*required, *optional)},
            "required": list(required), "additionalProperties": False}


def tools() -> list[Tool]:
    return [
        Tool("ls", _ls, description="list files (fast)", parameters=_schema(optional=("path",))),
        Tool("cat", _cat, description="read a file (fast)", parameters=_schema(("path",))),
        Tool("grep", _grep, description="search the sources (fast)", parameters=_schema(("pattern",))),
        Tool("edit", _edit, description="replace text in a file (fast)",
             parameters=_schema(("path", "find", "replace"))),
        Tool("write", _write, description="write a file (fast)", parameters=_schema(("path", "content"))),
        Tool("run_tests", _run_tests, description="run the test cases (slow)",
             parameters=_schema(optional=("target",))),
        Tool("build", _build, description="compile and build the database (slow)",
             parameters=_schema(optional=("target",))),
        Tool("start_server", _start_server, description="start the HTTP service (medium)", parameters=_schema()),
        Tool("query", _query, description="GET a path of the service; /report is slow", parameters=_schema(("path",))),
        Tool("sql", _sql, description="query the built database (fast)", parameters=_schema(("query",))),
        Tool("lookup", _lookup, description="look a key up in the catalog service (fast)",
             parameters=_schema(("key",))),
        # Observes the clock: declared non-deterministic, never reused.
        Tool("clock", _clock, deterministic=False, description="current time (non-deterministic)",
             parameters=_schema()),
    ]


def task(task_id: str, seed: int, wait: float = 1.0, catalog_mib: int = 4, ksm: bool = True) -> Task:
    """Task `seed` of the workload; `wait` is the I/O stand-in of slow tools, in seconds, and the
    catalog service keeps `catalog_mib` MiB in memory. ksm=False keeps the workspace's processes
    out of kernel samepage merging (for a true private-copy baseline with the "copy" engine)."""
    return Task(task_id, "Fix the failing test in /root/proj, build it and check the service's report.", tools(),
                _setup(seed, wait, catalog_mib), fingerprint=json.dumps(["repo-v2", seed, wait, catalog_mib]),
                spec={"ksm": ksm})
