"""A process for the copy-on-write tests, driven line by line over stdin.

source mode: allocate SIZE bytes of a seeded pattern in its own anonymous mapping ("wipeonfork" or
"dontfork" as a third argument: madvise it so). With "file=PATH" instead, map SIZE bytes of PATH
privately and write the pattern over its first half only: written pages are anonymous, the rest
are the file's page-cache pages.
target mode: map anonymous memory at exactly [START, END) (MAP_FIXED_NOREPLACE), then stop
itself so the orchestrator can share a snapshot into it. "used" as a fourth argument writes and
drops the range first, leaving empty page tables in it. "file=PATH[@PAGE]" maps PATH privately
there instead (from that page of the file), with a marker written into its first page.
"""

import ctypes
import hashlib
import mmap
import os
import signal
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FIXED_NOREPLACE = 0x100000


def pfns(addr: int, size: int) -> list[int]:
    out = []
    with open("/proc/self/pagemap", "rb") as f:
        for page in range(addr // 4096, (addr + size) // 4096):
            f.seek(page * 8)
            e = int.from_bytes(f.read(8), "little")
            out.append(e & ((1 << 55) - 1) if e >> 63 else -1)
    return out


def map_file(spec: str, start: int, size: int, flags: int) -> int:
    path, _, page = spec.partition("@")
    fd = os.open(path, os.O_RDONLY)
    got = libc.mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | flags, fd,
                    int(page or 0) * 4096)
    os.close(fd)
    return got


mode = sys.argv[1]
if mode == "source" and len(sys.argv) > 3 and sys.argv[3].startswith("file="):
    size = int(sys.argv[2])
    addr = map_file(sys.argv[3][5:], 0, size, 0)
    ctypes.memmove(addr, hashlib.shake_256(b"bunshin").digest(size // 2), size // 2)
elif mode == "source":
    size = int(sys.argv[2])
    # A mapping of its own, page aligned, so the snapshot's VMA is exactly this buffer.
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(hashlib.shake_256(b"bunshin").digest(size))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    advice = {"wipeonfork": 18, "dontfork": 10}  # MADV_WIPEONFORK, MADV_DONTFORK
    if len(sys.argv) > 3 and libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), advice[sys.argv[3]]):
        raise OSError(ctypes.get_errno(), "madvise")
else:
    start, end = int(sys.argv[2]), int(sys.argv[3])
    size = end - start
    if len(sys.argv) > 4 and sys.argv[4].startswith("file="):
        got = map_file(sys.argv[4][5:], start, size, MAP_FIXED_NOREPLACE)
        if got == start:
            ctypes.memmove(start, b"target's own", 12)
    else:
        got = libc.mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
    if got != start:
        print("collision", flush=True)
        sys.exit(3)
    addr = start
    m = (ctypes.c_char * size).from_address(addr)
    if len(sys.argv) > 4 and sys.argv[4] == "used":
        # Leave empty page tables behind, as a restored process's range can have them: small
        # pages written, then dropped. The VMA keeps its anon_vma, so sharing needs a reset.
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), 15)  # MADV_NOHUGEPAGE
        ctypes.memset(start, 1, size)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), 4)  # MADV_DONTNEED
print(addr, size, flush=True)
if mode == "target":
    os.kill(os.getpid(), signal.SIGSTOP)

buf = (ctypes.c_char * size).from_address(addr)
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "hash":
        print(hashlib.sha256(bytes(buf)).hexdigest(), flush=True)
    elif cmd == "write":  # write OFFSET TEXT
        off = int(arg[0])
        data = arg[1].encode()
        ctypes.memmove(addr + off, data, len(data))
        print("ok", flush=True)
    elif cmd == "read":  # read OFFSET LEN
        off, n = int(arg[0]), int(arg[1])
        print(bytes(buf[off:off + n]).hex(), flush=True)
    elif cmd == "pfns":
        print(" ".join(map(str, pfns(addr, size))), flush=True)
    elif cmd == "exit":
        break
