"""AsyncSandbox: E2B's AsyncSandbox over an AsyncWorkspace."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from ..sandbox import (
    Sandbox,
    SandboxInfo,
    SandboxMetrics,
    SandboxPaginator,
    SandboxQuery,
    SnapshotInfo,
    SnapshotPaginator,
    instance_or_class,
)
from ..workspace import Workspace
from .pool import blocking
from .workspace import AsyncWorkspace


class async_instance_or_class:
    """instance_or_class for coroutine methods: `await sbx.kill()` or `await AsyncSandbox.kill(sandbox_id)`."""

    def __init__(self, method: Callable[..., Awaitable[Any]],
                 on_class: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.method = method
        self.on_class = on_class
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Awaitable[Any]]:
        method, on_class = self.method, self.on_class

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            if obj is not None:
                return await method(obj, *args, **kwargs)
            assert objtype is not None
            if args and isinstance(args[0], objtype):
                return await method(*args, **kwargs)
            if on_class is not None:
                return await on_class(objtype, *args, **kwargs)
            sandbox_id, *rest = args
            return await method(await objtype._attach(sandbox_id), *rest, **kwargs)

        return call


async def _kill_by_id(cls: type[AsyncSandbox], sandbox_id: str, **opts: Any) -> bool:
    return await blocking(Sandbox.kill, sandbox_id)


async def _connect_by_id(cls: type[AsyncSandbox], sandbox_id: str, timeout: int | None = None,
                         logger: logging.Logger | None = None, *,
                         on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> AsyncSandbox:
    sbx = await cls._attach(sandbox_id)
    sbx._sbx._logger = logger
    return await sbx.connect(timeout, on_resume=on_resume)


async def _fork_by_id(cls: type[AsyncSandbox], sandbox_id: str, timeout: int | None = None,
                      count: int | None = None, logger: logging.Logger | None = None,
                      **opts: Any) -> list[AsyncSandbox | Exception]:
    return await (await cls._attach(sandbox_id)).fork(timeout, count)


def _list_snapshots_all(cls: type[AsyncSandbox], sandbox_id: str | None = None, limit: int | None = None,
                        next_token: str | None = None, name: str | None = None, **opts: Any) -> AsyncSnapshotPaginator:
    return AsyncSnapshotPaginator(lambda: Sandbox.list_snapshots(sandbox_id, limit, next_token, name))


class AsyncSandboxPaginator:
    """E2B's async paginator: the listing happens in next_items(), in the default executor."""

    def __init__(self, make: Callable[[], SandboxPaginator | SnapshotPaginator]) -> None:
        self._make = make
        self._sync: SandboxPaginator | SnapshotPaginator | None = None

    @property
    def has_next(self) -> bool:
        return self._sync is None or self._sync.has_next

    @property
    def next_token(self) -> str | None:
        return None if self._sync is None else self._sync.next_token

    async def next_items(self, **opts: Any) -> list[SandboxInfo]:
        if self._sync is None:
            self._sync = await blocking(self._make)
        return self._sync.next_items()  # type: ignore[return-value]


class AsyncSnapshotPaginator(AsyncSandboxPaginator):
    async def next_items(self, **opts: Any) -> list[SnapshotInfo]:  # type: ignore[override]
        return await super().next_items()  # type: ignore[return-value]


class AsyncSandbox(AsyncWorkspace):
    """E2B's AsyncSandbox over a bunshin workspace (see Sandbox for what differs from Workspace)."""

    _sync_class = Sandbox
    default_sandbox_timeout = Sandbox.default_sandbox_timeout
    default_template = Sandbox.default_template

    def __init__(self, ws: Workspace) -> None:
        sbx = ws if isinstance(ws, Sandbox) else Sandbox._adopt(ws)
        super().__init__(sbx)
        self._sbx = sbx

    @classmethod
    async def _attach(cls, sandbox_id: str) -> AsyncSandbox:
        return cls(await blocking(Sandbox._attach, sandbox_id))

    @classmethod
    async def create(  # type: ignore[override]
        cls,
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
    ) -> AsyncSandbox:
        """Sandbox.create for asyncio."""
        sbx = await blocking(Sandbox.create, template, timeout, metadata, envs, secure,
                                      allow_internet_access, mcp, network, iam, lifecycle, volume_mounts, logger,
                                      idempotency_key, **opts)
        return cls(sbx)

    @property
    def sandbox_id(self) -> str:
        return self._sbx.sandbox_id

    async def is_running(self, request_timeout: float | None = None) -> bool:  # type: ignore[override]
        return self._sbx.is_running(request_timeout)

    async def get_info(self, **opts: Any) -> SandboxInfo:
        return await blocking(self._sbx.get_info)

    get_info = async_instance_or_class(get_info)  # type: ignore[assignment]

    async def get_metrics(self, start: Any = None, end: Any = None, **opts: Any) -> list[SandboxMetrics]:
        return await blocking(self._sbx.get_metrics, start, end)

    get_metrics = async_instance_or_class(get_metrics)  # type: ignore[assignment]

    @classmethod
    def list(cls, query: SandboxQuery | None = None, limit: int | None = None,  # type: ignore[override]
             next_token: str | None = None, order: Literal["asc", "desc"] | None = None,
             **opts: Any) -> AsyncSandboxPaginator:
        """A paginator whose next_items() lists the sandboxes (as E2B's, the call itself waits for nothing)."""
        return AsyncSandboxPaginator(lambda: Sandbox.list(query, limit, next_token, order))

    async def set_timeout(self, timeout: int, **opts: Any) -> None:  # type: ignore[override]
        await blocking(self._sbx.set_timeout, timeout)

    set_timeout = async_instance_or_class(set_timeout)  # type: ignore[assignment]

    async def connect(self, timeout: int | None = None, *,  # type: ignore[override]
                      on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> AsyncSandbox:
        await blocking(self._sbx.connect, timeout, on_resume=on_resume)
        return self

    connect = async_instance_or_class(connect, _connect_by_id)  # type: ignore[assignment]

    async def pause(self, keep_memory: bool | None = None, *,  # type: ignore[override]
                    mode: Literal["full", "filesystem"] | None = None, strict: bool = False, **opts: Any) -> bool:
        return await blocking(self._sbx.pause, keep_memory, mode=mode, strict=strict)

    pause = async_instance_or_class(pause)  # type: ignore[assignment]

    async def beta_pause(self, keep_memory: bool | None = None, *,
                         mode: Literal["full", "filesystem"] | None = None, **opts: Any) -> bool:
        return await self.pause(keep_memory, mode=mode)

    beta_pause = async_instance_or_class(beta_pause)  # type: ignore[assignment]

    async def kill(self, **opts: Any) -> bool:
        return await blocking(self._sbx.kill)

    kill = async_instance_or_class(kill, _kill_by_id)  # type: ignore[assignment]

    async def __aexit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        await self.kill()

    async def fork(self, timeout: int | None = None, count: int | None = None,  # type: ignore[override]
                   **opts: Any) -> list[AsyncSandbox | Exception]:
        out = await blocking(self._sbx.fork, timeout, count)
        return [r if isinstance(r, Exception) else type(self)(r) for r in out]

    fork = async_instance_or_class(fork, _fork_by_id)  # type: ignore[assignment]

    async def create_snapshot(self, name: str | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                              **opts: Any) -> SnapshotInfo:
        return await blocking(self._sbx.create_snapshot, name, mode=mode)

    create_snapshot = async_instance_or_class(create_snapshot)  # type: ignore[assignment]

    def list_snapshots(self, limit: int | None = None, next_token: str | None = None, name: str | None = None,
                       **opts: Any) -> AsyncSnapshotPaginator:
        return AsyncSnapshotPaginator(lambda: self._sbx.list_snapshots(limit, next_token, name))

    list_snapshots = instance_or_class(list_snapshots, _list_snapshots_all)  # type: ignore[assignment]

    @classmethod
    async def delete_snapshot(cls, snapshot_id: str, **opts: Any) -> bool:
        return await blocking(Sandbox.delete_snapshot, snapshot_id)

    def get_host(self, port: int) -> str:
        return self._sbx.get_host(port)

    async def destroy(self) -> None:
        await self.kill()

