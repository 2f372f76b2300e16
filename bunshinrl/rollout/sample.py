"""Rollout: one sample's tool calls, one at a time, over the prefix cache and speculation (see
bunshinrl.rollout.core for the whole picture). This module sequences a step: a speculative branch
that predicted the call, the prefix cache, or a real execution; warm workspaces, rewinds,
captures and speculation are its mixins."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from bunshinfork import AsyncWorkspace, Workspace

from ..calls.policy import SampleContext, Step
from ..calls.signature import ToolCall
from ..calls.task import REWARD_TOOL, Task, parse_reward
from ..calls.tools import Tool, ToolSet
from ..prefix.recording import Recording
from ..prefix.tree import Node
from ..speculation.speculator import SpeculativeBranch
from .captures import Captures
from .rewind import Rewinding
from .sample_state import Closed, Idle, Live, Settling, Speculating, State, transition
from .services import SampleServices
from .speculating import SpeculationGlue
from .timeline import SampleTimeline
from .warm import WarmWorkspaces


class Rollout(WarmWorkspaces, Rewinding, Captures, SpeculationGlue):
    """One sample's rollout on the core, stepped one tool call at a time (see the module doc).

    Calls run in the order they are issued, one at a time, whatever the driver awaits
    concurrently (verl gathers a turn's parallel tool calls). history: the calls and what they
    observed; reward: the verifier's score after finish().
    """

    def __init__(self, core: SampleServices, task: Task, ctx: SampleContext, timeline: SampleTimeline,
                 origin: float, node: Node | None, ws: Workspace | None, *,
                 forking: Awaitable[Workspace] | None = None,
                 on_close: Callable[[Rollout], None] | None = None) -> None:
        """forking: the sample's first workspace while it is still being forked (ws None);
        on_close: what the core does with the closed rollout (its group left, its trajectory
        recorded)."""
        self.core = core
        self.task = task
        self.ctx = ctx
        self.timeline = timeline
        self.tools: ToolSet = task.engine_tools
        self.origin = origin
        self.node = node
        self._state: State | None = None
        self.history: list[Step] = []
        # Whether the driver acts again on a history cut back by Rewound (RolloutEngine, the Ray
        # cluster). A driver that cannot (its model's conversation goes on) gets the trajectory
        # refused instead: after a rewind every call fails and finish() scores nothing.
        self.rewinds = True
        self.refused = False
        # Per step, the prefix-tree node it moved the sample to (None: off the tree), so that a
        # replay diverging at a node names the step to rewind to.
        self._nodes: list[Node | None] = []
        # Per step, when its call started (a rewind's cost: the time of the steps it drops).
        self._started: list[float] = []
        # Per step, what served it: "speculation" (adopted), "cache" (skipped), "executed", or
        # "rejected" (an unknown tool or arguments that do not fit: nothing ran).
        self.served: list[str] = timeline.served  # one list: a rewind cuts both
        self._served = ""
        self.branches: list[SpeculativeBranch] = []
        self.reward: float | None = None
        self.verdict: str | None = None
        # The workspace the snapshot this sample first forked was taken from (its group's
        # initialized workspace, or a cached state's source); None until it forks.
        self.forked_from: str | None = None
        self._on_close = on_close
        self._lock: asyncio.Lock | None = None
        self._returned: float | None = None  # when the last call returned (reasoning steps)
        self._shadow_replays = 0  # calls the warm workspace replays beyond one the sample held
        self._decision: int | None = None
        if ws is not None:
            self._enter(Live(ws))
        elif forking is not None:
            self._enter(Settling(None, asyncio.ensure_future(self._forked(forking))))
        elif core.prefetch and core.cache is not None and node is not None:
            # The root is always prefetched, as Base forks its group while the first step is reasoned.
            self._enter(Idle(asyncio.ensure_future(self._rebuild(node))))
        else:
            self._enter(Idle())

    @property
    def state(self) -> State:
        """Where the sample's state lives (bunshinrl.rollout.sample_state)."""
        assert self._state is not None
        return self._state

    def _enter(self, new: State) -> None:
        """Move the sample's state along an edge of its state machine (the only assignment)."""
        self._state = transition(self._state, new)

    def now(self) -> float:
        return time.monotonic() - self.origin

    def reasoned(self, started: float) -> None:
        """The driver's policy reasoned from `started` (now()) until now: the timeline's event."""
        self.timeline.add("reason", started, self.now())

    @property
    def calls_left(self) -> int:
        """Tool calls the agent may still make within the task's budget."""
        return max(0, self.task.budget - sum(s.call.name != REWARD_TOOL for s in self.history))

    @property
    def closed(self) -> bool:
        return isinstance(self.state, Closed)

    @property
    def wasted_seconds(self) -> float:
        """Speculative execution this sample discarded (final once the core has drained)."""
        return sum(b.wasted_seconds for b in self.branches)

    # ---- the driver's calls ----

    async def call(self, call: ToolCall, decision: int | None = None) -> str:
        """Run one tool call and return its observation. decision: the history length when the
        model made the decision issuing it (parallel calls share one); default: now."""
        if self._returned is not None and (decision is None or decision != self._decision):
            self.core.reasoning.note(time.monotonic() - self._returned)
        self._decision = decision
        async with self._locked():
            if self.closed:
                raise RuntimeError(f"rollout {self.ctx.task_id}/{self.ctx.sample} is closed")
            if self.refused:
                raise RuntimeError(f"rollout {self.ctx.task_id}/{self.ctx.sample} is refused: a step it was served "
                                   "did not reproduce, and its driver cannot rewind")
            self._served = "executed"
            started = self.now()
            step = Step(call, await self._step(call), len(self.history) if decision is None else decision)
            self.history.append(step)
            self.served.append(self._served)
            self._nodes.append(self.node)
            self._started.append(started)
            self.timeline.steps.append(step)
            self._returned = time.monotonic()
            return step.observation

    async def finish(self, answer: str | None = None) -> float | None:
        """The agent is done (answer: its final text; None when its budget ended the episode).
        The replays behind the cache hits the sample was served are awaited first: a served step
        that does not reproduce rewinds it (Rewound), and the driver acts again or re-rolls.
        With a verifier, the task's reward is read from the state the trajectory built."""
        self.timeline.answer = answer
        if self.refused:
            return None
        # Nothing is finalised on an unverified state: the replays behind the hits this sample
        # was served are awaited, and one that does not reproduce rewinds it (Rewound) here.
        async with self._locked():
            if not self.closed:
                await self._settle()
                await self._verify_served()
        if self.task.verify is None:
            return None
        obs = await self.call(ToolCall(REWARD_TOOL))
        try:
            self.reward = parse_reward(obs)
        except ValueError as e:
            self.timeline.errors.append(str(e))  # the verifier itself failed
            return None
        self.verdict = obs.partition("\n")[2]
        self.timeline.reward = self.reward
        return self.reward

    def _locked(self) -> asyncio.Lock:
        """The lock a step holds: one step of the sample at a time."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def close(self) -> None:
        """Release everything the sample holds; the trajectory is recorded."""
        if self.closed:
            return
        self.timeline.finished = self.now()
        with contextlib.suppress(Exception):
            await self._settle()
        st = self.state
        self._enter(Closed())
        self.timeline.settle_divergences("unresolved")  # a destroyed warm workspace never verified
        if isinstance(st, Speculating):
            with contextlib.suppress(Exception):
                await self.core.destroy(await st.branch.close())
        elif isinstance(st, Idle):
            self._discard_shadow(st.shadow)
        elif isinstance(st, Live):
            self.core.background(self.core.destroy(st.ws))
        if self._on_close is not None:
            self._on_close(self)

    async def _forked(self, forking: Awaitable[Workspace]) -> Live | Speculating:
        """The sample's first workspace, forked while its first step is reasoned; the first calls
        the selector predicts start on it at once when the speculator's gate admits them (the
        first step is as long as any, and a slow first call, a test suite, is on every path)."""
        ws = await forking
        await self.note_fork(ws)
        chain = self.core.speculation_chain(self.task.id, self.ctx.sample, [], self.tools, real_calls=0)
        if chain:
            return await self._post_call(ws, None, chain)
        return Live(ws)

    async def note_fork(self, ws: Workspace) -> None:
        """Note which workspace the snapshot of the sample's first fork came from (forked_from)."""
        if self.forked_from is None:
            self.forked_from = (await AsyncWorkspace(ws).info()).parent

    # ---- one step ----

    async def _settle(self) -> None:
        if isinstance(self.state, Settling):
            t, kind = self.now(), self.state.kind
            self._enter(await self.state.task)
            if self.now() - t > 0.001:
                self.timeline.add(kind, t, self.now())

    async def _step(self, call: ToolCall) -> str:
        tl, core = self.timeline, self.core
        await self._settle()
        tool = self.tools.get(call.name)
        if tool is None:
            self._served = "rejected"
            return f"[error] unknown tool {call.name!r}; available: {', '.join(sorted(self.task.agent_tools))}"
        problem = tool.check(call.args)
        if problem is not None:
            self._served = "rejected"
            return f"[error] {problem}"  # nothing ran: the state is unchanged
        reusable = core.guard.reusable(tool)

        # 1. A speculative branch that predicted exactly this call.
        if isinstance(self.state, Speculating) and reusable:
            t = self.now()
            hit = await self.state.branch.resolve(call)
            if hit is not None:
                tl.add("spec_hit", t, self.now(), call.key)
                core.tail.record_call(call, hit.exec_seconds)
                await self._adopt(call, hit)
                self._served = "speculation"
                return hit.observation

        # 2. The prefix cache.
        if core.cache is not None and self.node is not None and reusable:
            child = core.cache.lookup(self.node, call, tool)
            if child is not None:
                served = await self._serve_from_cache(call, tool, child)
                if served is not None:
                    return served

        # 3. A miss: run it for real, from the state of the last call served.
        await self._workspace(call.key)
        return await self._execute(call, tool, reusable)

    async def _workspace(self, detail: str = "") -> Workspace:
        """A workspace in the state after the last call: the speculative branch rolled back, or
        the cached state materialised."""
        st = self.state
        if isinstance(st, Speculating):
            t = self.now()
            b = st.branch
            # What the chain had next, beside the call that did not meet it (a profile's question).
            predicted = b.calls[b.adopted].key if b.adopted < len(b.calls) else "the chain's end"
            ws = self.core.workspaces.add(await b.close())
            self._enter(Live(ws))
            self.timeline.add("spec_miss", t, self.now(), f"{detail} (predicted {predicted})")
            self.core.note_spec_miss(self.task.id, self.now() - t)
        elif isinstance(st, Idle):
            await self._materialize(st)
        assert isinstance(self.state, Live)
        return self.state.ws

    async def _serve_from_cache(self, call: ToolCall, tool: Tool, child: Node) -> str | None:
        t = self.now()
        running = not child.result.done()
        try:
            obs = await asyncio.wrap_future(child.result)  # another sample may still be running it
        except Exception:
            return None  # that execution failed; run it ourselves
        if self.core.guard.should_audit():
            return await self._audit(call, tool, child, obs)
        # Waiting for a sibling's call still running skipped no work of this sample's own: it is
        # counted apart from the hits that did (and not toward the hit rate).
        self.timeline.add("sibling_wait" if running else "cache_hit", t, self.now(), call.key)
        self._served = "cache"
        self._move_to(call, child)
        return obs

    async def _audit(self, call: ToolCall, tool: Tool, child: Node, recorded: str) -> str:
        """Re-execute a hit from its parent state; the policy gets the fresh observation."""
        t = self.now()
        ws = await self._workspace(call.key)
        fresh = await tool.run(ws, call.args)
        self.timeline.add("audit", t, self.now(), call.key)
        # Equal: this workspace is now in the child's state. Different: the tool is marked
        # non-deterministic (the cache drops its subtrees) and this sample leaves the tree.
        self.node = child if self.core.guard.check(call, recorded, fresh, source="audit") else None
        self._after_real_call(call, None)
        return fresh

    async def _execute(self, call: ToolCall, tool: Tool, reusable: bool) -> str:
        tl, core = self.timeline, self.core
        assert isinstance(self.state, Live)
        rec: Recording | None = None
        if core.cache is not None and self.node is not None and reusable:
            # Another sample may have created this node meanwhile: this sample runs the call
            # itself and stands on that node only if it observes what the node recorded.
            rec = core.cache.begin(self.node, call)
        t = self.now()
        try:
            obs = await tool.run(self.state.ws, call.args)
        except Exception as e:
            if rec is not None:
                rec.abandon(e)
            tl.add("tool", t, self.now(), call.key)
            self.node = None
            return f"[error] {type(e).__name__}: {e}"
        took = self.now() - t
        tl.add("tool", t, t + took, call.key)
        core.tail.record_call(call, took)
        if rec is None:
            self.node = None
            self._after_real_call(call, None)
        elif rec.created:
            capture = rec.complete(obs, took, **self._capture_context(rec.node))
            self.node = rec.node
            self._after_real_call(call, rec if capture else None)
        else:
            self.node = await self._same_as_sibling(call, rec.node, obs)
            self._after_real_call(call, None)
        return obs

    async def _same_as_sibling(self, call: ToolCall, node: Node, observation: str,
                               speculation: bool = False) -> Node | None:
        """`node`, created by another sample for the call this sample ran itself, when its
        recorded observation is the one this sample was shown; None (off the tree) otherwise,
        the tool then marked non-deterministic."""
        try:
            recorded = await asyncio.wrap_future(node.result)  # the creator may still be running it
        except Exception:
            return None  # its call failed: nothing recorded to stand on
        if call.name in self.task.agent_tools:  # the verifier's call is checked too, but it is no agent's
            self.timeline.sibling_checks += 1
            self.timeline.speculation_checks += speculation
        if self.core.guard.check(call, recorded, observation, source="sibling"):
            return node
        # The sample keeps what it ran (its history is its own execution): the node is refused.
        self.timeline.diverged(sibling_race=True, speculation=speculation, outcome="node_refused")
        return None
