"""CFFI builder for bunshinfork._native (csrc/native.c)."""

import os
from pathlib import Path

from cffi import FFI

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# setuptools refuses absolute source paths; the build runs from the project root.
CSRC_REL = os.path.relpath(CSRC)

ffibuilder = FFI()
ffibuilder.cdef((CSRC / "native.h").read_text())
ffibuilder.set_source(
    "bunshinfork._native",
    '#include "native.h"',
    sources=[os.path.join(CSRC_REL, "native.c"), os.path.join(CSRC_REL, "inject.c")],
    include_dirs=[CSRC_REL],
    extra_compile_args=["-O2", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
