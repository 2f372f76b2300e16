"""Deadlines on everything a fork waits for, so that nothing hangs.

| name     | default | environment               | what it bounds                                         |
|----------|---------|---------------------------|--------------------------------------------------------|
| `criu`   | 60 s    | `BUNSHIN_CRIU_TIMEOUT`    | one CRIU dump or restore (then CRIU is killed)         |
| `inject` | 5 s     | `BUNSHIN_INJECT_TIMEOUT`  | one syscall injected into a stopped process, one ptrace stop |
| `frozen` | 60 s    | `BUNSHIN_FROZEN_TIMEOUT`  | how long a snapshot may keep its source frozen         |
| `freeze` | 10 s    | `BUNSHIN_FREEZE_TIMEOUT`  | the cgroup reaching the frozen or thawed state         |

Past a deadline the call is stopped (CRIU killed, the injected syscall interrupted), the source
is thawed, and a `DeadlineExceeded` (for a fork, a `ForkTimeout`) is raised. A watchdog process
started with every freeze (`bunshinfork.cgroups.watchdog`) enforces `frozen` even when the forking
process is killed mid-freeze. Change them for this process with `configure(criu=120)`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

_ENV = {"criu": "BUNSHIN_CRIU_TIMEOUT", "inject": "BUNSHIN_INJECT_TIMEOUT",
        "frozen": "BUNSHIN_FROZEN_TIMEOUT", "freeze": "BUNSHIN_FREEZE_TIMEOUT"}


@dataclass(frozen=True)
class Deadlines:
    criu: float = 60.0
    inject: float = 5.0
    frozen: float = 60.0
    freeze: float = 10.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"deadline {f.name} must be a positive number of seconds, got {v!r}")


def _from_env() -> Deadlines:
    values: dict[str, float] = {}
    for name, var in _ENV.items():
        raw = os.environ.get(var)
        if raw:
            try:
                values[name] = float(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a number of seconds") from None
    return Deadlines(**values)


_current = _from_env()


def current() -> Deadlines:
    return _current


def configure(**seconds: float) -> Deadlines:
    """Set some deadlines (seconds) for this process; returns the deadlines now in force."""
    global _current
    unknown = set(seconds) - set(_ENV)
    if unknown:
        raise ValueError(f"unknown deadline(s) {', '.join(sorted(unknown))}; known: {', '.join(_ENV)}")
    _current = dataclasses.replace(_current, **seconds)
    return _current
