"""copy: plain CRIU restore, a private copy per clone (the paper's CRIU baseline)."""

from __future__ import annotations

from .base import Engine, register


class Copy(Engine):
    """Every host runs it: CRIU's page images restored privately into each clone."""

    name = "copy"
    kind = "image"
    rank = 0

    def unavailable_reason(self) -> str:
        return ""


register(Copy())
