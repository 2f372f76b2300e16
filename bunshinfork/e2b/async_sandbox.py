"""AsyncSandbox: E2B's AsyncSandbox over a bunshin workspace (see sandbox.py for what differs
from Workspace). It has a Sandbox (`.sandbox`) for what runs on the pool, and serves its
workspace's commands, files and pty through aio's asyncio-native modules."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar

from ..aio.commands import AsyncCommands, AsyncPty
from ..aio.files import AsyncFiles
from ..aio.pool import blocking
from ..aio.workspace import AsyncWorkspace
from ..commands import E2B, Conventions
from ..workspace import Workspace
from .dispatch import variant
from .sandbox import Sandbox
from .types import Paginator, SandboxInfo, SandboxMetrics, SandboxQuery, SnapshotInfo

T = TypeVar("T")
S = TypeVar("S", bound="AsyncSandbox")


async def _kill_by_id(cls: type[AsyncSandbox], sandbox_id: str, **opts: Any) -> bool:
    return await blocking(Sandbox.kill, sandbox_id)


async def _connect_by_id(cls: type[S], sandbox_id: str, timeout: int | None = None,
                         logger: logging.Logger | None = None, *,
                         on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> S:
    sbx = await cls.from_id(sandbox_id, logger)
    return await sbx.connect(timeout, on_resume=on_resume)


async def _fork_by_id(cls: type[S], sandbox_id: str, timeout: int | None = None, count: int | None = None,
                      logger: logging.Logger | None = None, **opts: Any) -> list[S | Exception]:
    return await (await cls.from_id(sandbox_id, logger)).fork(timeout, count)


def _list_snapshots_all(cls: type[AsyncSandbox], sandbox_id: str | None = None, limit: int | None = None,
                        next_token: str | None = None, name: str | None = None, **opts: Any) -> AsyncSnapshotPaginator:
    return AsyncSnapshotPaginator(lambda: Sandbox.list_snapshots(sandbox_id, limit, next_token, name))


class AsyncPaginator(Generic[T]):
    """E2B's async paginator: the listing happens in next_items(), on the pool."""

    def __init__(self, make: Callable[[], Paginator[T]]) -> None:
        self._make = make
        self._sync: Paginator[T] | None = None

    @property
    def has_next(self) -> bool:
        return self._sync is None or self._sync.has_next

    @property
    def next_token(self) -> str | None:
        return None if self._sync is None else self._sync.next_token

    async def next_items(self, **opts: Any) -> list[T]:
        if self._sync is None:
            self._sync = await blocking(self._make)
        return self._sync.next_items()


class AsyncSandboxPaginator(AsyncPaginator[SandboxInfo]):
    pass


class AsyncSnapshotPaginator(AsyncPaginator[SnapshotInfo]):
    pass


class AsyncSandbox:
    """E2B's AsyncSandbox (see the module's docstring)."""

    conventions: Conventions = E2B
    default_sandbox_timeout = Sandbox.default_sandbox_timeout
    default_template = Sandbox.default_template

    def __init__(self, sbx: Sandbox | Workspace) -> None:
        self._sbx = sbx if isinstance(sbx, Sandbox) else Sandbox(sbx)
        self._aws = AsyncWorkspace(self._sbx.workspace)

    @classmethod
    async def from_id(cls: type[S], sandbox_id: str, logger: logging.Logger | None = None) -> S:
        """Attach to the running sandbox `sandbox_id` (as it is: connect() also resumes it)."""
        return cls(await blocking(Sandbox.from_id, sandbox_id, logger))

    @property
    def sandbox(self) -> Sandbox:
        """The synchronous sandbox behind this one."""
        return self._sbx

    @property
    def workspace(self) -> Workspace:
        """The workspace behind the sandbox."""
        return self._sbx.workspace

    def _async(self) -> AsyncWorkspace:
        # The Sandbox attaches anew to a workspace another process paused or resumed.
        if self._aws.workspace is not self._sbx.workspace:
            self._aws = AsyncWorkspace(self._sbx.workspace)
        return self._aws

    @property
    def commands(self) -> AsyncCommands:
        return self._async().commands

    @property
    def files(self) -> AsyncFiles:
        return self._async().files

    @property
    def pty(self) -> AsyncPty:
        return self._async().pty

    @classmethod
    async def create(
        cls: type[S],
        template: str | None = None,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        secure: bool | None = None,
        allow_internet_access: bool | None = None,
        mcp: dict[str, Any] | None = None,
        network: dict[str, Any] | None = None,
        iam: dict[str, Any] | None = None,
        lifecycle: dict[str, Any] | None = None,
        volume_mounts: dict[str, Any] | None = None,
        logger: logging.Logger | None = None,
        idempotency_key: str | None = None,
        **opts: Any,
    ) -> S:
        """Sandbox.create for asyncio."""
        sbx = await blocking(Sandbox.create, template, timeout, metadata, envs, secure, allow_internet_access, mcp,
                             network, iam, lifecycle, volume_mounts, logger, idempotency_key, **opts)
        return cls(sbx)

    @property
    def sandbox_id(self) -> str:
        return self._sbx.sandbox_id

    async def is_running(self, request_timeout: float | None = None) -> bool:
        return self._sbx.is_running(request_timeout)

    @variant()
    async def get_info(self, **opts: Any) -> SandboxInfo:
        return await blocking(self._sbx.get_info)

    @variant()
    async def get_metrics(self, start: Any = None, end: Any = None, **opts: Any) -> list[SandboxMetrics]:
        return await blocking(self._sbx.get_metrics, start, end)

    @classmethod
    def list(cls, query: SandboxQuery | None = None, limit: int | None = None, next_token: str | None = None,
             order: Literal["asc", "desc"] | None = None, **opts: Any) -> AsyncSandboxPaginator:
        """A paginator whose next_items() lists the sandboxes (as E2B's, the call itself waits for nothing)."""
        return AsyncSandboxPaginator(lambda: Sandbox.list(query, limit, next_token, order))

    @variant()
    async def set_timeout(self, timeout: int, **opts: Any) -> None:
        await blocking(self._sbx.set_timeout, timeout)

    @variant(_connect_by_id)
    async def connect(self: S, timeout: int | None = None, *, on_resume: Literal["restore", "reboot"] = "restore",
                      **opts: Any) -> S:
        await blocking(self._sbx.connect, timeout, on_resume=on_resume)
        return self

    @variant()
    async def pause(self, keep_memory: bool | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                    strict: bool = False, **opts: Any) -> bool:
        return await blocking(self._sbx.pause, keep_memory, mode=mode, strict=strict)

    @variant()
    async def beta_pause(self, keep_memory: bool | None = None, *,
                         mode: Literal["full", "filesystem"] | None = None, **opts: Any) -> bool:
        return await self.pause(keep_memory, mode=mode)

    @variant(_kill_by_id)
    async def kill(self, **opts: Any) -> bool:
        return await blocking(self._sbx.kill)

    async def __aenter__(self: S) -> S:
        return self

    async def __aexit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        await self.kill()

    @variant()
    async def update_network(self, network: dict[str, Any], **opts: Any) -> None:
        await blocking(self._sbx.update_network, network)

    @variant(_fork_by_id)
    async def fork(self: S, timeout: int | None = None, count: int | None = None,
                   **opts: Any) -> list[S | Exception]:
        out = await blocking(self._sbx.fork, timeout, count)
        return [r if isinstance(r, Exception) else type(self)(r) for r in out]

    @variant()
    async def create_snapshot(self, name: str | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                              **opts: Any) -> SnapshotInfo:
        return await blocking(self._sbx.create_snapshot, name, mode=mode)

    @variant(_list_snapshots_all)
    def list_snapshots(self, limit: int | None = None, next_token: str | None = None, name: str | None = None,
                       **opts: Any) -> AsyncSnapshotPaginator:
        return AsyncSnapshotPaginator(lambda: self._sbx.list_snapshots(limit, next_token, name))

    @classmethod
    async def delete_snapshot(cls, snapshot_id: str, **opts: Any) -> bool:
        return await blocking(Sandbox.delete_snapshot, snapshot_id)

    def get_host(self, port: int) -> str:
        return self._sbx.get_host(port)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.sandbox_id}>"
