"""ws.commands: run shell commands inside a workspace, in the foreground or the background.

Every command is started by the workspace's init, so it is a descendant of PID 1 and a
later fork carries whatever it left running.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import CommandError, CommandTimeout, WorkspaceStateError
from .files import Files
from .process import control

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
    "USER": "root",
}

OutputCallback = Callable[[str], None]
# The workspace's live init pid; raises WorkspaceStateError once it is gone.
InitPid = Callable[[], int]


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    signal: int | None = None  # set when the command died of a signal (exit_code is then 128+signal)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def _decode_status(status: int) -> tuple[int, int | None]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), None


class _Utf8Stream:
    """Incremental decoding: a multi-byte character split across frames is not mangled."""

    def __init__(self, callback: OutputCallback | None) -> None:
        import codecs

        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.parts: list[str] = []
        self._cb = callback

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._dec.decode(data, final)
        if text:
            self.parts.append(text)
            if self._cb:
                self._cb(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)


class CommandHandle:
    """A background command. Its output goes to files inside the workspace, so the workspace
    holds no connection to the host while it runs and can be forked meanwhile."""

    def __init__(self, init_pid: InitPid, files: Files, cmd_id: str, pid: int,
                 on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None) -> None:
        self._init_pid = init_pid
        self._files = files
        self.cmd_id = cmd_id
        self.pid = pid  # inside the workspace's pid namespace
        self._offsets = [0, 0]
        self._streams = [_Utf8Stream(on_stdout), _Utf8Stream(on_stderr)]
        self._result: CommandResult | None = None
        self._lock = threading.Lock()
        self._pump: threading.Thread | None = None
        if on_stdout or on_stderr:
            self._pump = threading.Thread(target=self._pump_loop, daemon=True, name=f"bunshin-{cmd_id}")
            self._pump.start()

    def _dir(self) -> str:
        return f"{control.CMD_DIR}/{self.cmd_id}"

    def _poll_once(self) -> int | None:
        """Read new output; return the wait status if the command has exited."""
        with self._lock:
            files = self._files
            base = self._dir()
            status_text = None
            if files.exists(f"{base}/exit"):
                status_text = files.read(f"{base}/exit")
            for i, name in enumerate(("stdout", "stderr")):
                data = files.read(f"{base}/{name}", format="bytes")
                assert isinstance(data, bytes)
                new = data[self._offsets[i]:]
                self._offsets[i] = len(data)
                self._streams[i].feed(new, final=status_text is not None)
            return int(str(status_text).strip()) if status_text is not None else None

    def _pump_loop(self) -> None:
        delay = 0.01
        while self._result is None:
            try:
                if self._poll_once() is not None:
                    return
            except Exception:
                return
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    def wait(self, timeout: float | None = None) -> CommandResult:
        if self._result is not None:
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            status = self._poll_once()
            if status is not None:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(
                    f"background command {self.cmd_id} (pid {self.pid}) still running after {timeout}s",
                    self._streams[0].text, self._streams[1].text,
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)
        code, sig = _decode_status(status)
        self._result = CommandResult(self._streams[0].text, self._streams[1].text, code, sig)
        with contextlib.suppress(Exception):
            self._files.remove(self._dir())
        return self._result

    @property
    def stdout(self) -> str:
        return self._streams[0].text

    @property
    def stderr(self) -> str:
        return self._streams[1].text

    def kill(self, sig: int = signal.SIGKILL) -> bool:
        """Signal the command's whole process group; False if it had already exited."""
        try:
            control.simple(self._init_pid(), "kill", pid=-self.pid, sig=int(sig))
            return True
        except CommandError:
            return False


class Commands:
    """ws.commands. `env` is the workspace's own environment; `shell` runs string commands."""

    def __init__(self, init_pid: InitPid, files: Files, env: Mapping[str, str], shell: Callable[[], str]) -> None:
        self._init_pid = init_pid
        self._files = files
        self._env = env
        self._shell = shell

    def _argv(self, cmd: str | list[str]) -> list[str]:
        if isinstance(cmd, str):
            return [self._shell(), "-c", cmd]
        if not cmd:
            raise CommandError("empty command")
        return list(cmd)

    def run(
        self,
        cmd: str | list[str],
        timeout: float | None = 60,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        background: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> CommandResult | CommandHandle:
        """Run `cmd` (a shell string, or an argv list) inside the workspace.

        Foreground: returns a CommandResult; raises CommandTimeout after `timeout` seconds
        (None: no limit), having killed the command's process group inside the workspace.
        Background: returns a CommandHandle with wait() and kill().
        """
        argv = self._argv(cmd)
        full_env = {**DEFAULT_ENV, **self._env, **(env or {})}
        init_pid = self._init_pid()
        if background:
            cmd_id = secrets.token_hex(8)
            pid = int(control.simple(init_pid, "spawn", argv=argv, env=full_env, cwd=cwd or "/root",
                                     cmd_id=cmd_id))
            return CommandHandle(self._init_pid, self._files, cmd_id, pid, on_stdout, on_stderr)
        return self._run_foreground(init_pid, argv, full_env, cwd or "/root", timeout, on_stdout, on_stderr)

    def _run_foreground(self, init_pid: int, argv: list[str], env: Mapping[str, str], cwd: str,
                        timeout: float | None, on_stdout: OutputCallback | None,
                        on_stderr: OutputCallback | None) -> CommandResult:
        out, err = _Utf8Stream(on_stdout), _Utf8Stream(on_stderr)
        deadline = None if timeout is None else time.monotonic() + timeout
        conn = control.Connection(init_pid)
        try:
            conn.send("run", argv=argv, env=env, cwd=cwd)
            conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.001))
            status: int | None = None
            try:
                for kind, data in conn.frames():
                    if kind == "O":
                        out.feed(data)
                    elif kind == "E":
                        err.feed(data)
                    elif kind == "X":
                        status = int(data)
                    elif kind == "F":
                        raise CommandError(f"cannot run {argv!r}: {data.decode(errors='replace')}")
                    if deadline is not None:
                        # recv's timeout only fires on silence: a command that never stops
                        # writing must still end at the deadline.
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise TimeoutError
                        conn.settimeout(remaining)
            except TimeoutError:
                # Closing the connection makes the init kill the command's process group.
                out.feed(b"", final=True)
                err.feed(b"", final=True)
                raise CommandTimeout(f"command {argv!r} timed out after {timeout}s and was killed",
                                     out.text, err.text) from None
        finally:
            conn.close()
        if status is None:
            raise WorkspaceStateError("the workspace's init closed the connection before the command ended "
                                      "(was the workspace destroyed?)")
        out.feed(b"", final=True)
        err.feed(b"", final=True)
        code, sig = _decode_status(status)
        return CommandResult(out.text, err.text, code, sig)
