"""Workspace networking. The netns itself is created with the workspace (loopback up).

"none": loopback only. "bridge": see setup_bridge (pyroute2).
"""

from __future__ import annotations

from typing import Any

from .errors import NetworkError


def setup(ws_id: str, init_pid: int, mode: str, nat: bool = False) -> dict[str, Any]:
    if mode == "none":
        return {"mode": "none"}
    raise NetworkError(f"network mode {mode!r} is not available yet")


def teardown(ws_id: str, record: dict[str, Any]) -> None:
    return None
