"""CRIU 4.2.1 driven over its RPC protocol (criu swrk + pycriu's protobufs).

pycriu's own client sends one request and reads one response; forking needs CRIU's
notifications (setup-namespaces names a clone's init, pre-resume is where the cow engine
shares memory into the still-stopped tasks), so this module runs the request/notify loop
itself. Logs are kept next to the images and quoted in errors. VERSION and CHECK are asked
the same way, for `bunshin doctor`, and FEATURE_CHECK for dirty tracking.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path

from .. import deadlines, native
from ..contract import Check
from ..errors import BunshinError, CriuError, CriuTimeout
from ..host import HOST
from . import prestart, sessions
from .init import INIT_BINARY

try:
    from pycriu import rpc_pb2 as rpc  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - set-up installs pycriu into the venv
    rpc = None

CRIU_BIN = os.environ.get("BUNSHIN_CRIU", "criu")
SETPRIV = "/usr/bin/setpriv"  # util-linux, essential on Debian
# Options the RPC has no field for, given to every request as its config file. It sets
# `file-validation filesize`: CRIU's default (build-id) validation mmaps the first MiB of every
# open regular file and reads its ELF magic, and a read fault on a tmpfs hole allocates a page,
# so dumping a deleted-but-open sparse file on tmpfs gave the source's file a data page where
# its head hole was. Restores here use the same immutable lower layers, so the size suffices.
CONFIG_FILE = Path(__file__).resolve().parent / "criu.conf"
# bookworm's 3.17 fails on this kernel's vDSO (vvar_vclock) and 4.1.x cannot dump TCP sockets
# on kernels >= 6.16; set-up builds 4.2.1.
REQUIRED = (4, 2)

Notify = Callable[[str, int], None]

# CRIU's kerndat cache: without it every dump and restore probes the kernel afresh (forty
# probes, an exec of `iptables -L` among them): 22 ms of every frozen dump and 34 ms of every
# restore on this host. CRIU keeps it only on a tmpfs (so that a reboot into another kernel
# drops it), in /run, which is no tmpfs on every host (this one's is ext4): there no CRIU ever
# cached it. CRIU patch 0007 reads the directory from KDAT_DIR_ENV; the state root is a tmpfs
# (state.run_root). CRIU writes the cache through a temporary opened O_EXCL and renamed into
# place, and leaves the temporary behind when killed between the two (a deadline's SIGKILL, a
# caller's death), after which no CRIU can write the cache: a temporary older than
# KDAT_STALE_S is such a leftover (a live CRIU renames its own within microseconds) and is
# removed; one removed under a live writer only costs that writer its rename.
KDAT_DIR_ENV = "CRIU_BUNSHIN_KDAT_DIR"
KDAT_NAME = "criu.kdat"
KDAT_STALE_S = 10.0


def binary() -> str:
    found = native.which(CRIU_BIN)
    if found is None:
        raise CriuError(f"{CRIU_BIN} not found; run scripts/setup.sh to build CRIU 4.2.1")
    return found


def _require() -> str:
    if rpc is None:
        raise CriuError("pycriu is not importable; run scripts/setup.sh (it installs CRIU 4.2.1 and pycriu)")
    return binary()


def new_opts() -> rpc.criu_opts:
    _require()
    opts = rpc.criu_opts()
    opts.images_dir_fd = -1  # required by the protocol; images_dir (a path) is used instead
    opts.config_file = str(CONFIG_FILE)
    return opts


# CRIU raises its own RLIMIT_NOFILE to fs.nr_open at the start of every action and logs an error
# when it may not (a host whose capability bounding set lacks CAP_SYS_RESOURCE, as this one's
# does). It then carries on with the current limit, so the line is in every log of such a host.
# Being CRIU's first error, it became the reply's cr_errmsg and hid the real cause of a failure.
NOISE = ("rlimit: Can't setup RLIMIT_NOFILE for self",)


def is_noise(line: str) -> bool:
    return any(n in line for n in NOISE)


def log_tail(path: Path, lines: int = 25) -> str:
    """The error lines of a CRIU log, or its last lines when none is marked as an error."""
    try:
        text = [ln for ln in path.read_text(errors="replace").splitlines() if not is_noise(ln)]
    except OSError:
        return f"(no log at {path})"
    errors = [ln for ln in text if "Error" in ln or "error" in ln.split(":", 1)[0]]
    return "\n".join((errors or text)[-lines:])


def failure(kind: str, resp: rpc.criu_resp, log: Path | None) -> str:
    """What a failed reply says: CRIU's first error that is not NOISE, then the log's errors."""
    detail = "" if is_noise(resp.cr_errmsg) else resp.cr_errmsg
    detail = detail or (os.strerror(resp.cr_errno) if resp.cr_errno else "")
    tail = log_tail(log) if log is not None else ""
    return f"criu {kind} failed{': ' + detail if detail else ''}\n{tail}".rstrip()


def kdat_dir() -> Path:
    return HOST.run_root


def unblock_kdat_cache(directory: Path | None = None, now: float | None = None) -> bool:
    """Remove a killed CRIU's leftover temporary that keeps every CRIU from caching kerndat
    (KDAT_DIR_ENV); True when one was removed. One stat when there is none."""
    tmp = (directory or kdat_dir()) / f"{KDAT_NAME}.tmp"
    try:
        age = (time.time() if now is None else now) - tmp.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < KDAT_STALE_S:
        return False
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    return True


class Session:
    """One `criu swrk` process; one request at a time."""

    def __init__(self, keep_fds: tuple[int, ...] = (), ksm_merge: bool = False,
                 env: dict[str, str] | None = None, die_with_caller: bool = False, criu: str | None = None) -> None:
        criu = criu or _require()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sk = parent
        argv = [criu, "swrk", str(child.fileno())]
        if ksm_merge:
            # Restored tasks are forked from this criu process and never exec, so the KSM
            # opt-in it is started with is inherited by every restored process. The init
            # binary's exec helper sets it: a preexec_fn would make subprocess fork() this
            # multi-threaded process and run every library's atfork handlers in it.
            argv = [str(INIT_BINARY), "--ksm-exec", *argv]
        if die_with_caller:
            # A restore whose caller died otherwise runs on for minutes, holding the images
            # (sessions.py's record is the backstop). PR_SET_PDEATHSIG follows the thread that
            # started CRIU, which is the one waiting on it here; setpriv sets it (no preexec_fn,
            # as above) and it survives the exec of CRIU, which is not set-uid. Restores only:
            # killing a dump mid-parasite would leave the source changed.
            argv = [SETPRIV, "--pdeathsig", "KILL", *argv]
        try:
            self._proc = subprocess.Popen(
                argv, pass_fds=(child.fileno(), *keep_fds),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                env={**os.environ, KDAT_DIR_ENV: str(kdat_dir()), **(env or {})},
            )
        finally:
            child.close()
        # Our unreaped child, so the pid cannot have been reused yet.
        self._pidfd = os.pidfd_open(self._proc.pid)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def call(self, req: rpc.criu_req, on_notify: Notify | None = None,
             timeout: float | None = None) -> rpc.criu_resp:
        """Send one request and serve its notifications until the answer. Past `timeout` seconds
        (default: the `criu` deadline) CRIU is killed and CriuTimeout raised; time spent in
        on_notify counts, since CRIU waits for it."""
        timeout = deadlines.current().criu if timeout is None else timeout
        until = time.monotonic() + timeout
        try:
            self._sk.sendall(req.SerializeToString())
        except OSError as e:
            raise CriuError(f"lost the connection to criu swrk: {e}") from e
        while True:
            self._wait_answer(until, timeout)
            try:
                size = len(self._sk.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK))
                buf = self._sk.recv(size)
            except OSError as e:
                raise CriuError(f"lost the connection to criu swrk: {e}") from e
            if not buf:
                raise CriuError(f"criu swrk exited without answering {self._stderr_so_far()}".rstrip())
            resp = rpc.criu_resp()
            resp.ParseFromString(buf)
            if resp.type != rpc.NOTIFY:
                return resp
            ok = True
            if on_notify is not None:
                try:
                    on_notify(resp.notify.script, resp.notify.pid)
                except BaseException:
                    ok = False
                    self._reply_notify(False)
                    raise
            self._reply_notify(ok)

    def _wait_answer(self, until: float, timeout: float) -> None:
        """Block until criu has something to say, or raise once it has died or `until` passed.

        Tasks criu forks while restoring inherit its end of the socket (and of the stderr pipe),
        so criu dying mid-restore does not make our end see EOF: watch the process itself.
        """
        p = select.poll()
        p.register(self._sk, select.POLLIN)
        p.register(self._pidfd, select.POLLIN)
        while True:
            left = until - time.monotonic()
            if left <= 0:
                # SIGKILL ends even the killable waits that CRIU's own timeout (SIGALRM) cannot,
                # such as a PTRACE_SEIZE waiting for a task that never runs.
                self.kill()
                self._proc.wait()
                raise CriuTimeout(f"criu swrk (pid {self._proc.pid}) did not answer within {timeout:.0f}s "
                                  "(deadline 'criu', see bunshinfork.deadlines) and was killed "
                                  f"{self._stderr_so_far()}".rstrip())
            ready = {fd for fd, _ in p.poll(max(1, int(left * 1000)))}
            if self._sk.fileno() in ready:
                return
            if self._pidfd in ready:
                status = self._proc.wait()
                how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
                raise CriuError(f"criu swrk (pid {self._proc.pid}) died without answering ({how}) "
                                f"{self._stderr_so_far()}".rstrip())

    def _stderr_so_far(self) -> str:
        # Non-blocking: criu's surviving helpers may hold the pipe open indefinitely.
        if self._proc.stderr is None:
            return ""
        os.set_blocking(self._proc.stderr.fileno(), False)
        try:
            return (os.read(self._proc.stderr.fileno(), 65536) or b"").decode(errors="replace").strip()
        except BlockingIOError:
            return ""

    def _reply_notify(self, ok: bool) -> None:
        ack = rpc.criu_req()
        ack.type = rpc.NOTIFY
        ack.notify_success = ok
        with contextlib.suppress(OSError):
            self._sk.sendall(ack.SerializeToString())

    def close(self) -> None:
        self._sk.close()
        os.close(self._pidfd)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stderr:
            self._proc.stderr.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A CRIU that answered success is reaped off its caller's path. Its exit closes the netfilter
# socket of its network unlock (kept open by CRIU patch 0011), and that release waits out an
# RCU grace period when nf_tables' destroy work has not run yet: up to 10 ms here, which held
# a dump's source frozen and every restore. Its images and the restored tasks are complete when
# it answers; the record (sessions.py) stays until it is reaped, as gc's backstop. The pool's
# threads are joined at interpreter exit, and Session.close kills a CRIU past 30 s.
_reaper = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bunshin-criu-reap")
_reaping: set[Future[None]] = set()
_reaping_lock = threading.Lock()


def _reap_later(s: Session, entry: Path | None) -> None:
    def reap() -> None:
        try:
            s.close()
        finally:
            sessions.forget(entry)

    fut = _reaper.submit(reap)
    with _reaping_lock:
        _reaping.add(fut)
    fut.add_done_callback(_reaped)


def _reaped(fut: Future[None]) -> None:
    with _reaping_lock:
        _reaping.discard(fut)


def _reaper_after_fork() -> None:
    # A forked child has none of the pool's threads, and the CRIU being reaped are its parent's.
    global _reaper, _reaping, _reaping_lock
    _reaper = ThreadPoolExecutor(max_workers=2, thread_name_prefix="bunshin-criu-reap")
    _reaping, _reaping_lock = set(), threading.Lock()


os.register_at_fork(after_in_child=_reaper_after_fork)


def _start_idle(key: prestart.Key) -> Session:
    criu, ksm_merge, die_with_caller, env = key
    return Session(ksm_merge=ksm_merge, env=dict(env), die_with_caller=die_with_caller, criu=criu)


PRESTARTED = prestart.install(prestart.Prestarted(
    _start_idle, alive=lambda s: s.alive(), close=lambda s: s.close()))  # type: ignore[attr-defined]


def _session(keep_fds: tuple[int, ...], ksm_merge: bool, env: dict[str, str] | None,
             die_with_caller: bool) -> Session:
    """A started CRIU for one request: an idle one of its kind (prestart.py), else a new one.
    A request that hands CRIU descriptors to inherit (keep_fds) starts its own."""
    # Here, not at the start of CRIU: an idle one was started before a leftover appeared.
    unblock_kdat_cache()
    if not keep_fds:
        # What an idle CRIU was started with: besides Session's arguments, the environment it
        # inherited where CRIU reads it (its patches' CRIU_* switches; PATH for the tools it runs).
        inherited = {k: v for k, v in os.environ.items() if k.startswith("CRIU_") or k == "PATH"}
        key = (_require(), ksm_merge, die_with_caller, tuple(sorted({**inherited, **(env or {})}.items())))
        s = PRESTARTED.take(key)
        if s is not None:
            return s  # type: ignore[return-value]
    return Session(keep_fds, ksm_merge, env, die_with_caller=die_with_caller)


def settle(timeout: float = 35.0) -> None:
    """Wait until every CRIU that answered has been reaped (tests, gc, a server's shutdown)."""
    with _reaping_lock:
        pending = list(_reaping)
    futures_wait(pending, timeout=timeout)


def request(kind: str, opts: rpc.criu_opts, on_notify: Notify | None = None, keep_fds: tuple[int, ...] = (),
            ksm_merge: bool = False, log: Path | None = None,
            session_hook: Callable[[Session], None] | None = None,
            env: dict[str, str] | None = None, timeout: float | None = None) -> rpc.criu_resp:
    """Run one DUMP, PRE_DUMP or RESTORE; raise CriuError with the log's error lines on failure,
    CriuTimeout (CRIU killed) past `timeout` seconds, by default the `criu` deadline."""
    req = rpc.criu_req()
    req.type = {"dump": rpc.DUMP, "pre_dump": rpc.PRE_DUMP, "restore": rpc.RESTORE}[kind]
    req.opts.MergeFrom(opts)
    req.opts.notify_scripts = on_notify is not None
    timeout = deadlines.current().criu if timeout is None else timeout
    # A dump's images directory is its own; a restore's is its snapshot's, which other
    # restores read at the same time.
    images = sessions.dir_id(opts.images_dir) if kind != "restore" and opts.images_dir else None
    entry = None
    answered = False
    try:
        s = _session(keep_fds, ksm_merge, env, die_with_caller=kind == "restore")
        try:
            entry = sessions.record(s.pid, kind, time.time() + timeout, images)
            if session_hook is not None:
                session_hook(s)
            try:
                resp = s.call(req, on_notify, timeout)
            except CriuTimeout as e:
                tail = log_tail(log) if log is not None else ""
                raise CriuTimeout(f"criu {kind}: {e}\n{tail}".rstrip()) from None
            answered = resp.success
        finally:
            if answered:
                _reap_later(s, entry)
            else:
                s.close()
    except CriuError:
        if images:
            sessions.end_helpers(images)  # CRIU is reaped (Session.close): its helpers may not be
        raise
    finally:
        if not answered:
            sessions.forget(entry)  # once CRIU is reaped (Session.close)
    if not resp.success:
        raise CriuError(failure(kind, resp, log))
    return resp


def version() -> tuple[int, int, int]:
    """CRIU's version, asked over RPC (VERSION)."""
    req = rpc.criu_req()
    req.type = rpc.VERSION
    with Session() as s:
        resp = s.call(req)
    if not resp.success or not resp.HasField("version"):
        raise CriuError("criu swrk did not answer VERSION")
    v = resp.version
    return v.major_number, v.minor_number, v.sublevel if v.HasField("sublevel") else 0


def version_problem(v: tuple[int, ...]) -> str | None:
    """Why this CRIU version cannot serve bunshinfork, or None."""
    if v[:2] >= REQUIRED:
        return None
    if v[0] < 4:
        why = "bookworm's 3.17 fails on this kernel's vDSO (vvar_vclock)"
    else:
        why = "4.1.x cannot dump TCP sockets on kernels >= 6.16"
    return f"too old: needs {'.'.join(map(str, REQUIRED))}.x; {why}; scripts/setup.sh builds 4.2.1"


_dirty_tracking: bool | None = None


def dirty_tracking() -> bool:
    """Whether CRIU tracks memory changes on this kernel (soft-dirty bits: --track-mem and parent
    images), asked once over RPC (FEATURE_CHECK, `criu check --feature mem_dirty_track`)."""
    global _dirty_tracking
    if _dirty_tracking is None:
        req = rpc.criu_req()
        req.type = rpc.FEATURE_CHECK
        req.features.mem_track = True
        with Session() as s:
            resp = s.call(req)
        _dirty_tracking = bool(resp.success and resp.HasField("features") and resp.features.mem_track)
    return _dirty_tracking


def check() -> str | None:
    """`criu check` over RPC (CHECK): None when CRIU finds everything it needs, else why not."""
    with tempfile.TemporaryDirectory(prefix="bunshin-criu-check-") as d:
        req = rpc.criu_req()
        req.type = rpc.CHECK
        req.opts.MergeFrom(new_opts())
        req.opts.images_dir = d
        req.opts.log_file = "check.log"
        req.opts.log_level = 2
        with Session() as s:
            resp = s.call(req)
        if resp.success:
            return None
        return resp.cr_errmsg or log_tail(Path(d) / "check.log", lines=5)


def check_pycriu() -> Check:
    if rpc is None:
        return Check("pycriu", False, "pycriu does not import; scripts/setup.sh installs it into the venv",
                     required=True)
    return Check("pycriu", True, f"importable ({os.path.dirname(rpc.__file__ or '?')})", required=True)


def check_criu_version() -> Check:
    try:
        path = binary()
        v = version()
    except BunshinError as e:
        return Check("criu", False, f"{e}; scripts/setup.sh builds 4.2.1", required=True)
    shown = ".".join(map(str, v))
    if why := version_problem(v):
        return Check("criu", False, f"{shown} ({path}) is {why}", required=True)
    newer = "; newer than the tested 4.2.x" if v[:2] > REQUIRED else ""
    return Check("criu", True, f"{shown} ({path}){newer}", required=True)


def check_criu_check() -> Check:
    if os.geteuid() != 0:
        return Check("criu check", False, "criu check needs root", required=True)
    try:
        problem = check()
    except BunshinError as e:
        return Check("criu check", False, str(e), required=True)
    if problem is None:
        return Check("criu check", True, "Looks good.", required=True)
    return Check("criu check", False, problem, required=True)
