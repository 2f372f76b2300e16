"""Contract checks for adapter authors (as bunshinfork.testing.check_part is for bunshinfork's
parts): check_policy exercises a Policy through what the rollout asks of it and raises
ContractError, naming what is broken, where it breaks the contract."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence

from .policy import Action, FinalAnswer, Policy, SampleContext, Step, calls_of
from .signature import ToolCall


class ContractError(AssertionError):
    """An adapter's object breaks the contract bunshinrl relies on (the message says how)."""


def _check_action(owner: str, action: object) -> Action:
    try:
        calls_of(action)  # type: ignore[arg-type]
    except TypeError as e:
        raise ContractError(f"{owner}: act() must return a ToolCall, a non-empty tuple of ToolCalls or a "
                            f"FinalAnswer; it returned {action!r}") from e
    return action  # type: ignore[return-value]


async def check_policy_async(policy: Policy, ctx: SampleContext | None = None, history: Sequence[Step] = ()) -> None:
    """Raise ContractError where `policy` breaks the Policy contract: act is a coroutine
    function; it returns an Action, for an empty history and after a step; and it answers the
    same (ctx, history) with the same action however often it is asked, and whatever it was
    asked in between. The last is what a rewind relies on: a sample cut back to step j acts
    again from there, so a policy's randomness must be keyed by (sample, step), never drawn
    from one stream shared by every call (the engine's rewinds and its three configurations'
    identical rewards need it)."""
    owner = f"policy {type(policy).__name__}"
    if not isinstance(policy, Policy) or not inspect.iscoroutinefunction(policy.act):
        raise ContractError(f"{owner}: act(ctx, history) must be a coroutine function (bunshinrl.Policy)")
    ctx = ctx or SampleContext("check-policy", 0, 0)
    first = _check_action(owner, await policy.act(ctx, list(history)))
    calls = calls_of(first)
    step = Step(calls[0] if calls else ToolCall("check_policy_probe"), "an observation", len(history))
    later = [*history, step]
    _check_action(owner, await policy.act(ctx, later))
    other = SampleContext(ctx.task_id, ctx.sample + 1, ctx.epoch, ctx.prompt)
    _check_action(owner, await policy.act(other, list(history)))  # another sample asked in between
    again = await policy.act(ctx, list(history))
    if again != first:
        raise ContractError(f"{owner}: act() answered the same sample and history with {first!r}, then with "
                            f"{again!r}; key its randomness by (sample, step), not by how often it was asked")
    if isinstance(first, FinalAnswer) and not isinstance(first.text, str):
        raise ContractError(f"{owner}: a FinalAnswer's text must be a str, not {first.text!r}")


def check_policy(policy: Policy, ctx: SampleContext | None = None, history: Sequence[Step] = ()) -> None:
    """check_policy_async, from synchronous code (no event loop running)."""
    asyncio.run(check_policy_async(policy, ctx, history))


__all__ = ["ContractError", "check_policy", "check_policy_async"]
