"""Memory subsystem: how a clone's anonymous memory relates to its source's.

Engines:
- "copy": plain CRIU restore, a private copy per clone (the paper's CRIU baseline).
- "ksm":  the same restore, with every restored process opted into kernel samepage merging,
          which deduplicates the clones' identical pages after the fact.
- "cow":  the bunshin kernel module maps the source's pages copy-on-write (needs /dev/bunshin).
- "auto": cow when /dev/bunshin exists, else ksm where processes can opt in (Linux 6.4),
          else copy.
"""

from __future__ import annotations

from ..errors import KernelFeatureError, SpecError
from . import cow, ksm

ENGINES = ("copy", "ksm", "cow")


def resolve(name: str) -> str:
    if name == "auto":
        if cow.available():
            return "cow"
        return "ksm" if ksm.merge_supported() else "copy"
    if name not in ENGINES:
        raise SpecError(f"unknown memory engine {name!r}; use 'auto', 'copy', 'ksm' or 'cow'")
    if name == "cow" and not cow.available():
        raise KernelFeatureError(cow.unavailable_reason())
    if name == "ksm" and (why := ksm.unavailable_reason()):
        raise KernelFeatureError(f"memory='ksm' is unavailable: {why}")
    return name
