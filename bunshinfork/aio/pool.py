"""The one executor of the asyncio tree, for what has no asynchronous primitive.

CRIU is driven over its RPC socket and the fork pipeline's mounts, cgroups and page-table
work are synchronous system calls interleaved with it, so create, snapshot, fork and
destroy (and file reads and writes) run here; commands, stdin and watches do not.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# The loop's default executor holds min(32, cores + 4) threads, 6 on a 2-core host: a rollout
# keeps a fork, a snapshot or a destroy in flight per sample, and those calls mostly wait (on
# CRIU, on the kernel), so they would queue behind each other there.
POOL = ThreadPoolExecutor(max_workers=96, thread_name_prefix="bunshinfork-aio")


async def blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the pool (context variables travel along, as with
    asyncio.to_thread)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(POOL, call)
