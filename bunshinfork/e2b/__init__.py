"""E2B's interface over bunshin workspaces: Sandbox (sandbox.py) and AsyncSandbox
(async_sandbox.py), each having a Workspace and reaching it through its public API; E2B's
types (types.py), the instance-or-class dispatcher both use (dispatch.py), templates and
saved snapshots (templates.py), and E2B's own state of a sandbox beside its record
(sidecar.py)."""

from .async_sandbox import AsyncSandbox, AsyncSandboxPaginator, AsyncSnapshotPaginator
from .dispatch import instance_or_class
from .sandbox import Sandbox
from .types import (
    SandboxInfo,
    SandboxMetrics,
    SandboxPaginator,
    SandboxQuery,
    SandboxState,
    SnapshotInfo,
    SnapshotPaginator,
)

__all__ = [
    "AsyncSandbox", "AsyncSandboxPaginator", "AsyncSnapshotPaginator", "Sandbox", "SandboxInfo", "SandboxMetrics",
    "SandboxPaginator", "SandboxQuery", "SandboxState", "SnapshotInfo", "SnapshotPaginator", "instance_or_class",
]
