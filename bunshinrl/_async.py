"""Running blocking bunshinfork calls from asyncio without starving the rollout."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

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
