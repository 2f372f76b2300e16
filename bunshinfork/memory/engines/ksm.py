"""ksm: the copy restore, with every restored process opted into kernel samepage merging."""

from __future__ import annotations

from ...contract import Build
from .. import ksm
from .base import Engine, register


class Ksm(Engine):
    """The copy restore, with every restored process opted into kernel samepage merging, which
    deduplicates the clones' identical pages after the fact; ksmd is boosted meanwhile."""

    name = "ksm"
    kind = "image"
    rank = 1
    probes = (ksm.check_ksm,)

    def unavailable_reason(self) -> str:
        why = ksm.unavailable_reason()
        return f"memory='ksm' is unavailable: {why}" if why else ""

    def restore(self, b: Build) -> None:
        ksm.tuner.boost()
        b.deferred.append(ksm.tuner.release)
        b.ksm_merge = True


register(Ksm())
