"""Typed errors. Every failure a user can act on has its own class and a message that says what to do."""

from __future__ import annotations


class BunshinError(Exception):
    """Base class of every error raised by bunshinfork."""


# E2B's names for the same failures, so that code written against E2B catches them: every
# bunshinfork error is a SandboxException, as every E2B SDK error is one there.
SandboxException = BunshinError


class TimeoutException(BunshinError, TimeoutError):
    """An operation or a command ran past its timeout (E2B's TimeoutException)."""


class InvalidArgumentException(BunshinError, ValueError):
    """An argument is outside what the operation accepts (E2B's InvalidArgumentException)."""


class NotFoundException(BunshinError):
    """What the operation names does not exist (E2B's NotFoundException)."""


class SpecError(InvalidArgumentException):
    """The WorkspaceSpec is invalid (missing rootfs, bad limits, unknown network mode)."""


class RootfsError(BunshinError):
    """A root file system could not be prepared (missing directory, no Docker engine, debootstrap failed)."""


class PrivilegeError(BunshinError, PermissionError):
    """The caller lacks the privileges the runtime needs (root, CAP_SYS_ADMIN)."""


class KernelFeatureError(BunshinError):
    """A kernel feature the runtime needs is missing (namespaces, overlayfs, cgroups, btrfs)."""


class CriuError(BunshinError):
    """CRIU is missing, too old, or failed; the message carries the relevant part of its log."""


class DeadlineExceeded(BunshinError, TimeoutError):
    """An external call (CRIU, an injected syscall, a freeze) ran past its deadline and was stopped;
    the deadlines and how to change them are in bunshinfork.deadlines."""


class CriuTimeout(DeadlineExceeded, CriuError):
    """CRIU did not answer within the `criu` deadline and was killed."""


class WorkspaceNotFound(NotFoundException, LookupError):
    """No workspace with that id exists under the state directory (E2B's SandboxNotFoundException)."""


SandboxNotFoundException = WorkspaceNotFound


class WorkspaceStateError(BunshinError):
    """The workspace is in the wrong state for the operation (destroyed, paused, init gone)."""


class IllegalTransition(WorkspaceStateError):
    """A workspace record asked to move between states its lifecycle does not link
    (state.Status.TRANSITIONS), e.g. a destroyed workspace back to running."""


class CommandTimeout(TimeoutException):
    """A command ran longer than its timeout and was killed inside the workspace."""

    def __init__(self, message: str, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


class CommandError(BunshinError):
    """The workspace's init refused or could not start a command (bad cwd, missing executable)."""


class FileOperationError(BunshinError, OSError):
    """A file operation inside the workspace failed."""


class NetworkError(BunshinError):
    """Setting up or tearing down a workspace network failed."""


class CgroupError(BunshinError):
    """A cgroup could not be created, configured or removed."""


class ForkError(BunshinError):
    """A fork of a workspace failed; the source keeps running unchanged."""


class ForkTimeout(ForkError, DeadlineExceeded):
    """A fork ran past one of its deadlines; the source was thawed and keeps running unchanged."""


class WorkspaceFileNotFound(FileOperationError, NotFoundException, FileNotFoundError):
    """The path does not exist inside the workspace (E2B's FileNotFoundException)."""


FileNotFoundException = WorkspaceFileNotFound


class ImageError(RootfsError):
    """A container image could not be read, fetched or unpacked (bunshinfork.images)."""


class ImageReferenceError(ImageError, InvalidArgumentException):
    """An image reference ('docker:IMAGE', 'oci:DIR[:TAG]', 'registry:REF') is malformed."""


class EngineUnavailable(ImageError):
    """No Docker engine is reachable (or its SDK is missing) for a 'docker:IMAGE' rootfs."""


class ImageNotFound(ImageError, NotFoundException):
    """The engine, OCI layout or registry has no image by that reference."""


class CorruptLayer(ImageError):
    """A layer's content does not match its digest (or is not a readable tar): it is not stored."""


class UnsupportedMediaType(ImageError):
    """A manifest or layer has a media type bunshin cannot unpack (e.g. a foreign compression)."""


class UnsafeLayerEntry(ImageError):
    """A layer's tar entry would land outside the layer: '..', an absolute path, a link out of it,
    or a path through a symlink."""


class WarmTemplateError(BunshinError):
    """A warm template (bunshinfork.images.templates) could not be made, found or removed."""


class TemplateNotFound(WarmTemplateError, NotFoundException):
    """No template or saved snapshot by that name."""


class TemplateNotReady(WarmTemplateError, TimeoutException):
    """A template's ready command did not succeed within its timeout; nothing was kept."""


class HostError(BunshinError):
    """A host-wide operation (bunshinfork.hosts) was refused: teardown_host() on the machine's
    default host, whose state root every process without a named host shares."""


class HostInUse(HostError):
    """The host still holds workspaces (their state directories under its state root): its
    directories and cgroup parents stay until they are destroyed or reaped."""
