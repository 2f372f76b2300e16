"""bunshinfork: create, run commands in, and live-fork container workspaces."""

from . import deadlines
from .commands import CommandHandle, CommandResult
from .errors import (
    BunshinError,
    CgroupError,
    CommandError,
    CommandTimeout,
    CriuError,
    CriuTimeout,
    DeadlineExceeded,
    FileOperationError,
    ForkError,
    ForkTimeout,
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
from .fs import digest as rootfs_digest
from .spec import WorkspaceSpec
from .workspace import MemoryStats, Snapshot, Workspace, WorkspaceInfo

__version__ = "0.1.0"

# E2B users know the sandbox as `Sandbox`.
Sandbox = Workspace

__all__ = [
    "BunshinError", "CgroupError", "CommandError", "CommandHandle", "CommandResult", "CommandTimeout",
    "CriuError", "CriuTimeout", "DeadlineExceeded", "EntryInfo", "FileOperationError", "ForkError",
    "ForkTimeout", "KernelFeatureError", "MemoryStats",
    "NetworkError", "PrivilegeError", "RootfsError", "Sandbox", "Snapshot", "SpecError", "Workspace",
    "WorkspaceFileNotFound", "WorkspaceInfo", "WorkspaceNotFound", "WorkspaceSpec", "WorkspaceStateError",
    "__version__", "deadlines", "rootfs_digest",
]
