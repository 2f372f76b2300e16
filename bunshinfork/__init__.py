"""bunshinfork: create, run commands in, and live-fork container workspaces."""

from .accounting import HostMemory
from .commands import CommandHandle, CommandResult
from .errors import (
    BunshinError,
    CgroupError,
    CommandError,
    CommandTimeout,
    CriuError,
    FileOperationError,
    ForkError,
    KernelFeatureError,
    NetworkError,
    PrivilegeError,
    RootfsError,
    SpecError,
    WorkspaceFileNotFound,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from .files import EntryInfo
from .fs import StorageWarning
from .fs import digest as rootfs_digest
from .spec import WorkspaceSpec
from .workspace import MemoryStats, Snapshot, Workspace, WorkspaceInfo, host_memory

__version__ = "0.1.0"

# E2B users know the sandbox as `Sandbox`.
Sandbox = Workspace

__all__ = [
    "BunshinError", "CgroupError", "CommandError", "CommandHandle", "CommandResult", "CommandTimeout",
    "CriuError", "EntryInfo", "FileOperationError", "ForkError", "HostMemory", "KernelFeatureError",
    "MemoryStats", "NetworkError", "PrivilegeError", "RootfsError", "Sandbox", "Snapshot", "SpecError",
    "StorageWarning", "Workspace", "WorkspaceFileNotFound", "WorkspaceInfo", "WorkspaceNotFound",
    "WorkspaceSpec", "WorkspaceStateError", "__version__", "host_memory", "rootfs_digest",
]
