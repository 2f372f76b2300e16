"""check_backend: exercise a StateBackend through what the prefix cache asks of it (for adapter
authors, as bunshinfork.testing.check_part is for bunshinfork's parts); ContractError names what
is broken."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from bunshinfork import AsyncWorkspace, Workspace

from .._async import run_blocking
from ..calls.contract import ContractError
from .backend import Persisted, StateBackend


async def _fork(owner: str, backend: StateBackend[Any], payload: Any) -> Workspace:
    out = backend.fork(payload)
    ws = await out if inspect.isawaitable(out) else out
    if not isinstance(ws, Workspace):
        raise ContractError(f"{owner}: fork() must return a bunshinfork Workspace (or an awaitable of one), "
                            f"not {ws!r}")
    if not await run_blocking(ws.is_running):
        await AsyncWorkspace(ws).destroy()
        raise ContractError(f"{owner}: fork() returned workspace {ws.id}, which is not running")
    return ws


def _size(owner: str, backend: StateBackend[Any], payload: Any) -> int:
    size = backend.size(payload)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ContractError(f"{owner}: size() must be a byte count >= 0 (eviction weighs it), not {size!r}")
    return size


async def check_backend_async(backend: StateBackend[Any], payload: Any) -> None:
    """Raise ContractError where `backend` breaks the StateBackend contract, exercised on
    `payload` (a resident state of it; the caller keeps it and releases it after): persists is a
    bool; size() a byte count; fork() a new running workspace each time, leaving the payload
    usable (the cache forks one state for every hit); and when it persists, persist() a Persisted
    whose ref load() reads back into a state that forks and is released. Every workspace it
    forks is destroyed."""
    owner = f"backend {type(backend).__name__}"
    if not isinstance(backend.persists, bool):
        raise ContractError(f"{owner}: persists must be a bool, not {backend.persists!r}")
    _size(owner, backend, payload)
    forks: list[Workspace] = []
    try:
        for _ in range(2):
            forks.append(await _fork(owner, backend, payload))
        if forks[0].id == forks[1].id:
            raise ContractError(f"{owner}: two fork()s of one state returned the same workspace {forks[0].id}")
        _size(owner, backend, payload)  # the payload outlives its forks
        if backend.persists:
            saved = await run_blocking(backend.persist, payload, None)
            if not isinstance(saved, Persisted) or not isinstance(saved.ref, str) or saved.stored_bytes < 0 \
                    or saved.logical_bytes < 0:
                raise ContractError(f"{owner}: persist() must return a Persisted(ref: str, byte counts >= 0), "
                                    f"not {saved!r}")
            loaded = await run_blocking(backend.load, saved.ref)
            try:
                _size(owner, backend, loaded)
                forks.append(await _fork(owner, backend, loaded))
            finally:
                await run_blocking(backend.release, loaded)
    finally:
        for ws in forks:
            await AsyncWorkspace(ws).destroy()


def check_backend(backend: StateBackend[Any], payload: Any) -> None:
    """check_backend_async, from synchronous code (no event loop running)."""
    asyncio.run(check_backend_async(backend, payload))


__all__ = ["ContractError", "check_backend", "check_backend_async"]
