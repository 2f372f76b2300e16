"""bunshinfork for asyncio: AsyncWorkspace and AsyncSnapshot (workspace.py), their commands,
terminals and files (commands.py, files.py), on the init's asyncio client
(process/control_aio.py); what has no asynchronous primitive runs on one pool (pool.py)."""

from typing import Any

from ..watch import AsyncWatchHandle
from .commands import AsyncCommandHandle, AsyncCommandInputHandle, AsyncCommands, AsyncPty
from .files import AsyncFiles, AsyncFileStreamReader
from .workspace import AsyncSnapshot, AsyncWorkspace

__all__ = [
    "AsyncCommandHandle", "AsyncCommandInputHandle", "AsyncCommands", "AsyncFileStreamReader", "AsyncFiles",
    "AsyncPty", "AsyncSandbox", "AsyncSandboxPaginator", "AsyncSnapshot", "AsyncSnapshotPaginator",
    "AsyncWatchHandle", "AsyncWorkspace", "async_instance_or_class",
]

# E2B's AsyncSandbox lives in bunshinfork.e2b, which is built on this package: these names
# are still found here, read from there on first use.
_FROM_E2B = {"AsyncSandbox": "AsyncSandbox", "AsyncSandboxPaginator": "AsyncSandboxPaginator",
             "AsyncSnapshotPaginator": "AsyncSnapshotPaginator", "async_instance_or_class": "instance_or_class"}


def __getattr__(name: str) -> Any:
    if name in _FROM_E2B:
        from .. import e2b

        return getattr(e2b, _FROM_E2B[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
