"""bunshinfork: create, run commands in, and live-fork container workspaces.

Two front doors over one core: Workspace (bunshin's semantics: root, no lifetime unless
asked, fork(count)) and Sandbox (E2B's: a 300 s lifetime, the user "user", a login shell,
CommandExitException, fork(timeout, count)), each with an asyncio twin (AsyncWorkspace,
AsyncSandbox).
"""

__version__ = "0.1.0"

from . import deadlines
from .accounting import HostMemory
from .aio import AsyncCommandHandle, AsyncSnapshot, AsyncWatchHandle, AsyncWorkspace
from .commands import (
    CommandExitException,
    CommandHandle,
    CommandResult,
    ProcessInfo,
    PtySize,
)
from .e2b import (
    AsyncSandbox,
    Sandbox,
    SandboxInfo,
    SandboxMetrics,
    SandboxPaginator,
    SandboxQuery,
    SandboxState,
    SnapshotInfo,
    SnapshotPaginator,
)
from .errors import (
    BunshinError,
    CgroupError,
    CommandError,
    CommandTimeout,
    CriuError,
    CriuTimeout,
    DeadlineExceeded,
    FileNotFoundException,
    FileOperationError,
    ForkError,
    ForkTimeout,
    HostError,
    HostInUse,
    InvalidArgumentException,
    KernelFeatureError,
    NetworkError,
    NotFoundException,
    PrivilegeError,
    RootfsError,
    SandboxException,
    SandboxNotFoundException,
    SpecError,
    TimeoutException,
    WorkspaceFileNotFound,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from .files import EntryInfo, FileType, WriteInfo
from .fs import StorageWarning
from .fs import digest as rootfs_digest
from .host import HostConfig
from .hosts import current_host, reap_orphans, teardown_host  # this host; a named host's teardown
from .network.policy import EgressPolicy
from .network.policy import from_e2b as egress_from_e2b  # E2B's network={...} as a policy
from .spec import WorkspaceSpec
from .watch import FilesystemEvent, FilesystemEventType, WatchHandle
from .workspace import MemoryStats, Snapshot, Workspace, WorkspaceInfo, host_memory

__all__ = [
    "AsyncCommandHandle", "AsyncSandbox", "AsyncSnapshot", "AsyncWatchHandle", "AsyncWorkspace", "BunshinError",
    "CgroupError",
    "CommandError", "CommandExitException", "CommandHandle", "CommandResult", "CommandTimeout", "CriuError",
    "CriuTimeout", "DeadlineExceeded", "EgressPolicy", "EntryInfo", "FileNotFoundException", "FileOperationError",
    "FileType", "FilesystemEvent", "FilesystemEventType", "ForkError", "ForkTimeout", "HostConfig", "HostError",
    "HostInUse", "HostMemory",
    "InvalidArgumentException", "KernelFeatureError", "MemoryStats", "NetworkError", "NotFoundException",
    "PrivilegeError", "ProcessInfo", "PtySize", "RootfsError", "Sandbox", "SandboxException", "SandboxInfo",
    "SandboxMetrics", "SandboxNotFoundException", "SandboxPaginator", "SandboxQuery", "SandboxState",
    "Snapshot", "SnapshotInfo", "SnapshotPaginator", "SpecError", "StorageWarning", "TimeoutException",
    "WatchHandle", "Workspace", "WorkspaceFileNotFound", "WorkspaceInfo", "WorkspaceNotFound",
    "WorkspaceSpec", "WorkspaceStateError", "WriteInfo", "__version__", "current_host", "deadlines", "egress_from_e2b",
    "host_memory", "reap_orphans", "rootfs_digest", "teardown_host",
]
