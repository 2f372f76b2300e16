"""One instance-or-class dispatcher for the sync and async sandboxes, as E2B's own
class_method_variant: `sandbox.kill()`, or `Sandbox.kill(sandbox_id)` on the class.

The wrapper itself is synchronous and returns what the method returns, so for a coroutine
method it returns the coroutine: one dispatcher serves both trees. On the class, the
first argument is a sandbox id: `on_class` handles the call where it differs (a missing id,
class-only parameters); otherwise the sandbox is attached to by `cls.from_id(id)` (awaited
first in the async tree) and the method called on it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


class instance_or_class:
    def __init__(self, method: Callable[..., Any], on_class: Callable[..., Any] | None = None) -> None:
        self.method = method
        self.on_class = on_class
        functools.update_wrapper(self, method)

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        method, on_class = self.method, self.on_class

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if obj is not None:
                return method(obj, *args, **kwargs)
            assert objtype is not None
            if args and isinstance(args[0], objtype):
                return method(*args, **kwargs)
            if on_class is not None:
                return on_class(objtype, *args, **kwargs)
            sandbox_id, *rest = args
            attached = objtype.from_id(sandbox_id)
            if inspect.isawaitable(attached):
                return _then(attached, method, rest, kwargs)
            return method(attached, *rest, **kwargs)

        return call


async def _then(attached: Any, method: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    return await method(await attached, *args, **kwargs)


def variant(on_class: Callable[..., Any] | None = None) -> Callable[[F], F]:
    """The decorator form: `@variant()` or `@variant(by_id)` above the instance method."""
    def wrap(method: F) -> F:
        return cast(F, instance_or_class(method, on_class))

    return wrap
