"""The egress proxies of workspaces with domain rules (sniproxy.py): started, found, stopped.

One process per workspace (a clone has its own), not a thread of its creator: a workspace
outlives the process that made it (the CLI, a crashed script), and its domain rules must keep
working. The starter binds the listening socket itself (to the gateway address, with
IP_FREEBIND: a clone's gateway address appears on its link only after the restore) and hands
it over, so the port is known before the nftables redirect to it is installed, and a
connection that arrives before the proxy runs waits in the backlog instead of being refused.

Each proxy carries its workspace's id and TAG in its argv: teardown, gc and the census find
them in /proc, so nothing else needs to record them. A proxy that is gone (killed, the host
rebooted) leaves its redirect pointing at a closed port: the workspace's connections to
allowed names are then refused, never let through.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import NetworkError
from . import sniproxy

RESOLVER_ENV = "BUNSHIN_EGRESS_RESOLVER"  # the DNS server the proxies resolve names with; unset: the host's
IP_FREEBIND = 15
_STOP_WAIT = 5.0
_children: dict[int, subprocess.Popen[bytes]] = {}  # ours, reaped when stopped


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def running() -> dict[int, str]:
    """pid -> workspace id of every egress proxy on this machine."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        argv = _cmdline(int(d))
        if sniproxy.TAG in argv and "--ws" in argv:
            i = argv.index("--ws")
            if i + 1 < len(argv):
                out[int(d)] = argv[i + 1]
    return out


def start(ws_id: str, domains: tuple[str, ...], gateway: str) -> int:
    """Start the workspace's proxy listening on gateway:<port>; returns the port."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        lsock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        lsock.bind((gateway, 0))
        lsock.listen(128)
        port = int(lsock.getsockname()[1])
        argv = [sys.executable, "-I", str(Path(sniproxy.__file__)), "--tag", sniproxy.TAG, "--ws", ws_id,
                "--fd", str(lsock.fileno()), "--domains", ",".join(domains)]
        if resolver := os.environ.get(RESOLVER_ENV, "").strip():
            argv += ["--resolver", resolver]
        # Its own session: a terminal's hangup or the creator's process group must not end it.
        proc = subprocess.Popen(argv, pass_fds=(lsock.fileno(),), start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as e:
        raise NetworkError(f"cannot start the egress proxy for {ws_id}'s domain rules: {e}") from e
    finally:
        lsock.close()
    _children[proc.pid] = proc
    _visible(proc)
    return port


def _visible(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Return once running() finds the new proxy by its argv, so a stop or gc right after the
    start cannot miss it (a census once saw it only later); NetworkError if it died instead."""
    fd = os.pidfd_open(proc.pid)
    try:
        deadline = time.monotonic() + timeout
        while sniproxy.TAG not in _cmdline(proc.pid):
            # The pidfd turns readable if the proxy exits; otherwise this paces the re-read.
            if select.select([fd], [], [], 0.01)[0] or time.monotonic() > deadline:
                _children.pop(proc.pid, None)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
                raise NetworkError(f"the egress proxy {proc.pid} did not start (exit {proc.returncode})")
    finally:
        os.close(fd)


def _kill(pid: int) -> bool:
    """Kill one proxy and wait for it to be gone; False if it already was."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        if sniproxy.TAG not in _cmdline(pid):
            return False  # the pid was reused meanwhile
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        # The pidfd turns readable when the process has exited.
        if not select.select([fd], [], [], _STOP_WAIT)[0]:
            raise NetworkError(f"egress proxy {pid} did not exit after SIGKILL")
    finally:
        os.close(fd)
    proc = _children.pop(pid, None)
    if proc is not None:
        proc.wait()
    return True


def pids(ws_id: str) -> set[int]:
    """The workspace's running proxies."""
    return {pid for pid, ws in running().items() if ws == ws_id}


def stop_pids(which: set[int]) -> None:
    """Stop these proxies (a policy's replaced ones, or a failed replacement's new one)."""
    for pid in which:
        _kill(pid)


def stop(ws_id: str) -> list[str]:
    """Stop the workspace's proxies (one, normally). Returns them as "pid ws"."""
    return [f"{pid} {ws}" for pid, ws in running().items() if ws == ws_id and _kill(pid)]


def gc(live: set[str]) -> list[str]:
    """Stop every proxy whose workspace is not live (its creator died before destroying it)."""
    return [f"egress proxy {pid} ws={ws}" for pid, ws in running().items() if ws not in live and _kill(pid)]
