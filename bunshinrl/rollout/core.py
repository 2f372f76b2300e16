"""The rollout core: one sample's tool calls, one at a time, over the prefix cache and speculation.

Every driver shares it: RolloutEngine (our own GRPO loop), verl's agent loop and SkyRL's env.
A driver starts a Rollout for a sample, calls `await rollout.call(tool_call)` for each tool call
its model makes, `await rollout.finish(answer)` when the model is done (the task's verifier then
runs on the state the trajectory built) and `await rollout.close()`.

Where a sample's state lives is explicit (Rollout.state):

    Idle         no workspace of its own: its state is the prefix-cache node it stands on
                 (a shadow may be rebuilding that state ahead of an expected miss)
    Live         a workspace in the state after the last call
    Settling     that workspace is being captured for the cache and/or handed to a speculative
                 branch, while the policy reasons; the next call waits for it
    Speculating  a speculative branch owns the workspace and runs predicted calls
    Closed

and `Rollout.node` is its position in the prefix tree (None once it has left the tree). A call
is served, in order, by a speculative branch that predicted exactly it (adopted), by the prefix
cache (skipped: the recorded observation, the sample moves to the child node and drops its
workspace), or run for real from the state of the last call served (a miss: the branch is rolled
back, or the cached state is materialised by a fork, a disk load or a replay).

The critical path (paper Fig. 3, adapted to engines whose capture is not free):
- A sample served from the cache keeps a warm workspace behind it: the workspace it held is
  brought to the new state in the background while the policy reasons (the skipped call
  replayed on it, or a fork of the state when that is cheaper), so a later miss adopts it
  without a fork on its path. Every sample's root state is prefetched the same way, as Base
  overlaps its group's fork with the first reasoning step.
- A state is captured after its call only when the reasoning step that follows is predicted to
  outlast the capture (RolloutCore.reasoning, ToolPrefixCache.capture_seconds) and another
  sample is expected to come by (an off-tree straggler's states are not captured unless the
  selector predicts the call); a second visitor's warm workspace captures a state that was not.
  A misprediction is paid as post_wait on the sample's path.
- When a cached path ends (the node has no children: the next call is likely a miss) and the
  selector predicts a chain, the chain is speculated on the warm workspace.

The invariant: a sample's workspace is exactly the history it was shown. A warm workspace whose
replay diverged is destroyed (Diverged), never adopted nor speculated on; the next call rebuilds
the state from the deepest captured state on the sample's path, replaying and comparing every
served observation, and a step that does not reproduce rewinds the sample to it (Rewound).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NoReturn

from bunshinfork import AsyncWorkspace, Workspace, rootfs_digest

from .._async import call_sync_or_async, run_blocking
from ..calls.guard import DeterminismGuard
from ..calls.policy import SampleContext, Step
from ..calls.signature import ToolCall, template_digest
from ..calls.task import REWARD_TOOL, Task, parse_reward
from ..calls.tools import Tool, ToolSet
from ..prefix.cache import ReplayDiverged, ToolPrefixCache
from ..prefix.tree import Node
from ..speculation.selector import SelectorContext, SelectorReport, Trajectory, train_selector
from ..speculation.speculator import SpecHit, SpeculativeBranch, Speculator
from ..speculation.tail import TailPolicy
from ..states.backend import SharedSnapshot
from ..states.metrics import WorkspaceRegistry
from .reasoning import ReasoningClock
from .timeline import SampleTimeline

# ---- where a sample's state lives ----


@dataclass
class Idle:
    shadow: asyncio.Task[Workspace] | None = None


@dataclass
class Live:
    ws: Workspace


@dataclass
class Settling:
    ws: Workspace | None  # None: the sample's first fork (or its warm workspace) is still under way
    task: asyncio.Future[Live | Speculating | Idle]  # Idle: the warm workspace was lost
    kind: str = "post_wait"  # what a wait for it is counted as on the sample's path


@dataclass
class Speculating:
    branch: SpeculativeBranch


@dataclass
class Closed:
    pass


State = Idle | Live | Settling | Speculating | Closed


class Diverged(Exception):
    """A warm workspace's replay observed something else than the sample was shown; the
    workspace was destroyed (it is never adopted), and the next call rebuilds a verified one."""


class Rewound(RuntimeError):
    """A step served to this sample (`step`, counted from 0) did not reproduce: replayed from
    the deepest captured state on the sample's path, its call observed `observation` instead.
    The rollout's history is cut back to that step with the fresh observation and its workspace
    is in the state after it; the driver's policy acts again on `rollout.history` (the call that
    raised this did not run). A driver that cannot cut its conversation back (Rollout.rewinds
    False) gets the trajectory refused: every later call fails and nothing is scored."""

    def __init__(self, step: int, observation: str, dropped: int) -> None:
        super().__init__(f"step {step} did not reproduce on replay: history cut back ({dropped} steps dropped)")
        self.step = step
        self.observation = observation
        self.dropped = dropped


@dataclass
class _Group:
    """Base (no cache): the samples of a group fork one snapshot of the task's initialized workspace."""

    snapshot: Future[SharedSnapshot] = field(default_factory=Future)
    members: int = 0


class RolloutCore:
    """What every rollout driver shares: the prefix cache, the speculator, the determinism guard,
    the tail policy and the memory engine; the workspaces alive right now (memory sampling),
    background work, and every finished trajectory (the selector's training data).

    cache=None and speculator=None is plain memory sharing (Base). prefetch: warm workspaces
    behind cache hits and the root prefetched (see the module doc); reasoning: what predicts the
    next reasoning step (default: the steps seen). Build one with bunshinrl.rollout.wiring.build_core.
    """

    def __init__(self, *, cache: ToolPrefixCache | None = None, speculator: Speculator | None = None,
                 guard: DeterminismGuard | None = None, tail: TailPolicy | None = None, memory: str = "auto",
                 prefetch: bool = True, keep_initial: bool = False, overlap_fork: bool = False,
                 reasoning: ReasoningClock | None = None, critical_path_captures: bool = True) -> None:
        self.cache = cache
        self.reasoning = reasoning or ReasoningClock()
        # False: the cache's policy alone decides a capture, whatever the reasoning step or the
        # revisits expected (the Ray hosts: replication ships the states captured).
        self.critical_path_captures = critical_path_captures
        self.speculator = speculator
        self.guard = guard or (cache.guard if cache is not None else None) or DeterminismGuard()
        if cache is not None and cache.guard is not self.guard:
            raise ValueError("the cache and the core must share one DeterminismGuard")
        if speculator is not None:
            speculator.guard = self.guard
            if tail is None:
                tail = speculator.tail
            speculator.tail = tail
        self.tail = tail or TailPolicy()
        self.memory = memory
        self.prefetch = prefetch
        # Without a cache: keep_initial keeps each task's initialized snapshot from one group to
        # the next (as the cache keeps its root) until close(); overlap_fork starts a group's fork
        # and returns its rollouts at once, so the fork runs while the first step is reasoned (as
        # the cache's prefetch of a fresh root does).
        self.keep_initial = keep_initial
        self.overlap_fork = overlap_fork
        self._initial: dict[tuple[str, str], Future[SharedSnapshot]] = {}
        self.history: list[Trajectory] = []
        self.workspaces = WorkspaceRegistry()
        self._lock = threading.Lock()
        self._bg: set[asyncio.Future[Any]] = set()
        self._digests: dict[str, Future[str]] = {}
        self._roots: dict[tuple[str, str], Future[Node]] = {}
        self._groups: dict[tuple[str, str], _Group] = {}
        self._counters = {"rollouts": 0, "forks": 0}
        self._snapshot_s: dict[str, float] = {}  # per task: a snapshot's measured seconds (EWMA)

    # ---- starting samples ----

    async def digest(self, task: Task) -> str:
        """The template digest of the task's initialized workspace (rootfs digest + fingerprint)."""
        rootfs = str(task.spec.get("rootfs", "host"))
        digest = await self._once(self._digests, rootfs, lambda: run_blocking(rootfs_digest, rootfs))
        return template_digest(digest, task.fingerprint)

    async def _once(self, table: dict[Any, Future[Any]], key: Any, make: Callable[[], Awaitable[Any]]) -> Any:
        """table[key]'s value, made by the first caller however many ask at the same time (a
        failure is not kept: the next caller tries again)."""
        with self._lock:
            fut = table.get(key)
            mine = fut is None
            if mine:
                fut = table[key] = Future()
        assert fut is not None
        if mine:
            try:
                fut.set_result(await make())
            except BaseException as e:
                with self._lock:
                    table.pop(key, None)
                fut.set_exception(e)
        return await asyncio.wrap_future(fut)

    async def _initial_snapshot(self, task: Task) -> SharedSnapshot:
        ws = self.workspaces.add((await AsyncWorkspace.create(**task.spec)).workspace)
        try:
            await call_sync_or_async(task.setup, ws)
            return await SharedSnapshot.take_async(ws, self.memory)
        finally:
            await self._destroy(ws)

    async def _group_snapshot(self, task: Task) -> SharedSnapshot:
        """A reference to the snapshot a group forks: the kept one (keep_initial), made once
        however many groups ask at the same time, or a fresh one. The caller releases it."""
        if not self.keep_initial:
            return await self._initial_snapshot(task)
        key = (task.id, await self.digest(task))
        snap: SharedSnapshot = await self._once(self._initial, key, lambda: self._initial_snapshot(task))
        return snap.acquire()

    def kept_snapshots(self) -> list[SharedSnapshot]:
        """The initialized snapshots keep_initial holds now."""
        with self._lock:
            futs = list(self._initial.values())
        return [f.result() for f in futs if f.done() and f.exception() is None]

    async def _fork_group(self, task: Task, n: int) -> list[Workspace]:
        snap = await self._group_snapshot(task)
        try:
            clones = await snap.fork_many_async(n)
        finally:
            await snap.release_async()
        if any(isinstance(c, Exception) for c in clones):
            for c in clones:
                if isinstance(c, Workspace):
                    await AsyncWorkspace(c).destroy()
            raise next(c for c in clones if isinstance(c, Exception))
        return [self.workspaces.add(w) for w in clones]  # type: ignore[arg-type]

    async def _root(self, task: Task) -> Node:
        """The cache's root for the task's initialized workspace, made once however many samples
        ask at the same time."""
        assert self.cache is not None
        digest = await self.digest(task)
        root = self.cache.root(task.id, digest)
        if root is not None:
            return root
        key = (task.id, digest)
        with self._lock:
            fut = self._roots.get(key)
            mine = fut is None
            if mine:
                fut = self._roots[key] = Future()
        assert fut is not None
        if mine:
            try:
                fut.set_result(self.cache.add_root(task.id, digest, await self._initial_snapshot(task)))
            except BaseException as e:
                fut.set_exception(e)
            finally:
                with self._lock:
                    self._roots.pop(key, None)
        return await asyncio.wrap_future(fut)

    def _timeline(self, ctx: SampleContext, origin: float) -> SampleTimeline:
        return SampleTimeline(ctx.task_id, ctx.sample, ctx.epoch, started=time.monotonic() - origin)

    async def start_group(self, task: Task, contexts: Sequence[SampleContext],
                          origin: float | None = None) -> list[Rollout]:
        """The rollouts of one GRPO group, all from one initialized workspace: with a cache they
        stand on its root state and fork only at their first miss; without, they are forked from
        one snapshot of it, all at once."""
        origin = time.monotonic() if origin is None else origin
        timelines = [self._timeline(c, origin) for c in contexts]
        t0 = time.monotonic() - origin
        if self.cache is not None:
            root = await self._root(task)
            out = [Rollout(self, task, c, tl, origin, root, None) for c, tl in zip(contexts, timelines, strict=True)]
        elif self.overlap_fork:
            forking = asyncio.ensure_future(self._fork_group(task, len(contexts)))
            out = [Rollout(self, task, c, tl, origin, None, None) for c, tl in zip(contexts, timelines, strict=True)]
            for i, r in enumerate(out):
                r.state = Settling(None, asyncio.ensure_future(r._forked(forking, i)))
        else:
            clones = await self._fork_group(task, len(contexts))
            out = [Rollout(self, task, c, tl, origin, None, w)
                   for c, tl, w in zip(contexts, timelines, clones, strict=True)]
        for r in out:
            if isinstance(r.state, Live):
                await r._note_fork(r.state.ws)
            r.timeline.add("setup", t0, r.now())
        return out

    async def start(self, task: Task, ctx: SampleContext, *, group: str | None = None,
                    origin: float | None = None, rewinds: bool = False) -> Rollout:
        """One sample's rollout, for drivers that see samples one by one (verl, SkyRL). Samples
        started with the same `group` key (verl's uid) while another member is still open fork
        one snapshot of the task's initialized workspace; with a cache every sample of the task
        stands on the cache's root state. rewinds: whether the driver acts again on a history cut
        back by Rewound (see Rollout.rewinds)."""
        origin = time.monotonic() if origin is None else origin
        tl = self._timeline(ctx, origin)
        t0 = time.monotonic() - origin
        if self.cache is not None:
            r = Rollout(self, task, ctx, tl, origin, await self._root(task), None)
        else:
            key = (task.id, group if group is not None else f"{ctx.epoch}/{ctx.task_id}/{ctx.sample}")
            with self._lock:
                g = self._groups.get(key)
                mine = g is None
                if g is None:
                    g = self._groups[key] = _Group()
                g.members += 1
            try:
                if mine:
                    try:
                        g.snapshot.set_result(await self._initial_snapshot(task))
                    except BaseException as e:
                        g.snapshot.set_exception(e)
                snap = await asyncio.wrap_future(g.snapshot)
                ws = self.workspaces.add(await snap.fork_async())
            except BaseException:
                self._leave(key)
                raise
            r = Rollout(self, task, ctx, tl, origin, None, ws, group=key)
            await r._note_fork(ws)
        r.timeline.add("setup", t0, r.now())
        r.rewinds = rewinds
        return r

    def _leave(self, key: tuple[str, str]) -> None:
        with self._lock:
            g = self._groups.get(key)
            if g is None:
                return
            g.members -= 1
            if g.members > 0:
                return
            del self._groups[key]
        if g.snapshot.done() and g.snapshot.exception() is None:
            self._background(g.snapshot.result().release_async())

    # ---- what every rollout reports back ----

    def _record(self, r: Rollout) -> None:
        tl = r.timeline
        with self._lock:
            self.history.append(Trajectory(tl.epoch, tl.task_id, tl.sample, tuple(s.call for s in tl.steps),
                                           tl.answer is not None))
            self._counters["rollouts"] += 1
        self.tail.record_rollout(tl.task_id, tl.sample, tl.finished - tl.started)

    def fit_selector(self, held_out_epochs: Sequence[int] = ()) -> SelectorReport | None:
        """Train the speculator's selector on every recorded trajectory."""
        if self.speculator is None or not self.history:
            return None
        with self._lock:
            history = sorted(self.history, key=lambda t: (t.epoch, t.task_id, t.sample))
        sel, report = train_selector(history, held_out_epochs=held_out_epochs)
        self.speculator.selector = sel
        return report

    def stats(self) -> dict[str, Any]:
        return {"cache": self.cache.stats() if self.cache is not None else None,
                "speculation": dict(self.speculator.stats) if self.speculator is not None else None,
                "guard": self.guard.report()}

    def all_workspaces(self) -> list[Workspace]:
        """Every workspace the core holds now, speculative forks included (memory sampling)."""
        return self.workspaces.snapshot() + (self.speculator.workspaces.snapshot() if self.speculator else [])

    def note_snapshot(self, task_id: str, seconds: float) -> None:
        """How long a snapshot of one of the task's workspaces took (a capture or speculation's)."""
        with self._lock:
            old = self._snapshot_s.get(task_id, seconds)
            self._snapshot_s[task_id] = 0.7 * old + 0.3 * seconds

    def snapshot_estimate(self, task_id: str) -> float | None:
        with self._lock:
            return self._snapshot_s.get(task_id)

    def worth_a_snapshot(self, task_id: str) -> bool:
        """Whether a snapshot started now is predicted to finish within the reasoning step: a
        speculative chain that needs one is not started otherwise (it would be waited for).
        Only with a model of the server (ReasoningClock(model=...)): the steps seen are a low
        quantile, meant for captures, and would stop most speculation on short steps."""
        if self.reasoning.model is None:
            return True
        predicted, snap = self.reasoning.predict(), self.snapshot_estimate(task_id)
        ok = predicted is None or snap is None or snap <= predicted
        if not ok and self.speculator is not None:
            self.speculator.stats["declined_off_path"] = self.speculator.stats.get("declined_off_path", 0) + 1
        return ok

    # ---- background work ----

    def _background(self, aw: Any) -> asyncio.Future[Any]:
        fut = asyncio.ensure_future(aw)
        self._bg.add(fut)
        fut.add_done_callback(self._bg.discard)
        return fut

    async def _destroy(self, ws: Workspace) -> None:
        self.workspaces.discard(ws)
        await AsyncWorkspace(ws).destroy()

    async def drain(self) -> None:
        """Wait for every background capture, teardown and persist."""
        await self.drain_rollouts()
        if self.cache is not None:
            await run_blocking(self.cache.drain)

    async def drain_rollouts(self) -> None:
        """Wait for the rollouts' background work (captures, teardowns, discarded branches), not
        for the cache's persistence."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)
        if self.speculator is not None:
            await self.speculator.drain()

    def start_persistence(self) -> Future[float] | None:
        """Start the cache's deferred persists (the gap between epochs); a future of the seconds
        they took, None without a cache."""
        if self.cache is None:
            return None
        cache = self.cache
        fut: Future[float] = Future()

        def work() -> None:
            t = time.monotonic()
            try:
                cache.drain()
            finally:
                fut.set_result(time.monotonic() - t)

        threading.Thread(target=work, name="bunshinrl-persist-epoch", daemon=True).start()
        return fut

    async def close(self) -> None:
        """Drain, then release the initialized snapshots keep_initial kept."""
        await self.drain()
        with self._lock:
            futs, self._initial = list(self._initial.values()), {}
        for f in futs:
            if f.done() and f.exception() is None:
                await f.result().release_async()


class Rollout:
    """One sample's rollout on the core, stepped one tool call at a time (see the module doc).

    Calls run in the order they are issued, one at a time, whatever the driver awaits
    concurrently (verl gathers a turn's parallel tool calls). history: the calls and what they
    observed; reward: the verifier's score after finish().
    """

    def __init__(self, core: RolloutCore, task: Task, ctx: SampleContext, timeline: SampleTimeline,
                 origin: float, node: Node | None, ws: Workspace | None,
                 group: tuple[str, str] | None = None) -> None:
        self.core = core
        self.task = task
        self.ctx = ctx
        self.timeline = timeline
        self.tools: ToolSet = task.engine_tools
        self.origin = origin
        self.node = node
        self.state: State = Live(ws) if ws is not None else Idle()
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
        self.served: list[str] = []
        self._served = ""
        self.branches: list[SpeculativeBranch] = []
        self.reward: float | None = None
        self.verdict: str | None = None
        # The workspace the snapshot this sample first forked was taken from (its group's
        # initialized workspace, or a cached state's source); None until it forks.
        self.forked_from: str | None = None
        self._group = group
        self._lock: asyncio.Lock | None = None
        self._returned: float | None = None  # when the last call returned (reasoning steps)
        self._decision: int | None = None
        if isinstance(self.state, Idle) and core.prefetch and core.cache is not None and node is not None:
            # The root is always prefetched, as Base forks its group while the first step is reasoned.
            self.state.shadow = asyncio.ensure_future(self._rebuild(node))

    def now(self) -> float:
        return time.monotonic() - self.origin

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
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
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
        With a verifier, the task's reward is read from the state the trajectory built."""
        self.timeline.answer = answer
        if self.task.verify is None or self.refused:
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

    async def close(self) -> None:
        """Release everything the sample holds; the trajectory is recorded."""
        if self.closed:
            return
        self.timeline.finished = self.now()
        with contextlib.suppress(Exception):
            await self._settle()
        st = self.state
        self.state = Closed()
        if isinstance(st, Speculating):
            with contextlib.suppress(Exception):
                await self.core._destroy(await st.branch.close())
        elif isinstance(st, Idle):
            self._discard_shadow(st.shadow)
        elif isinstance(st, Live):
            self.core._background(self.core._destroy(st.ws))
        if self._group is not None:
            self.core._leave(self._group)
            self._group = None
        self.core._record(self)

    async def _forked(self, forking: asyncio.Future[list[Workspace]], i: int) -> Live:
        ws = (await forking)[i]
        await self._note_fork(ws)
        return Live(ws)

    async def _note_fork(self, ws: Workspace) -> None:
        if self.forked_from is None:
            self.forked_from = (await AsyncWorkspace(ws).info()).parent

    # ---- one step ----

    async def _settle(self) -> None:
        if isinstance(self.state, Settling):
            t, kind = self.now(), self.state.kind
            self.state = await self.state.task
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
            ws = self.core.workspaces.add(await st.branch.close())
            self.state = Live(ws)
            self.timeline.add("spec_miss", t, self.now(), detail)
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

    def _move_to(self, call: ToolCall, child: Node) -> None:
        """The sample moves to a cached state. Without prefetch its workspace goes; with it, the
        workspace is kept warm: brought to the child's state in the background (a replay of the
        skipped call, or a fork of the child's state when that is cheaper), and at the tree's
        frontier a predicted chain is speculated on it."""
        st, self.node = self.state, child
        cache = self.core.cache
        assert cache is not None
        if not self.core.prefetch:
            if isinstance(st, Speculating):
                self.core._background(self._close_and_destroy(st.branch))
            elif isinstance(st, Live):
                self.core._background(self.core._destroy(st.ws))
            elif isinstance(st, Idle):
                self._discard_shadow(st.shadow)
            self.state = Idle()
            return
        prev: asyncio.Future[Workspace] | None = None
        if isinstance(st, Live):
            prev = asyncio.get_running_loop().create_future()
            prev.set_result(st.ws)
        elif isinstance(st, Speculating):
            prev = asyncio.ensure_future(self._close_branch(st.branch))
        elif isinstance(st, Idle):
            prev = st.shadow
        try:
            plan_s = cache.plan(child).seconds + cache.fork_seconds
        except LookupError:
            plan_s = float("inf")
        if prev is not None and child.exec_seconds <= plan_s:
            warm = asyncio.ensure_future(self._extend_shadow(prev, child))
        else:
            self._discard_shadow(prev)
            warm = asyncio.ensure_future(self._rebuild(child))
        self.state = Idle(warm)
        if self.core.speculator is not None and not child.children:
            chain = self.core.speculator.predict(self.task.id, self.ctx.sample, [h.call for h in self.history] + [call],
                                                 self.tools, real_calls=self.timeline.count("tool"))
            if chain and self.core.worth_a_snapshot(self.task.id):
                self.state = Settling(None, asyncio.ensure_future(self._speculate_on(warm, chain)), "materialize")

    async def _close_branch(self, branch: SpeculativeBranch) -> Workspace:
        return self.core.workspaces.add(await branch.close())

    async def _speculate_on(self, warm: asyncio.Future[Workspace], chain: list[ToolCall]) -> Live | Speculating | Idle:
        """Speculation at the tree's frontier: the chain runs on the sample's warm workspace.
        Nothing speculates on a workspace whose replay diverged: it is gone, and the next call
        rebuilds and verifies the sample's state (Idle without a shadow)."""
        try:
            ws = await warm
        except Diverged:
            return Idle()
        except Exception as e:
            self.timeline.errors.append(f"prefetch failed: {e!r}")
            return Idle()
        await self._note_fork(ws)
        assert self.core.speculator is not None
        try:
            branch = await self.core.speculator.launch(ws, chain, self.tools)
        except Exception as e:
            self.timeline.errors.append(f"speculation not started: {e!r}")
            return Live(ws)
        self.branches.append(branch)
        self.core.workspaces.discard(ws)  # held by the branch now
        return Speculating(branch)

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

    async def _materialize(self, st: Idle) -> None:
        """A workspace in the state of the sample's history. The warm one when its replays all
        matched; otherwise (a replay diverged: that workspace is gone) one rebuilt from the deepest
        captured state on the sample's path, every served observation replayed and compared. A
        step that does not reproduce rewinds the sample to it (Rewound)."""
        tl = self.timeline
        t = self.now()
        assert self.core.cache is not None and self.node is not None
        ws: Workspace | None = None
        diverged = False
        if st.shadow is not None:
            try:
                ws = await st.shadow
            except Diverged:
                diverged = True
            except Exception as e:
                tl.errors.append(f"prefetch failed: {e!r}")
        if ws is None:
            ws = await self._verified_rebuild(t if diverged else None)
        if self.node is not None and self.node.removed:
            self.node = None  # verified, but nothing is recorded under a dropped subtree
        self.state = Live(self.core.workspaces.add(ws))
        await self._note_fork(ws)
        tl.add("materialize", t, self.now())

    async def _verified_rebuild(self, since: float | None) -> Workspace:
        """The sample's state, forked from the deepest captured state on its path with the calls
        below it replayed and compared (since: when a divergence sent us here, for its cost)."""
        cache = self.core.cache
        assert cache is not None and self.node is not None
        try:
            ws = await cache.materialize(self.node, self.tools)
        except ReplayDiverged as e:
            self.timeline.divergences += 1
            await self._rewind(e)
        if since is not None:
            self.timeline.divergence_seconds += self.now() - since
        return ws

    async def _rewind(self, e: ReplayDiverged) -> NoReturn:
        """Step j (the one that moved the sample to the node whose replay diverged) did not
        reproduce: the history is cut back to j with the fresh observation, the workspace (in the
        state after that fresh call) is the sample's, off the tree, and Rewound tells the driver."""
        ws = self.core.workspaces.add(e.workspace)
        j = next((i for i, n in enumerate(self._nodes) if n is e.node and e.node is not None), None)
        if j is None or e.fresh is None:
            await self.core._destroy(ws)
            raise RuntimeError(f"a replay diverged off this sample's path: {e}") from e
        self.state = Live(ws)
        self.node = None
        await self._note_fork(ws)
        dropped = len(self.history) - j
        self.timeline.rewound += 1
        self.timeline.rewound_steps += dropped
        self.timeline.rewound_seconds += self.now() - self._started[j]
        fresh = Step(self.history[j].call, e.fresh, self.history[j].decision)
        self.history[j:] = [fresh]
        self.served[j:] = ["executed"]
        self._nodes[j:] = [None]
        self._started[j:] = [self._started[j]]
        self.timeline.steps[j:] = [fresh]
        self.timeline.errors.append(f"rewound to step {j}: {e}")
        self.refused = not self.rewinds
        raise Rewound(j, e.fresh, dropped)

    async def _execute(self, call: ToolCall, tool: Tool, reusable: bool) -> str:
        tl, core = self.timeline, self.core
        assert isinstance(self.state, Live)
        node, created = None, False
        if core.cache is not None and self.node is not None and reusable:
            # Another sample may have created this node meanwhile: this sample runs the call
            # itself and stands on that node only if it observes what the node recorded.
            node, created = core.cache.begin(self.node, call)
        t = self.now()
        try:
            obs = await tool.run(self.state.ws, call.args)
        except Exception as e:
            if created:
                core.cache.abandon(node, e)  # type: ignore[union-attr,arg-type]
            tl.add("tool", t, self.now(), call.key)
            self.node = None
            return f"[error] {type(e).__name__}: {e}"
        took = self.now() - t
        tl.add("tool", t, t + took, call.key)
        core.tail.record_call(call, took)
        capture = created and core.cache.complete(  # type: ignore[union-attr]
            node, obs, took, **self._capture_context(node))  # type: ignore[arg-type]
        if node is not None and not created:
            node = await self._same_as_sibling(call, node, obs)
        self.node = node
        self._after_real_call(call, node if capture else None)
        return obs

    async def _same_as_sibling(self, call: ToolCall, node: Node, observation: str) -> Node | None:
        """`node`, created by another sample for the call this sample ran itself, when its
        recorded observation is the one this sample was shown; None (off the tree) otherwise,
        the tool then marked non-deterministic."""
        try:
            recorded = await asyncio.wrap_future(node.result)  # the creator may still be running it
        except Exception:
            return None  # its call failed: nothing recorded to stand on
        if self.core.guard.check(call, recorded, observation, source="sibling"):
            return node
        self.timeline.divergences += 1
        return None

    def _capture_context(self, node: Node) -> dict[str, Any]:
        """What the cache weighs a capture of `node` with: the next step's predicted reasoning and
        whether another sample is expected there."""
        if not self.core.critical_path_captures:
            return {"reasoning": None, "revisit": True}
        return {"reasoning": self.core.reasoning.predict(), "revisit": self._revisit_expected(node)}

    def _revisit_expected(self, node: Node) -> bool:
        """Will another sample come by `node`? Yes below the root and where its parent had a
        visitor besides its creator; on a path only this sample took (an off-tree straggler),
        only when the selector predicts the call from the parent's state."""
        parent = node.parent
        if parent is None or parent.parent is None or parent.hits > 0:
            return True
        spec = self.core.speculator
        sel = spec.selector if spec is not None else None
        if sel is None or not hasattr(sel, "classes_") or node.call is None:
            return False
        calls = tuple(h.call for h in self.history if h.call.name != REWARD_TOOL)
        top = sel.top_k(SelectorContext(self.task.id, calls), 1)
        return bool(top) and top[0][0] == node.call.key and top[0][1] >= 0.5

    def _after_real_call(self, call: ToolCall, capture: Node | None) -> None:
        """Capture the new state for the cache and/or start speculating, while the policy reasons."""
        core = self.core
        assert isinstance(self.state, Live)
        calls = [h.call for h in self.history] + [call]
        chain = core.speculator.predict(self.task.id, self.ctx.sample, calls, self.tools,
                                        real_calls=self.timeline.count("tool")) if core.speculator else []
        if chain and not core.worth_a_snapshot(self.task.id):
            chain = []
        if capture is None and not chain:
            return
        ws = self.state.ws
        self.state = Settling(ws, asyncio.ensure_future(self._post_call(ws, capture, chain)))

    async def _post_call(self, ws: Workspace, capture: Node | None, chain: list[ToolCall]) -> Live | Speculating:
        core = self.core
        try:
            t = time.monotonic()
            snap = await SharedSnapshot.take_async(ws, core.memory)
            core.note_snapshot(self.task.id, time.monotonic() - t)
            if capture is not None and core.cache is not None:
                core.cache.note_capture(time.monotonic() - t, self.task.id)
        except Exception as e:
            self.timeline.errors.append(f"capture failed: {e!r}")
            if capture is not None and core.cache is not None:
                core.cache.attach(capture, None)
            return Live(ws)
        try:
            if capture is not None and core.cache is not None:
                core.cache.attach(capture, snap.acquire())
            if chain and core.speculator is not None:
                try:
                    branch = await core.speculator.launch(ws, chain, self.tools, snapshot=snap)
                except Exception as e:
                    self.timeline.errors.append(f"speculation not started: {e!r}")
                    return Live(ws)
                self.branches.append(branch)
                core.workspaces.discard(ws)  # held by the branch now
                return Speculating(branch)
            return Live(ws)
        finally:
            await snap.release_async()

    async def _adopt(self, call: ToolCall, hit: SpecHit) -> None:
        """The sample moves to the speculative state; the cache learns the call like a real one."""
        core = self.core
        assert isinstance(self.state, Speculating)
        branch = self.state.branch
        capture = None
        if core.cache is not None and self.node is not None:
            node: Node | None
            node, created = core.cache.begin(self.node, call)
            if created and core.cache.complete(node, hit.observation, hit.exec_seconds,
                                               **self._capture_context(node)):
                if branch.exhausted:
                    capture = node  # captured below, from the adopted workspace
                else:
                    # The chain runs on; the checkpoint taken after this call is the node's state.
                    core._background(self._attach_checkpoint(node, branch, hit.index))
            if not created:
                node = await self._same_as_sibling(call, node, hit.observation)
            self.node = node
        if branch.exhausted:
            self.state = Live(core.workspaces.add(await branch.close()))
            self._after_real_call(call, capture)

    async def _attach_checkpoint(self, node: Node, branch: SpeculativeBranch, index: int) -> None:
        assert self.core.cache is not None
        self.core.cache.attach(node, await branch.state_after(index))

    async def _close_and_destroy(self, branch: SpeculativeBranch) -> None:
        await self.core._destroy(await branch.close())

    # ---- rebuilding cached states ahead of a miss ----

    async def _rebuild(self, node: Node) -> Workspace:
        assert self.core.cache is not None
        t = time.monotonic()
        try:
            ws = self.core.workspaces.add(await self.core.cache.materialize(node, self.tools))
        except ReplayDiverged as e:
            await self._lose_diverged(e)
        await self._capture_for_second_visitor(ws, node, t)
        return ws

    async def _extend_shadow(self, previous: asyncio.Future[Workspace], node: Node) -> Workspace:
        """The warm workspace brought from the previous shadow's state to `node`'s by replaying
        its call. A previous shadow that diverged or failed left no workspace: its error is
        passed on and nothing is replayed."""
        t = time.monotonic()
        ws = await previous
        assert self.core.cache is not None
        try:
            await self.core.cache.replay(ws, node, self.tools)
        except ReplayDiverged as e:
            await self._lose_diverged(e)
        except BaseException:
            await self.core._destroy(ws)
            raise
        await self._capture_for_second_visitor(ws, node, t)
        return ws

    async def _lose_diverged(self, e: ReplayDiverged) -> NoReturn:
        """A warm workspace's replay diverged: it is destroyed, never adopted (Diverged)."""
        self.timeline.divergences += 1
        self.timeline.errors.append(str(e))
        await self.core._destroy(self.core.workspaces.add(e.workspace))
        raise Diverged(str(e)) from None

    async def _capture_for_second_visitor(self, ws: Workspace, node: Node, since: float) -> None:
        """This warm workspace is a second visitor's copy of `node`'s state: capture it when the
        cache wants it and what is left of the reasoning step is predicted to outlast a capture."""
        cache = self.core.cache
        assert cache is not None
        predicted = self.core.reasoning.predict()
        left = None if predicted is None else predicted - (time.monotonic() - since)
        if node.parent is None or not cache.claim_capture(node, left):
            return
        try:
            t = time.monotonic()
            snap = await SharedSnapshot.take_async(ws, self.core.memory)
            self.core.note_snapshot(self.task.id, time.monotonic() - t)
            cache.note_capture(time.monotonic() - t, self.task.id)
        except Exception as e:
            self.timeline.errors.append(f"capture failed: {e!r}")
            cache.attach(node, None)
            return
        try:
            cache.attach(node, snap.acquire())
        finally:
            await snap.release_async()

    def _discard_shadow(self, shadow: asyncio.Task[Workspace] | None) -> None:
        if shadow is None:
            return

        async def discard() -> None:
            try:
                ws = await shadow
            except Exception:
                return  # a diverged or failed shadow left no workspace
            await self.core._destroy(ws)

        self.core._background(discard())


__all__ = ["Closed", "Diverged", "Idle", "Live", "Rewound", "Rollout", "RolloutCore", "Settling", "Speculating",
           "State"]
