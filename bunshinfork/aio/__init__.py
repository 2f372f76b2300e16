"""bunshinfork for asyncio: AsyncWorkspace and AsyncSnapshot (workspace.py), their commands,
terminals and files (commands.py, files.py), on the init's asyncio client
(process/control_aio.py); what has no asynchronous primitive runs on one pool (pool.py)."""

from ..watch import AsyncWatchHandle
from .commands import AsyncCommandHandle, AsyncCommandInputHandle, AsyncCommands, AsyncPty
from .files import AsyncFiles, AsyncFileStreamReader
from .sandbox import AsyncSandbox, AsyncSandboxPaginator, AsyncSnapshotPaginator, async_instance_or_class
from .workspace import AsyncSnapshot, AsyncWorkspace

__all__ = [
    "AsyncCommandHandle", "AsyncCommandInputHandle", "AsyncCommands", "AsyncFileStreamReader", "AsyncFiles",
    "AsyncPty", "AsyncSandbox", "AsyncSandboxPaginator", "AsyncSnapshot", "AsyncSnapshotPaginator",
    "AsyncWatchHandle", "AsyncWorkspace", "async_instance_or_class",
]
