"""ws.commands: run commands inside a workspace, in the foreground or the background (E2B's
commands module, with bunshin's extras: argv lists, `env`, kill signals, wait deadlines).

Every command is started by the workspace's init, so it is a descendant of PID 1 and a
later fork carries whatever it left running.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import BunshinError, CommandError, CommandTimeout, NotFoundException
from .files import Files, FileStreamReader
from .process import control, protocol
from .process.tree import tree

if TYPE_CHECKING:
    from .users import User

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm",
    "USER": "root",
}

OutputCallback = Callable[[str], None]
PtyCallback = Callable[[bytes], None]
# The workspace's live init pid; raises WorkspaceStateError once it is gone.
InitPid = Callable[[], int]


@dataclass(frozen=True)
class Conventions:
    """What the two front doors over one core differ in (commands and files)."""

    default_user: str | None = None  # None: root
    login_shell: bool = False  # strings run in `bash -l -c` rather than the workspace's shell
    raise_on_exit: bool = False  # a non-zero exit raises CommandExitException
    workdir: str | None = None  # where commands start unless told (an image's WorkingDir); None: home


BUNSHIN = Conventions()
E2B = Conventions(default_user="user", login_shell=True, raise_on_exit=True)
Event = tuple[str | None, str | None, bytes | None]  # (stdout, stderr, pty): one of them set


@dataclass
class CommandResult:
    """What a finished command left: E2B's fields, and the signal that ended it (if any)."""

    stderr: str | None
    stdout: str | None
    exit_code: int
    error: str | None
    signal: int | None = field(default=None, kw_only=True)  # set when it died of a signal (exit_code 128+signal)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass
class CommandExitException(BunshinError, CommandResult):
    """A command exited non-zero (E2B's CommandExitException): the exception is also its result."""

    def __str__(self) -> str:
        if self.stderr is None:
            return f"Command exited with code {self.exit_code}"
        return f"Command exited with code {self.exit_code} and error:\n{self.stderr}"


@dataclass
class ProcessInfo:
    """A command running in the workspace (E2B's ProcessInfo)."""

    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None


@dataclass
class PtySize:
    rows: int
    cols: int


def decode_status(status: int) -> tuple[int, int | None, str | None]:
    """exit code, signal, and the error text E2B's envd gives (Go's ProcessState wording)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig, f"signal: {(signal.strsignal(sig) or str(sig)).lower()}"
    code = os.WEXITSTATUS(status)
    return code, None, f"exit status {code}" if code else None


def no_limit(timeout: float | None) -> bool:
    """E2B's convention: 0 means no limit (and so does None)."""
    return timeout is None or timeout == 0


# The most of a command's stdout (and of its stderr) one poll reads: a flood is read in slices
# of this size, as it is consumed, never whole.
READ_SLICE = 1 << 20


class Utf8Stream:
    """Incremental decoding: a multi-byte character split across frames is not mangled."""

    def __init__(self, callback: OutputCallback | None, retain: bool = True) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.parts: list[str] | None = [] if retain else None
        self._cb = callback

    def feed(self, data: bytes, final: bool = False) -> str:
        text = self._dec.decode(data, final)
        if text:
            if self.parts is not None:
                self.parts.append(text)
            if self._cb:
                self._cb(text)
        return text

    @property
    def text(self) -> str | None:
        return None if self.parts is None else "".join(self.parts)


def result_of(status: int, out: Utf8Stream, err: Utf8Stream) -> CommandResult:
    code, sig, error = decode_status(status)
    return CommandResult(err.text, out.text, code, error, signal=sig)


def exit_exception(r: CommandResult) -> CommandExitException:
    return CommandExitException(r.stderr, r.stdout, r.exit_code, r.error, signal=r.signal)


@dataclass(frozen=True)
class Launch:
    """A command as the init starts it (Commands.prepare): argv, the user spec (None: root),
    the full environment and the working directory."""

    argv: list[str]
    user: str | None
    env: dict[str, str]
    cwd: str


class CommandHandle:
    """A background command (E2B's CommandHandle). Its output goes to files inside the
    workspace, so the workspace holds no connection to the host while it runs and can be
    forked meanwhile; the handle reads them as they grow."""

    def __init__(self, init_pid: InitPid, files: Files, cmd_id: str, pid: int,
                 on_stdout: OutputCallback | None = None, on_stderr: OutputCallback | None = None, *,
                 deadline: float | None = None, raise_on_exit: bool = False, retain_output: bool = True,
                 pty: bool = False, offsets: tuple[int, int] = (0, 0)) -> None:
        self._init_pid = init_pid
        self._files = files
        self.cmd_id = cmd_id
        self._pid = pid
        self._offsets = list(offsets)
        self._streams = [Utf8Stream(on_stdout, retain_output), Utf8Stream(on_stderr, retain_output)]
        self._pty = pty
        self._deadline = deadline
        self._raise = raise_on_exit
        self._result: CommandResult | None = None
        self._lock = threading.Lock()
        self._disconnected = threading.Event()
        # Every handle following the command marks its directory; the last one to finish
        # removes it, so that two handles (commands.connect) both see the end.
        self._follower = f"{self._dir()}/follower-{secrets.token_hex(4)}"
        with contextlib.suppress(BunshinError):
            files.write(self._follower, "", user="root")
        self._pump: threading.Thread | None = None
        if on_stdout or on_stderr:
            self._pump = threading.Thread(target=self._pump_loop, daemon=True, name=f"bunshin-{cmd_id}")
            self._pump.start()

    @property
    def pid(self) -> int:
        """The command's pid inside the workspace's pid namespace."""
        return self._pid

    def _dir(self) -> str:
        return f"{protocol.CMD_DIR}/{self.cmd_id}"

    def _read_new(self) -> tuple[list[bytes], int | None]:
        """New bytes of stdout and stderr (at most READ_SLICE of each: the file is read from
        where the last read ended, never again from its start, so a flood costs its size once),
        and the wait status once the command has exited and all its output was read."""
        with self._lock:
            files = self._files
            base = self._dir()
            status_text = None
            with contextlib.suppress(NotFoundException):
                status_text = files.read(f"{base}/exit", user="root")
            new = []
            for i, name in enumerate(("stdout", "stderr")):
                reader = files.read(f"{base}/{name}", format="stream", user="root")
                assert isinstance(reader, FileStreamReader)
                with reader:
                    data = reader.read_at(self._offsets[i], READ_SLICE)
                new.append(data)
                self._offsets[i] += len(data)
            if any(len(d) == READ_SLICE for d in new):
                status_text = None  # more to read first: the status comes with the last of it
            return new, int(str(status_text).strip()) if status_text is not None else None

    @property
    def deadline(self) -> float | None:
        """When (time.monotonic()) the run's timeout ends the wait; None: no limit."""
        return self._deadline

    @property
    def raises_on_exit(self) -> bool:
        """Whether wait() raises CommandExitException on a non-zero exit (a Sandbox's does)."""
        return self._raise

    def poll(self) -> tuple[list[Event], CommandResult | None]:
        """What the command wrote since the last read, and its result once it has exited, without
        waiting: for a caller that paces its own reads (the asyncio handle). Not to be mixed
        with output callbacks given at the start, whose thread reads the same files."""
        events, status = self._poll_once()
        return events, None if status is None else self._finish(status)

    def _poll_once(self) -> tuple[list[Event], int | None]:
        new, status = self._read_new()
        final = status is not None
        events: list[Event] = []
        if self._pty:
            if new[0]:
                events.append((None, None, new[0]))
        else:
            for i in (0, 1):
                text = self._streams[i].feed(new[i], final=final)
                if text:
                    events.append((text, None, None) if i == 0 else (None, text, None))
        return events, status

    def _pump_loop(self) -> None:
        delay = 0.01
        while self._result is None and not self._disconnected.is_set():
            try:
                events, status = self._poll_once()
            except Exception:
                return
            if status is not None:
                self._finish(status)
                return
            time.sleep(delay)
            delay = 0.01 if events else min(delay * 1.5, 0.2)  # output flowing: read again soon

    def _finish(self, status: int) -> CommandResult:
        if self._result is None:
            self._result = result_of(status, self._streams[0], self._streams[1])
            self._unfollow()
        return self._result

    def _unfollow(self) -> None:
        files = self._files
        with contextlib.suppress(Exception):
            files.remove(self._follower, user="root")
            if not any(e.name.startswith("follower-") for e in files.list(self._dir(), user="root")) and \
                    files.exists(f"{self._dir()}/exit", user="root"):
                files.remove(self._dir(), user="root")

    def _events(self, timeout: float | None) -> Iterator[Event]:
        limit = timeout if timeout is not None else (
            None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0))
        deadline = None if limit is None else time.monotonic() + limit
        delay = 0.005
        while self._result is None:
            pump = self._pump
            if pump is not None and pump.is_alive():
                # The callback pump reads the files: a second reader would split the output.
                pump.join(delay)
            elif pump is not None:
                self._pump = None  # it stopped (disconnect, or a read error): read here instead
                continue
            else:
                events, status = self._poll_once()
                yield from events
                if status is not None:
                    self._finish(status)
                    return
                if events:
                    delay = 0.005 / 1.5  # output flowing: read again soon
                time.sleep(delay)
            if self._result is None and deadline is not None and time.monotonic() > deadline:
                raise CommandTimeout(
                    f"background command {self.cmd_id} (pid {self.pid}) still running after {limit}s",
                    self.stdout or "", self.stderr or "",
                )
            delay = min(delay * 1.5, 0.1)

    def __iter__(self) -> Iterator[Event]:
        """(stdout, stderr, pty) as the command writes them, until it exits."""
        return self._events(None)

    def wait(self, on_pty: PtyCallback | None = None, on_stdout: OutputCallback | None = None,
             on_stderr: OutputCallback | None = None, *, timeout: float | None = None) -> CommandResult:
        """Wait for the command to end and return its result (a Sandbox's raises
        CommandExitException on a non-zero exit). Without `timeout`, the run's own timeout
        bounds the wait; CommandTimeout leaves the command running."""
        if self._result is None:
            for out, err, pty in self._events(timeout):
                if out is not None and on_stdout:
                    on_stdout(out)
                elif err is not None and on_stderr:
                    on_stderr(err)
                elif pty is not None and on_pty:
                    on_pty(pty)
        assert self._result is not None
        if self._raise and self._result.exit_code != 0:
            raise exit_exception(self._result)
        return self._result

    @property
    def stdout(self) -> str | None:
        return self._streams[0].text

    @property
    def stderr(self) -> str | None:
        return self._streams[1].text

    @property
    def exit_code(self) -> int | None:
        return None if self._result is None else self._result.exit_code

    @property
    def error(self) -> str | None:
        return None if self._result is None else self._result.error

    def kill(self, sig: int = signal.SIGKILL) -> bool:
        """Signal the command's whole process group; False if it had already exited."""
        try:
            control.simple(self._init_pid(), "kill", pid=-self.pid, sig=int(sig))
            return True
        except CommandError:
            return False

    def send_stdin(self, data: str | bytes, request_timeout: float | None = None) -> None:
        """Write to the command's stdin (it must have been started with stdin=True)."""
        control.send_input(self._init_pid(), self.pid, "I", protocol.input_data(data), request_timeout)

    def close_stdin(self, request_timeout: float | None = None) -> None:
        """Signal end of input to the command."""
        control.send_input(self._init_pid(), self.pid, "C", b"", request_timeout)

    def disconnect(self) -> None:
        """Stop following the command; it keeps running (commands.connect(pid) follows it again)."""
        self._disconnected.set()
        self._unfollow()


class Foreground:
    """A foreground command in flight on its connection: output frames come in, and (when it
    has an input) stdin bytes, end of input and terminal sizes go out on the same connection."""

    def __init__(self, conn: control.Connection, argv: list[str], timeout: float | None) -> None:
        self._conn = conn
        self.argv = argv
        self.timeout = timeout
        self.pid: int | None = None
        self._deadline = None if no_limit(timeout) else time.monotonic() + float(timeout)  # type: ignore[arg-type]

    def send_stdin(self, data: bytes) -> None:
        self._conn.send_frame("I", data)

    def close_stdin(self) -> None:
        self._conn.send_frame("C")

    def resize(self, rows: int, cols: int) -> None:
        self._conn.send_frame("R", f"{rows} {cols}".encode())

    def frames(self) -> Iterator[tuple[str, bytes]]:
        """('O'|'E', bytes) as they arrive, then ('X', status). CommandTimeout at the deadline."""
        conn = self._conn
        conn.settimeout(None if self._deadline is None else max(self._deadline - time.monotonic(), 0.001))
        reply = protocol.RunReply(self.argv)
        try:
            for kind, data in conn.frames():
                if reply.feed(kind, data):
                    yield kind, data
                self.pid = reply.pid
                if self._deadline is not None:
                    # recv's timeout only fires on silence: a command that never stops
                    # writing must still end at the deadline.
                    remaining = self._deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    conn.settimeout(remaining)
        except TimeoutError:
            # Closing the connection makes the init kill the command's process group.
            raise CommandTimeout(f"command {self.argv!r} timed out after {self.timeout}s and was killed") from None
        yield "X", str(reply.status()).encode()

    def close(self) -> None:
        self._conn.close()


class Commands:
    """ws.commands. `env` is the workspace's own environment; `shell` runs string commands
    (unless the conventions ask for a login bash); `pids` lists the workspace's host pids."""

    def __init__(self, init_pid: InitPid, files: Files, env: Mapping[str, str], shell: Callable[[], str],
                 pids: Callable[[], list[int]], conventions: Conventions = BUNSHIN) -> None:
        self._init_pid = init_pid
        self._files = files
        self._env = env
        self._shell = shell
        self._pids = pids
        self._conv = conventions

    # ---- how a command is started ----

    def _argv(self, cmd: str | list[str]) -> list[str]:
        if isinstance(cmd, str):
            return ["/bin/bash", "-l", "-c", cmd] if self._conv.login_shell else [self._shell(), "-c", cmd]
        if not cmd:
            raise CommandError("empty command")
        return list(cmd)

    def prepare(self, cmd: str | list[str], user: str | None = None, envs: Mapping[str, str] | None = None,
                env: Mapping[str, str] | None = None, cwd: str | None = None) -> Launch:
        """What run() would send the init for `cmd`: its argv, user, full environment and working
        directory (for a client that speaks the protocol itself, as the asyncio one does)."""
        spec, full_env, workdir = self._prepare(user, envs, env, cwd)
        return Launch(self._argv(cmd), spec, full_env, workdir)

    def follow(self, cmd_id: str, pid: int, *, timeout: float | None = None, retain_output: bool = True,
               pty: bool = False) -> CommandHandle:
        """A handle on the background command the init spawned as `cmd_id` (pid `pid`), with these
        commands' conventions; `timeout` bounds its wait()."""
        return self._handle(cmd_id, pid, timeout=timeout, retain_output=retain_output, pty=pty)

    def _handle(self, cmd_id: str, pid: int, on_stdout: OutputCallback | None = None,
                on_stderr: OutputCallback | None = None, *, timeout: float | None = None,
                retain_output: bool = True, pty: bool = False, offsets: tuple[int, int] = (0, 0)) -> CommandHandle:
        return CommandHandle(self._init_pid, self._files, cmd_id, pid, on_stdout, on_stderr,
                             deadline=None if no_limit(timeout) else time.monotonic() + float(timeout),  # type: ignore[arg-type]
                             raise_on_exit=self._conv.raise_on_exit, retain_output=retain_output, pty=pty,
                             offsets=offsets)

    def _prepare(self, user: str | None, envs: Mapping[str, str] | None, env: Mapping[str, str] | None,
                 cwd: str | None) -> tuple[str | None, dict[str, str], str]:
        # The files API resolves its default user the same way: both follow the conventions.
        who: User = self._files.accounts.resolve(user or self._conv.default_user or "root")
        full_env = {**DEFAULT_ENV, **who.env(), **self._env, **(envs or {}), **(env or {})}
        if cwd is None and self._conv.workdir:
            cwd = self._conv.workdir  # as docker exec starts in the image's WorkingDir, whoever runs
        if cwd is None:
            # A user whose home does not exist (nobody's /nonexistent) starts in /, as under podman.
            cwd = who.home if who.is_root or self._files.exists(who.home, user="root") else "/"
        return (None if who.is_root else who.spec()), full_env, cwd

    def start_terminal(self, size: PtySize, user: str | None, cwd: str | None, envs: Mapping[str, str] | None,
                       timeout: float | None) -> CommandHandle:
        """An interactive login bash on a terminal of `size` (Pty.create)."""
        term_env = {"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **(envs or {})}
        cmd_id, pid = self._spawn(["/bin/bash", "-i", "-l"], user, term_env, None, cwd,
                                  f"pty:{size.rows}:{size.cols}")
        return self._handle(cmd_id, pid, timeout=timeout, pty=True)

    def resize_terminal(self, pid: int, size: PtySize, request_timeout: float | None = None) -> None:
        """Tell the terminal of command `pid` its new size (Pty.resize)."""
        control.send_input(self._init_pid(), pid, "R", protocol.resize_data(size.rows, size.cols), request_timeout)

    def _spawn(self, argv: list[str], user: str | None, envs: Mapping[str, str] | None,
               env: Mapping[str, str] | None, cwd: str | None, stdin: str | None) -> tuple[str, int]:
        spec, full_env, workdir = self._prepare(user, envs, env, cwd)
        cmd_id = secrets.token_hex(8)
        pid = int(control.simple(self._init_pid(), "spawn", argv=argv, env=full_env, cwd=workdir,
                                 cmd_id=cmd_id, user=spec, stdin=stdin))
        return cmd_id, pid

    def start(self, cmd: str | list[str], envs: Mapping[str, str] | None = None, user: str | None = None,
              cwd: str | None = None, stdin: bool = False, pty: PtySize | None = None,
              timeout: float | None = None, *, env: Mapping[str, str] | None = None) -> Foreground:
        """Start a foreground command and hand back its connection (the CLI's exec -i/-t)."""
        argv = self._argv(cmd)
        spec, full_env, workdir = self._prepare(user, envs, env, cwd)
        conn = control.Connection(self._init_pid())
        try:
            conn.send("run", argv=argv, env=full_env, cwd=workdir, user=spec,
                      stdin=f"pty:{pty.rows}:{pty.cols}" if pty else "pipe" if stdin else None)
        except BaseException:
            conn.close()
            raise
        return Foreground(conn, argv, timeout)

    # ---- E2B's surface ----

    def run(
        self,
        cmd: str | list[str],
        background: bool | None = None,
        envs: Mapping[str, str] | None = None,
        user: str | None = None,
        cwd: str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdin: bool | None = None,
        timeout: float | None = 60,
        request_timeout: float | None = None,
        *,
        retain_output: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult | CommandHandle:
        """Run `cmd` (a shell string, or an argv list) inside the workspace.

        Foreground: returns a CommandResult; raises CommandTimeout after `timeout` seconds
        (0 or None: no limit), having killed the command's process group inside the workspace.
        Background: returns a CommandHandle (wait, kill, send_stdin, iteration over output).
        A Sandbox runs strings in a login bash as its default user and raises
        CommandExitException for a non-zero exit; a Workspace runs them as root and returns
        the result. stdin=True gives the command a stdin pipe that send_stdin() writes to.
        request_timeout is E2B's transport option and is accepted and ignored.
        """
        argv = self._argv(cmd)
        if background:
            cmd_id, pid = self._spawn(argv, user, envs, env, cwd, "pipe" if stdin else None)
            return self._handle(cmd_id, pid, on_stdout, on_stderr, timeout=timeout, retain_output=retain_output)
        run = self.start(argv, envs, user, cwd, bool(stdin), None, timeout, env=env)
        out, err = Utf8Stream(on_stdout, retain_output), Utf8Stream(on_stderr, retain_output)
        status: int | None = None
        try:
            for kind, data in run.frames():
                if kind == "O":
                    out.feed(data)
                elif kind == "E":
                    err.feed(data)
                elif kind == "X":
                    status = int(data)
        except CommandTimeout as e:
            out.feed(b"", final=True)
            err.feed(b"", final=True)
            raise CommandTimeout(str(e), out.text or "", err.text or "") from None
        finally:
            run.close()
        assert status is not None
        out.feed(b"", final=True)
        err.feed(b"", final=True)
        result = result_of(status, out, err)
        if self._conv.raise_on_exit and result.exit_code != 0:
            raise exit_exception(result)
        return result

    def _requests(self) -> dict[int, dict[str, list[str]]]:
        """The request (tag -> values; "op" too) behind every command running now, by pid."""
        files = self._files
        running = {p.pid for p in tree(self._pids())}
        out: dict[int, dict[str, list[str]]] = {}
        with contextlib.suppress(NotFoundException):
            for entry in files.list(protocol.PROCS_DIR, user="root"):
                if not entry.name.isdigit() or int(entry.name) not in running:
                    continue  # a shim killed before it could tidy up
                with contextlib.suppress(NotFoundException):
                    items = bytes(files.read(entry.path, format="bytes", user="root")).split(b"\0")[:-1]
                    fields: dict[str, list[str]] = {"op": [items[0].decode(errors="replace")]}
                    for item in items[1:]:
                        text = item.decode(errors="replace")
                        fields.setdefault(text[:1], []).append(text[1:])
                    out[int(entry.name)] = fields
        return out

    def list(self, request_timeout: float | None = None) -> list[ProcessInfo]:
        """Every command running now (foreground, background and terminals), as it was started."""
        out = []
        for pid, req in sorted(self._requests().items()):
            argv = req.get("a", [])
            envs = dict(e.partition("=")[::2] for e in req.get("e", []))
            out.append(ProcessInfo(pid, None, argv[0] if argv else "", argv[1:], envs, (req.get("c") or [None])[0]))
        return out

    def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        """SIGKILL a command (its whole process group); False if there is no such command."""
        init = self._init_pid()
        for target in (-pid, pid):
            with contextlib.suppress(CommandError):
                control.simple(init, "kill", pid=target, sig=int(signal.SIGKILL))
                return True
        return False

    def send_stdin(self, pid: int, data: str | bytes, request_timeout: float | None = None) -> None:
        control.send_input(self._init_pid(), pid, "I", protocol.input_data(data), request_timeout)

    def close_stdin(self, pid: int, request_timeout: float | None = None) -> None:
        control.send_input(self._init_pid(), pid, "C", b"", request_timeout)

    def stream_input(self, pid: int, data: Iterable[str | bytes], *, timeout: float | None = 60.0) -> None:
        """Send each chunk of `data` to the command's stdin, in order."""
        if isinstance(data, (str, bytes)):
            from .errors import InvalidArgumentException

            raise InvalidArgumentException("stream_input takes an iterable of chunks, not a single str or bytes")
        deadline = None if no_limit(timeout) else time.monotonic() + float(timeout)  # type: ignore[arg-type]
        for chunk in data:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CommandTimeout(f"stream_input to command {pid} ran past {timeout}s")
            self.send_stdin(pid, chunk, left)

    def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None, *,
                retain_output: bool = True, new_only: bool = False) -> CommandHandle:
        """Follow a running background command (or terminal) again, from the start of its output;
        `new_only`: from what it writes from now on, as envd's Process/Connect streams only the
        events after it subscribed (e2b-dev/infra packages/envd/internal/services/process/connect.go)."""
        cmd_id, is_pty = self._find_background(pid)
        offsets = (0, 0)
        if new_only:
            base = f"{protocol.CMD_DIR}/{cmd_id}"
            offsets = (self._size(f"{base}/stdout"), self._size(f"{base}/stderr"))
        return self._handle(cmd_id, pid, timeout=timeout, retain_output=retain_output, pty=is_pty, offsets=offsets)

    def _size(self, path: str) -> int:
        try:
            return self._files.get_info(path, user="root").size
        except NotFoundException:
            return 0

    def _find_background(self, pid: int) -> tuple[str, bool]:
        """The id of the background command `pid` and whether it runs on a terminal."""
        req = self._requests().get(pid)
        if req is None or req["op"] != ["spawn"]:
            raise NotFoundException(f"no background command with pid {pid} is running (a foreground command "
                                    "streams its output to the caller that started it)")
        return req["i"][0], (req.get("n") or [""])[0].startswith("pty:")


class Pty:
    """Terminals in the workspace (E2B's sandbox.pty): an interactive login bash on a pty."""

    def __init__(self, commands: Commands) -> None:
        self._commands = commands

    def create(self, size: PtySize, user: str | None = None, cwd: str | None = None,
               envs: dict[str, str] | None = None, timeout: float | None = 60,
               request_timeout: float | None = None) -> CommandHandle:
        return self._commands.start_terminal(size, user, cwd, envs, timeout)

    def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        return self._commands.kill(pid, request_timeout)

    def send_stdin(self, pid: int, data: bytes, request_timeout: float | None = None) -> None:
        self._commands.send_stdin(pid, data, request_timeout)

    def stream_input(self, pid: int, data: Iterable[str | bytes], *, timeout: float | None = 60.0) -> None:
        self._commands.stream_input(pid, data, timeout=timeout)

    def resize(self, pid: int, size: PtySize, request_timeout: float | None = None) -> None:
        self._commands.resize_terminal(pid, size, request_timeout)

    def connect(self, pid: int, timeout: float | None = 60, request_timeout: float | None = None) -> CommandHandle:
        return self._commands.connect(pid, timeout, request_timeout)
