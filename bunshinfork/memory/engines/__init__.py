"""The memory engines, registered in one table: ENGINES.

As CRIU registers each file type through one ops table, every engine is one module of this
package holding an Engine subclass (base.py) and registering its instance: what it
contributes to a snapshot and to a clone, whether this host runs it and why not, its rank for
memory='auto' and its doctor probes. Adding an engine is its module plus its import here;
nothing outside memory/ names one.
"""

from __future__ import annotations

from . import copy, cow, ksm
from .base import ENGINES, Engine, best, register

__all__ = ["ENGINES", "Engine", "best", "register"]
# Every engine module registers itself on import.
MODULES = (copy, cow, ksm)
