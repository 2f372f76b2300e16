#!/usr/bin/env python3
"""A long-running workload whose kernel-visible state must survive a live fork.

Copied into a workspace and started in the background (`python3 /root/agent.py --serve`),
it builds one of each kind of state CRIU has to carry, then serves requests on a unix
socket (/root/agent.sock). `python3 /root/agent.py --op '{"op": "report"}'` prints the
answer as JSON. Stdlib only: it runs under the workspace's /usr/bin/python3.

Every check is made by the agent from the inside against values fixed at start-up (or
derived from constants below that the tests import too), so a clone reports exactly
what it holds, not what the host believes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import json
import mmap
import os
import random
import select
import signal
import socket
import struct
import sys
import termios
import threading
import time
from typing import Any

SOCK = "/root/agent.sock"
READY = "/root/agent.ready"
PIPE_DATA = b"pipe: written before the fork, never read by the source\n"
SOCKPAIR_DATA = b"socketpair: queued in the kernel, unread\n"
EVENTFD_VALUE = 41
SHM_KEY = 0x42534846  # "BSHF"
SHM_SIZE = 1 << 20
POSIX_SHM = "/dev/shm/agent-posix"
OFFSET_FILE = "/root/agent-offset.txt"
OFFSET = 1000
GHOST_FILE = "/root/agent-ghost.bin"
WORKERS = 4
TIMER_INTERVAL_NS = 10_000_000
PAGE = 4096

libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
IPC_CREAT = 0o1000
CLOCK_MONOTONIC = 1
O_NONBLOCK_CLOEXEC = os.O_NONBLOCK | os.O_CLOEXEC  # TFD_/SFD_ flags share these values


def pattern(seed: int, size: int) -> bytearray:
    """Deterministic bytes that differ on every page, so KSM cannot merge within one copy.

    A random 1 MiB block repeated, each 4 KiB page stamped with its index: generating
    512 MiB of fresh randomness would take seconds of the test's budget.
    """
    block = random.Random(seed).randbytes(1 << 20)
    out = bytearray(size)
    view = memoryview(out)
    for start in range(0, size, len(block)):
        n = min(len(block), size - start)
        view[start:start + n] = block[:n]
    for page in range(size // PAGE):
        struct.pack_into("<QQ", out, page * PAGE, page, seed)
    return out


def shm_pattern(tag: str) -> bytes:
    block = hashlib.sha256(tag.encode()).digest()
    return (block * (SHM_SIZE // len(block) + 1))[:SHM_SIZE]


def offset_file_content() -> bytes:
    return bytes((i * 7 + 3) % 256 for i in range(4096))


def ghost_content() -> bytes:
    return pattern(99, 64 << 10)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return ret


def timerfd(interval_ns: int, armed: bool = True) -> int:
    """A periodic timer; unarmed, it keeps its interval but never fires."""
    fd = _check(libc.timerfd_create(CLOCK_MONOTONIC, O_NONBLOCK_CLOEXEC), "timerfd_create")
    sec, nsec = divmod(interval_ns, 1_000_000_000)
    spec = struct.pack("qqqq", sec, nsec, *((sec, nsec) if armed else (0, 0)))  # it_interval, it_value
    _check(libc.timerfd_settime(fd, 0, ctypes.c_char_p(spec), None), "timerfd_settime")
    return fd


def signalfd(signo: int) -> int:
    mask = struct.pack("Q", 1 << (signo - 1)) + bytes(120)  # sigset_t is 128 bytes
    return _check(libc.signalfd(-1, ctypes.c_char_p(mask), O_NONBLOCK_CLOEXEC), "signalfd")


def sysv_attach(create: bool) -> tuple[int, int]:
    shmid = _check(libc.shmget(SHM_KEY, SHM_SIZE, (IPC_CREAT | 0o600) if create else 0), "shmget")
    addr = libc.shmat(shmid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    return shmid, addr


def fionread(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def shd_pending() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("ShdPnd:"):
                return int(line.split()[1], 16)
    return 0


class Agent:
    def __init__(self, mib: int, seed: int) -> None:
        # Blocked before any thread exists, so every thread inherits the mask and SIGUSR1
        # stays pending for the signalfd instead of killing the process.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        t0 = time.monotonic()
        self.big = pattern(seed, mib << 20)
        self.big_sha = hashlib.sha256(self.big).hexdigest()
        self.pattern_seconds = time.monotonic() - t0

        self.pipe_r, self.pipe_w = os.pipe()
        os.write(self.pipe_w, PIPE_DATA)
        self.sp_a, self.sp_b = socket.socketpair()
        self.sp_a.sendall(SOCKPAIR_DATA)

        self.efd = os.eventfd(EVENTFD_VALUE, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.tfd = timerfd(TIMER_INTERVAL_NS)
        self.tfd_disarmed = timerfd(TIMER_INTERVAL_NS, armed=False)
        self.sfd = signalfd(signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        self.ep = select.epoll()
        self.ep.register(self.efd, select.EPOLLIN)

        self.shmid, self.shm_addr = sysv_attach(create=True)
        ctypes.memmove(self.shm_addr, shm_pattern("sysv"), SHM_SIZE)
        pfd = os.open(POSIX_SHM, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(pfd, SHM_SIZE)
        self.posix = mmap.mmap(pfd, SHM_SIZE, mmap.MAP_SHARED)
        os.close(pfd)
        self.posix[:] = shm_pattern("posix")

        with open(OFFSET_FILE, "wb") as f:
            f.write(offset_file_content())
        self.off_fd = os.open(OFFSET_FILE, os.O_RDONLY)
        os.lseek(self.off_fd, OFFSET, os.SEEK_SET)
        with open(GHOST_FILE, "wb") as f:
            f.write(ghost_content())
        self.ghost_fd = os.open(GHOST_FILE, os.O_RDONLY)
        os.unlink(GHOST_FILE)

        # TCP inside the workspace: one connection, opened now and never reopened.
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(1)
        self.tcp_served = 0
        threading.Thread(target=self._tcp_server, daemon=True, name="tcp-server").start()
        self.tcp = socket.create_connection(self.lsock.getsockname())
        self.tcp_file = self.tcp.makefile("rb")

        self.ticks = [0] * WORKERS
        for i in range(WORKERS):
            threading.Thread(target=self._worker, args=(i,), daemon=True, name=f"worker-{i}").start()

        self.kv: dict[str, str] = {}
        self.messages: list[str] = []
        self.generation = 0
        self.cursor = 0

    def _tcp_server(self) -> None:
        conn, _ = self.lsock.accept()
        f = conn.makefile("rb")
        for line in f:
            if line.strip() == b"inc":
                self.tcp_served += 1
                conn.sendall(b"%d\n" % self.tcp_served)

    def _worker(self, i: int) -> None:
        while True:
            self.ticks[i] += 1
            time.sleep(0.01)

    # ---- requests ----

    def tcp_inc(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            self.tcp.sendall(b"inc\n")
            out.append(int(self.tcp_file.readline()))
        return out

    def report(self, sha: bool) -> dict[str, Any]:
        r: dict[str, Any] = {"pid": os.getpid(), "threads": sorted(t.name for t in threading.enumerate())}
        if sha:
            r["big_sha"] = hashlib.sha256(self.big).hexdigest()
        r["big_len"] = len(self.big)

        # Read and put back: the same process owns both ends, so the pipe ends as it began.
        r["pipe_pending"] = fionread(self.pipe_r)
        os.set_blocking(self.pipe_r, False)
        data = os.read(self.pipe_r, 65536)
        os.write(self.pipe_w, data)
        r["pipe_data"] = data.decode()

        r["sockpair_data"] = self.sp_b.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT).decode()

        # epoll first: reading the eventfd would clear the readiness it reports.
        r["epoll_ready"] = [fd == self.efd for fd, ev in self.ep.poll(0) if ev & select.EPOLLIN]
        value = os.eventfd_read(self.efd)
        os.eventfd_write(self.efd, value)
        r["eventfd"] = value

        with contextlib.suppress(BlockingIOError):
            os.read(self.tfd, 8)  # drain what piled up, then see it fire afresh
        time.sleep(5 * TIMER_INTERVAL_NS / 1e9)
        try:
            r["timer_expirations"] = struct.unpack("Q", os.read(self.tfd, 8))[0]
        except BlockingIOError:
            r["timer_expirations"] = 0
        try:
            r["disarmed_timer_expirations"] = struct.unpack("Q", os.read(self.tfd_disarmed, 8))[0]
        except BlockingIOError:
            r["disarmed_timer_expirations"] = 0

        p = select.poll()
        p.register(self.sfd, select.POLLIN)
        r["signalfd_readable"] = bool(p.poll(0))
        r["sigusr1_pending"] = bool(shd_pending() & (1 << (signal.SIGUSR1 - 1)))

        r["sysv_ok"] = ctypes.string_at(self.shm_addr, SHM_SIZE) == shm_pattern("sysv")
        r["sysv_head"] = ctypes.string_at(self.shm_addr, 16).hex()
        r["posix_ok"] = self.posix[:] == shm_pattern("posix")
        r["posix_head"] = self.posix[:16].hex()

        r["offset"] = os.lseek(self.off_fd, 0, os.SEEK_CUR)
        expected = offset_file_content()[OFFSET:OFFSET + 64]
        r["offset_bytes_ok"] = os.pread(self.off_fd, 64, r["offset"]) == expected
        r["ghost_ok"] = os.pread(self.ghost_fd, 1 << 20, 0) == bytes(ghost_content())
        r["ghost_link"] = os.readlink(f"/proc/self/fd/{self.ghost_fd}")
        r["ghost_path_exists"] = os.path.exists(GHOST_FILE)

        r["tcp_local"] = list(self.tcp.getsockname())
        r["tcp_peer"] = list(self.tcp.getpeername())
        before = list(self.ticks)
        time.sleep(0.1)
        r["workers_advancing"] = [a > b for a, b in zip(self.ticks, before, strict=True)]
        return r

    def poke_shm(self, tag: str) -> str:
        mark = hashlib.sha256(tag.encode()).digest()[:16]
        ctypes.memmove(self.shm_addr, mark, 16)
        self.posix[:16] = mark
        return mark.hex()

    def dirty(self, pages: int) -> str:
        """Rewrite `pages` pages of the big buffer (those after the last call's) and both shared
        memory heads; returns the buffer's new sha256."""
        self.generation += 1
        npages = len(self.big) // PAGE
        stamp = struct.pack("<Q", self.generation)
        for k in range(pages):
            i = (self.cursor + k) % npages
            self.big[i * PAGE:i * PAGE + 8] = stamp
        self.cursor += pages
        self.poke_shm(f"generation {self.generation}")
        return hashlib.sha256(self.big).hexdigest()

    def handle(self, req: dict[str, Any]) -> Any:
        op = req["op"]
        if op == "report":
            return self.report(bool(req.get("sha", False)))
        if op == "tcp":
            return self.tcp_inc(int(req.get("n", 1)))
        if op == "set":
            self.kv[req["k"]] = req["v"]
            return None
        if op == "msg":
            self.messages.append(req["m"])
            return None
        if op == "state":
            return {"kv": self.kv, "messages": self.messages}
        if op == "poke_shm":
            return self.poke_shm(req["tag"])
        if op == "big_sha":
            return hashlib.sha256(self.big).hexdigest()
        if op == "dirty":
            return self.dirty(int(req["pages"]))
        raise ValueError(f"unknown op {op!r}")

    def serve(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCK)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(SOCK)
        srv.listen(16)
        tmp = READY + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "big_sha": self.big_sha, "big_len": len(self.big),
                       "pattern_seconds": self.pattern_seconds}, f)
        os.rename(tmp, READY)  # appears whole: the host polls for it
        while True:
            conn, _ = srv.accept()
            with conn, conn.makefile("rwb") as f:
                try:
                    reply = {"ok": True, "result": self.handle(json.loads(f.readline()))}
                except Exception as e:
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                f.write(json.dumps(reply).encode() + b"\n")
                f.flush()


def client(req: str, timeout: float) -> int:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(SOCK)
    with s, s.makefile("rwb") as f:
        f.write(req.encode() + b"\n")
        f.flush()
        line = f.readline()
    sys.stdout.write(line.decode())
    return 0 if json.loads(line)["ok"] else 1


def peek_shm() -> int:
    """Print the first bytes of both shared memory objects, reached afresh by key and by name:
    what another process of the same (or of a forked) IPC namespace sees."""
    _, addr = sysv_attach(create=False)
    with open(POSIX_SHM, "rb") as f:
        posix = f.read(16)
    print(json.dumps({"sysv": ctypes.string_at(addr, 16).hex(), "posix": posix.hex()}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--op", help="one JSON request to send to the running agent")
    ap.add_argument("--report", action="store_true", help="shorthand for --op '{\"op\": \"report\"}'")
    ap.add_argument("--peek-shm", action="store_true")
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args()
    if a.serve:
        Agent(a.mib, a.seed).serve()
        return 0
    if a.peek_shm:
        return peek_shm()
    return client(a.op or json.dumps({"op": "report", "sha": True}), a.timeout)


if __name__ == "__main__":
    sys.exit(main())
