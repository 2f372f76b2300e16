"""`bunshin exec`: one foreground command, its output streamed, with podman's -i and -t.

-i hands this process's stdin to the command (end of input travels as well); -t runs it on
a terminal inside the workspace, puts the local terminal in raw mode for the duration, and
forwards window-size changes. Exit status as podman's: the command's own, 126 when it could
not be invoked (not executable, bad working directory or user), 127 when it was not found.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator, Mapping
from typing import TextIO

from ..commands import Foreground, PtySize, decode_status
from ..errors import CommandError
from ..workspace import Workspace

NOT_INVOKABLE = 126
NOT_FOUND = 127


def _write(stream: TextIO, data: bytes) -> None:
    stream.buffer.write(data)
    stream.flush()


def failure_code(e: CommandError) -> int:
    """podman's status for a command the init could not start."""
    text = str(e)
    return NOT_FOUND if "exec " in text and os.strerror(errno.ENOENT) in text else NOT_INVOKABLE


def _pump_stdin(run: Foreground, fd: int) -> None:
    """Local stdin to the command, then its end; from a thread of its own (blocking reads)."""
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 65536):
            run.send_stdin(chunk)
        run.close_stdin()


@contextlib.contextmanager
def _raw_terminal(fd: int) -> Iterator[None]:
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    # TCSANOW, not setraw's default TCSAFLUSH: that discards what was typed ahead, before the
    # command started (the stdin thread races this call for it).
    tty.setraw(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _terminal_size() -> PtySize:
    for stream in (sys.stdout, sys.stdin):
        with contextlib.suppress(OSError, ValueError):
            size = os.get_terminal_size(stream.fileno())
            return PtySize(size.lines, size.columns)
    return PtySize(24, 80)


def run(ws: Workspace, argv: list[str], *, env: Mapping[str, str] | None, cwd: str | None, user: str | None,
        interactive: bool, terminal: bool, timeout: float | None) -> int:
    """Run argv in the workspace as `bunshin exec` does; returns the exit status."""
    size = _terminal_size() if terminal else None
    fg = ws.commands.start(argv, env, user, cwd, stdin=interactive, pty=size, timeout=timeout)
    stdin_fd = sys.stdin.fileno() if interactive else -1
    previous_winch = None
    try:
        if terminal:
            previous_winch = signal.signal(signal.SIGWINCH, lambda *_: _resize(fg))
        if interactive:
            threading.Thread(target=_pump_stdin, args=(fg, stdin_fd), daemon=True, name="bunshin-stdin").start()
        with _raw_terminal(stdin_fd) if terminal and interactive else contextlib.nullcontext():
            for kind, data in fg.frames():
                if kind == "O":
                    _write(sys.stdout, data)
                elif kind == "E":
                    _write(sys.stderr, data)
                elif kind == "X":
                    return decode_status(int(data))[0]
    finally:
        if previous_winch is not None:
            signal.signal(signal.SIGWINCH, previous_winch)
        fg.close()
    raise AssertionError("unreachable: frames() ends with 'X' or raises")


def _resize(fg: Foreground) -> None:
    size = _terminal_size()
    with contextlib.suppress(OSError):
        fg.resize(size.rows, size.cols)
