"""Coding task: fix a bug in a small C project; the build and the test run are real (gcc, make).

    env = make_env(seed=3)
    ws = env.create()                       # /root/proj: sources, tests, a Makefile
    env.call(ws, "run_tests")               # make test: compiles (seconds), runs the test binary
    env.call(ws, "edit", path="src/pricing.c", find="x % 3", replace="x / 3")
    env.reward(ws)                          # 1.0 once build/test.log says every case passed

The slow tools are slow because they do the work: `build` compiles generated sources at -O2,
`run_tests` links and runs a test binary that exercises every function a few million times.
Every observation is content only (no times, pids or paths chosen at run time), so the same
state observes the same thing, which is what lets a prefix cache and speculation reuse them.
"""

from __future__ import annotations

import hashlib
import random
import shlex
import textwrap
from collections.abc import Callable
from typing import Any

from bunshinfork import Workspace

from ..calls.cpu_slots import cpu_slot
from ..calls.task import Task
from ..calls.tools import Tool
from ._common import agent_tool, tools_of
from .project import PROJ, cat, edit, rel, sh, verdict

GENERATED_FILES = 3
FUNCTIONS_PER_FILE = 150


def params(seed: int) -> tuple[int, int, int]:
    """The project's constants: scale(x) = x * a + b; discount(x) = x - x / c (the bug: x % c)."""
    rng = random.Random(f"coding-{seed}")
    return rng.randint(2, 9), rng.randint(1, 20), rng.randint(3, 7)


def _generated(seed: int, k: int) -> str:
    rng = random.Random(f"coding-{seed}-gen-{k}")
    fns = []
    for i in range(FUNCTIONS_PER_FILE):
        m, n = rng.randint(3, 97), rng.randint(2, 13)
        fns.append(textwrap.dedent(f"""
            long g{k}_{i}(long x) {{
                long acc = x;
                for (int j = 0; j < {n}; j++) {{
                    acc = (acc * {m} + j) % 1000003;
                    if (acc % {n + 1} == 0) acc += x >> (j % 7);
                    else acc ^= (acc << 3) & 0xffff;
                }}
                return acc;
            }}"""))
    table = ", ".join(f"g{k}_{i}" for i in range(FUNCTIONS_PER_FILE))
    return ("/* generated */\n" + "".join(fns) + f"\nlong (*const table{k}[])(long) = {{{table}}};\n"
            f"const int table{k}_len = {FUNCTIONS_PER_FILE};\n")


def files(seed: int) -> dict[str, str]:
    """The project of task `seed`."""
    a, b, c = params(seed)
    rng = random.Random(f"coding-{seed}-cases")
    cases = []
    for _ in range(6):
        x = rng.randint(1, 50)
        cases.append(f"CASE(scale({x}), {x * a + b}, \"scale({x})\");")
    for x in (60, 61, 62 + c):
        cases.append(f"CASE(discount({x}), {x - x // c}, \"discount({x})\");")
    for _ in range(3):
        x = rng.randint(-50, 1000)
        cases.append(f"CASE(clamp({x}), {max(0, min(x, a * 100))}, \"clamp({x})\");")
    externs = "".join(f"extern long (*const table{k}[])(long); extern const int table{k}_len;\n"
                      for k in range(GENERATED_FILES))
    loops = "".join(f"    for (int i = 0; i < table{k}_len; i++) for (long r = 0; r < rounds; r++) "
                    f"sink = (sink + table{k}[i](r + sink % 7)) % 999983;\n" for k in range(GENERATED_FILES))
    out = {
        "README.md": f"# pricing (task {seed})\nMake `make test` pass: the test cases are in tests/test_main.c.\n",
        "src/pricing.h": "int scale(int x);\nint discount(int x);\nint clamp(int x);\n",
        "src/pricing.c": textwrap.dedent(f"""\
            #include "pricing.h"

            int scale(int x) {{ return x * {a} + {b}; }}

            /* The price after the bulk discount of one unit in every {c}. */
            int discount(int x) {{ return x - x % {c}; }}

            int clamp(int x) {{ return x < 0 ? 0 : (x > {a * 100} ? {a * 100} : x); }}
            """),
        "tests/test_main.c": textwrap.dedent("""\
            #include <stdio.h>
            #include "../src/pricing.h"
            """) + externs + textwrap.dedent("""\
            static int passed, failed;
            #define CASE(got, want, name) do { long g_ = (got), w_ = (want); \\
                if (g_ == w_) { passed++; printf("PASS %s\\n", name); } \\
                else { failed++; printf("FAIL %s: expected %ld, got %ld\\n", name, w_, g_); } } while (0)
            int main(void) {
                long sink = 0, rounds = 60000;
            """) + loops + "    " + "\n    ".join(cases) + textwrap.dedent("""
                printf("checksum %ld\\n%d passed, %d failed\\n", sink, passed, failed);
                return failed != 0;
            }
            """),
        "Makefile": textwrap.dedent("""\
            CFLAGS = -O2 -Wall
            SRCS = $(wildcard src/*.c)
            OBJS = $(patsubst src/%.c,build/%.o,$(SRCS))
            all: build/libpricing.a
            build/%.o: src/%.c src/pricing.h
            \t@mkdir -p build
            \t@$(CC) $(CFLAGS) -c $< -o $@ && echo "compiled $<"
            build/libpricing.a: $(OBJS)
            \t@ar rcs $@ $^ && echo "archived $@"
            build/test: tests/test_main.c build/libpricing.a
            \t@$(CC) $(CFLAGS) $< build/libpricing.a -o $@ && echo "linked $@"
            test: build/test
            \t@./build/test > build/test.log; status=$$?; cat build/test.log; exit $$status
            clean:
            \t@rm -rf build && echo "removed build"
            .PHONY: all test clean
            """),
    }
    for k in range(GENERATED_FILES):
        out[f"src/gen{k}.c"] = _generated(seed, k)
    return out




@agent_tool
def ls(ws: Workspace, path: str = ".") -> str:
    """List the project's files (fast)."""
    return sh(ws, f"find {shlex.quote(rel(path))} -maxdepth 2 -not -name '*.o' | sort")


@agent_tool
def grep(ws: Workspace, pattern: str) -> str:
    """Search the sources and tests (fast)."""
    return sh(ws, f"grep -rn --include='*.c' --include='*.h' -e {shlex.quote(pattern)} src tests | "
                   "grep -v '^src/gen' | sort")


@agent_tool
def build(ws: Workspace) -> str:
    """Compile the library (make; slow: seconds per changed source)."""
    with cpu_slot():  # gcc is CPU-bound (bunshinrl.calls.cpu_slots)
        return sh(ws, "make -s all 2>&1")


@agent_tool
def run_tests(ws: Workspace) -> str:
    """Build what changed, then run the test binary (make test; slow)."""
    with cpu_slot():
        return sh(ws, "make -s test 2>&1")


@agent_tool
def clean(ws: Workspace) -> str:
    """Remove the build directory (fast)."""
    return sh(ws, "make -s clean")


TOOLS: list[Tool] = tools_of((ls, cat, grep, edit, build, run_tests, clean))


def verifier(seed: int) -> Callable[[Workspace], tuple[float, str]]:
    """1.0: the last test run passed every case; 0.5: discount() is fixed but the tests were not
    run since; 0.0 otherwise."""
    fix = f"return x - x / {params(seed)[2]};"

    def verify(ws: Workspace) -> tuple[float, str]:
        return _verdict(ws, fix)

    return verify


def _passed(log: str) -> bool:
    return log.rstrip().endswith(" 0 failed") and "FAIL" not in log


def _verdict(ws: Workspace, fix: str) -> tuple[float, str]:
    return verdict(ws, f"{PROJ}/build/test.log", _passed, f"{PROJ}/src/pricing.c", fix, "tests pass")


def make_env(seed: int = 0, **spec: Any) -> Task:
    """The bug-fix task of project `seed`."""
    project = files(seed)

    def setup(ws: Workspace) -> None:
        for name, text in project.items():
            ws.files.write(f"{PROJ}/{name}", text)

    fp = hashlib.sha256(repr(("coding-v1", sorted(project.items()))).encode()).hexdigest()[:16]
    prompt = (f"The C project in {PROJ} has a failing test. Find the bug, fix it with the edit tool and make "
              "`make test` pass (run_tests). Tools: ls, cat, grep, edit, build, run_tests, clean.")
    return Task(f"code-fix-{seed}", prompt, TOOLS, setup, verifier(seed), spec=dict(spec), fingerprint=fp,
                family="coding")
