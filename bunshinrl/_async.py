"""Blocking work from asyncio without starving the rollout, and asyncio work from synchronous
callers.

Workspace operations do not come here: the engine, the cache, the speculator and the verl
adapter call bunshinfork's AsyncWorkspace / AsyncSnapshot, whose commands run on the event loop
(and whose CRIU/mount work bunshinfork itself keeps off the loop). run_blocking is for what
remains synchronous by nature: users' sync callables (tools, task setup), a policy's model
call, a rootfs digest, the on-disk store."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

# asyncio.to_thread uses the loop's default executor, which holds min(32, cores + 4) threads:
# 6 on a 2-core host. A rollout keeps one blocking call (a tool, a fork, a snapshot) in flight
# per sample plus speculative and background work, so that pool would queue tool calls behind
# each other and turn idle waiting into latency. The calls mostly wait on the workspace, so a
# larger dedicated pool costs little CPU.
_POOL = ThreadPoolExecutor(max_workers=96, thread_name_prefix="bunshinrl")


async def run_blocking(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """asyncio.to_thread on a pool sized for rollouts (context variables travel along)."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return await loop.run_in_executor(_POOL, call)


async def call_sync_or_async(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`: awaited on the loop when it is a coroutine function (or returns an
    awaitable), else on the pool, since a user's sync callable may block on a workspace."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await run_blocking(fn, *args)
    return await out if inspect.isawaitable(out) else out


class LoopThread:
    """One event loop on a thread of its own, for synchronous callers that drive asyncio work
    (SkyRL calls env.step() inline or from its executor threads). One thread for the process,
    not one per call: every rollout it runs, and their background work (captures, speculative
    chains), lives on this loop."""

    def __init__(self, name: str = "bunshinrl-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (timeout: seconds, then TimeoutError)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run() called from its own loop: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()
