"""CFFI builder for bunshinfork._native (csrc/native.c), with the bunshin module's uapi.

The ioctl numbers and request layouts of /dev/bunshin are read from kernel/bunshin_uapi.h
itself: the cdef below only names them, and `...` lets the compiler fill in every value.
"""

import os
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
# setuptools refuses absolute source paths; the build runs from the project root.
CSRC_REL = os.path.relpath(ROOT / "csrc")

UAPI_CDEF = """
#define BUNSHIN_IOC_SNAPSHOT ...
#define BUNSHIN_IOC_SHARE ...
#define BUNSHIN_IOC_STATS ...
#define BUNSHIN_SHARE_RESET ...
#define BUNSHIN_SHARE_FILES ...
struct bunshin_snapshot_req { int32_t pid; uint32_t flags; ...; };
struct bunshin_share_req { int32_t snap_fd; int32_t holder_pid; int32_t target_pid; uint32_t flags;
                           uint64_t start; uint64_t end; uint64_t vmas; uint64_t skipped; ...; };
struct bunshin_stats_req { int32_t snap_fd; uint32_t flags; uint64_t pages; uint64_t private_pages; ...; };
"""

ffibuilder = FFI()
ffibuilder.cdef((ROOT / "csrc" / "native.h").read_text() + UAPI_CDEF)
ffibuilder.set_source(
    "bunshinfork._native",
    '#include "native.h"\n#include "bunshin_uapi.h"',
    sources=[os.path.join(CSRC_REL, "native.c"), os.path.join(CSRC_REL, "inject.c")],
    include_dirs=[str(ROOT / "csrc"), str(ROOT / "kernel")],
    extra_compile_args=["-O2", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
