"""Memory subsystem: how a clone's anonymous memory relates to its source's.

Engines:
- "copy": plain CRIU restore, a private copy per clone (the paper's CRIU baseline).
- "ksm":  the same restore, with every restored process opted into kernel samepage merging,
          which deduplicates the clones' identical pages after the fact.
- "cow":  the bunshin kernel module maps the source's pages copy-on-write (needs /dev/bunshin).
- "auto": cow when /dev/bunshin exists, else ksm.
"""

from __future__ import annotations

from ..errors import KernelFeatureError, SpecError
from . import cow

ENGINES = ("copy", "ksm", "cow")


def resolve(name: str) -> str:
    if name == "auto":
        return "cow" if cow.available() else "ksm"
    if name not in ENGINES:
        raise SpecError(f"unknown memory engine {name!r}; use 'auto', 'copy', 'ksm' or 'cow'")
    if name == "cow" and not cow.available():
        raise KernelFeatureError(cow.unavailable_reason())
    return name
