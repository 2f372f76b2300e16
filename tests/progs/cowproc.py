"""A process for the copy-on-write tests, driven line by line over stdin.

source mode: allocate SIZE bytes of a seeded pattern in its own anonymous mapping ("wipeonfork" or
"dontfork" as a third argument: madvise it so).
target mode: map anonymous memory at exactly [START, END) (MAP_FIXED_NOREPLACE), then stop
itself so the orchestrator can share a snapshot into it. "used" as a fourth argument writes and
drops the range first, leaving empty page tables in it.
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


mode = sys.argv[1]
if mode == "source":
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
