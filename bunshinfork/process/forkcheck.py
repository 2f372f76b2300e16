"""What CRIU cannot checkpoint, found in the frozen tree before CRIU is asked to.

CRIU meets these late and badly: a process under ptrace (a debugger, strace) makes its seize
fail as a "zombie" and retry for its whole timeout; a process that unmapped only part of its
vDSO ([vdso] without [vvar], or the reverse) dumps, and every clone of it dies in CRIU's
restorer. Both are refused here at once, naming the process. (Unmapping all of them is fine:
the clone gets no vDSO either.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from ..errors import ForkError


def _status(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _who(host_pid: int) -> str:
    """'process 12 (sleep)', by its pid inside the workspace where it has one."""
    try:
        st = _status(Path(f"/proc/{host_pid}/status"))
    except OSError:
        return f"process {host_pid}"
    ns = st.get("NSpid", str(host_pid)).split()
    where = "" if len(ns) > 1 else " on the host"
    return f"process {ns[-1]} ({st.get('Name', '?')}){where}"


def _tracer_of(tid_dir: Path) -> int:
    return int(_status(tid_dir / "status").get("TracerPid", "0"))


def _vdso_parts(pid: int) -> tuple[bool, bool]:
    vdso = vvar = False
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        name = line.rsplit(None, 1)[-1] if line.endswith("]") else ""
        vdso |= name == "[vdso]"
        vvar |= name.startswith("[vvar")
    return vdso, vvar


def problems(pids: Iterable[int]) -> list[str]:
    """Why the processes `pids` (host pids, frozen) cannot be checkpointed; empty if they can."""
    found: list[str] = []
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
                tracer = _tracer_of(Path(f"/proc/{pid}/task/{tid}"))
                if tracer:
                    found.append(f"{_who(pid)} is traced by {_who(tracer)}: CRIU cannot checkpoint a process "
                                 "under ptrace; detach the debugger or tracer (or let it finish) and fork again")
                    break
            vdso, vvar = _vdso_parts(pid)
            if vdso != vvar:
                kept, gone = ("[vdso]", "[vvar]") if vdso else ("[vvar]", "[vdso]")
                found.append(f"{_who(pid)} unmapped its {gone} but kept {kept}: CRIU restores the vDSO only "
                             "together with its data pages; unmap both or neither")
    return found


def check(pids: Iterable[int], source: str) -> None:
    """Raise ForkError naming every process of `source` that CRIU could not checkpoint."""
    found = problems(pids)
    if found:
        raise ForkError(f"cannot fork {source}: " + "; ".join(found))
