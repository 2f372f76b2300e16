"""A sample's rollout on a Ray host, as the agent loop steps it (bunshinrl.rollout.agent_loop).

The driver keeps the sample's history, so a host that dies loses the workspace, not the
sample: `restart` places it on another live host, which issues its steps again from the
deepest prefix it holds, and the operation the death interrupted is issued there again. If a
step did not reproduce there, the history ends at it and the loop acts again from it
(Rewound), as after any rewind.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..calls.policy import SampleContext, Step
from ..calls.signature import ToolCall
from ..rollout.sample_state import Rewound

# Places the sample on another live host with its history issued again there; returns the
# new (host, rid) and updates the list to the steps as that host observed them.
Restart = Callable[[list[Step]], Awaitable[tuple[str, str]]]
Remote = Callable[..., Awaitable[Any]]


class RemoteSession:
    def __init__(self, ctx: SampleContext, host: str, rid: str, remote: Remote, restart: Restart,
                 host_died: Callable[[str, BaseException], bool]) -> None:
        self._ctx = ctx
        self.host, self.rid = host, rid
        self._remote = remote
        self._restart = restart
        self._host_died = host_died  # marks the host dead and says True when the error was a death
        self._history: list[Step] = []
        self._calls_left: int | None = None
        self._answer: str | None = None
        self._finished = False
        self.steps = 0  # calls that completed here (the cluster's step count)

    @property
    def ctx(self) -> SampleContext:
        return self._ctx

    @property
    def history(self) -> Sequence[Step]:
        return self._history

    @property
    def calls_left(self) -> int:
        assert self._calls_left is not None, "open() first"
        return self._calls_left

    def now(self) -> float:
        return time.monotonic()

    def reasoned(self, started: float) -> None:
        pass  # the sample's timeline lives on its host; the driver adds no event to it

    async def open(self) -> None:
        self._calls_left = await self._op("calls_left")

    async def call(self, call: ToolCall, decision: int) -> None:
        step, self._calls_left, rewound = await self._op("call", call, decision)
        if rewound is not None:
            self._rewind(rewound)
        self._history.append(step)
        self.steps += 1

    async def finish(self, answer: str | None) -> None:
        self._answer, self._finished = answer, False
        _reward, rewound = await self._op("finish", answer)
        if rewound is not None:
            self._rewind(rewound)
        self._finished = True

    async def close(self) -> Any:
        """The host's (timeline, served) of the finished sample."""
        return await self._op("close")

    def _rewind(self, history: list[Step]) -> None:
        """A served step did not reproduce: the host cut the history back to it, with what its
        call observed afresh; the policy acts again from there."""
        dropped = len(self._history) + 1 - len(history)
        self._history[:] = history
        raise Rewound(len(history) - 1, history[-1].observation if history else "", max(dropped, 0))

    async def _op(self, method: str, *args: Any) -> Any:
        """One remote operation, issued again on the host the sample restarts on if its host dies."""
        while True:
            try:
                return await self._remote(self.host, method, self.rid, *args)
            except Exception as e:
                if not self._host_died(self.host, e):
                    raise
            before = list(self._history)
            self.host, self.rid = await self._restart(self._history)  # issues the steps again there
            if self._history != before:  # a step did not reproduce on the new host
                self._calls_left = await self._remote(self.host, "calls_left", self.rid)
                self._finished = False
                raise Rewound(len(self._history) - 1, self._history[-1].observation if self._history else "",
                              len(before) - len(self._history) + 1)
            if method == "close" and self._finished:
                # The restarted rollout is not scored yet: score it before it closes.
                await self.finish(self._answer)
