"""The engine's configurations: one list, which every driver, benchmark and demo names them from.

    Base   memory sharing only: each sample runs every call in its own workspace
    Spec   Base + speculative tool execution (the speculator)
    Full   Spec + the tool-prefix cache

build_core (wiring.py) builds each from a CoreConfig; `speculates` and `caches` say which parts a
configuration turns on, so a driver's CoreConfig follows the list instead of repeating it.
"""

from __future__ import annotations

from typing import Literal, cast

Config = Literal["Base", "Spec", "Full"]
CONFIGS: tuple[Config, ...] = ("Base", "Spec", "Full")


def check_config(name: str) -> Config:
    """`name` as a configuration; ValueError naming the list when it is none of them."""
    if name not in CONFIGS:
        raise ValueError(f"unknown configuration {name!r}; one of {', '.join(CONFIGS)}")
    return cast(Config, name)


def speculates(config: str) -> bool:
    """The configuration runs the speculator (Spec, Full); ValueError for none of CONFIGS."""
    return check_config(config) in ("Spec", "Full")


def caches(config: str) -> bool:
    """The configuration keeps the tool-prefix cache (Full); ValueError for none of CONFIGS."""
    return check_config(config) == "Full"


__all__ = ["CONFIGS", "Config", "caches", "check_config", "speculates"]
