"""RolloutEngine: an asyncio rollout of N tasks x G samples over forked workspaces.

Every group starts from one initialized workspace: plain forks of it (memory sharing), or, with a
prefix cache, the cached root state that samples fork lazily, only once their calls leave what
the cache already knows. Background work (capturing states for the cache, speculative chains,
rebuilding cached states) runs while the policy reasons, so it stays off the critical path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bunshinfork import Workspace, rootfs_digest

from ._async import run_blocking
from .backend import SharedSnapshot
from .cache import ReplayDiverged, ToolPrefixCache
from .guard import DeterminismGuard
from .metrics import MemorySampler, WorkspaceRegistry
from .policy import FinalAnswer, Policy, SampleContext, Step, Task
from .selector import SelectorReport, Trajectory, train_selector
from .signature import ToolCall, template_digest
from .speculator import SpeculativeBranch, Speculator
from .tail import TailPolicy
from .timeline import EpochResult, SampleTimeline
from .tools import Tool, ToolSet
from .tree import Node


@dataclass
class _Sample:
    ctx: SampleContext
    tools: ToolSet
    timeline: SampleTimeline
    ws: Workspace | None = None
    node: Node | None = None  # position in the prefix tree; None once off it
    branch: SpeculativeBranch | None = None
    shadow: asyncio.Task[Workspace] | None = None  # the state of `node`, being rebuilt ahead of a miss
    post: asyncio.Task[None] | None = None  # capture and speculation after the last real call
    history: list[Step] = field(default_factory=list)
    branches: list[SpeculativeBranch] = field(default_factory=list)


class RolloutEngine:
    """Runs GRPO groups with any combination of prefix caching and speculation.

    cache=None and speculator=None is plain memory sharing (Base). The engine records every
    trajectory (`history`) and tool timing (`tail`), which train the speculator's selector.
    """

    def __init__(self, policy: Policy, *, cache: ToolPrefixCache | None = None,
                 speculator: Speculator | None = None, guard: DeterminismGuard | None = None,
                 tail: TailPolicy | None = None, memory: str = "auto", max_steps: int = 32,
                 memory_interval: float = 0.25, prefetch: bool = True) -> None:
        self.policy = policy
        self.cache = cache
        self.speculator = speculator
        self.guard = guard or (cache.guard if cache is not None else None) or DeterminismGuard()
        if cache is not None and cache.guard is not self.guard:
            raise ValueError("the cache and the engine must share one DeterminismGuard")
        if speculator is not None:
            speculator.guard = self.guard
            if tail is None:
                tail = speculator.tail
            speculator.tail = tail
        self.tail = tail or TailPolicy()
        self.memory = memory
        self.max_steps = max_steps
        self.memory_interval = memory_interval
        self.prefetch = prefetch
        self.history: list[Trajectory] = []
        self._live = WorkspaceRegistry()
        self._bg: set[asyncio.Future[Any]] = set()
        self._digests: dict[str, str] = {}
        self._digest_lock: asyncio.Lock | None = None
        self._t0 = 0.0

    # ---- epochs ----

    async def run_epoch(self, tasks: Sequence[Task], group_size: int, epoch: int = 0) -> EpochResult:
        """Roll out `group_size` samples of every task; returns once all have finished."""
        self._t0 = time.monotonic()
        self._digest_lock = asyncio.Lock()  # per epoch: each epoch may run in its own event loop
        sources = lambda: self._live.snapshot() + (  # noqa: E731
            self.speculator.workspaces.snapshot() if self.speculator else [])
        extra = (lambda: self.cache.lru.resident_bytes) if self.cache is not None else (lambda: 0)
        sampler = MemorySampler(sources, extra, self.memory_interval)
        sampler.start(self._t0)
        try:
            groups = await asyncio.gather(*(self._run_group(t, group_size, epoch) for t in tasks))
        finally:
            await self._drain()
            memory = await sampler.stop()
        seconds = max((s.timeline.finished for g in groups for s in g), default=0.0)
        samples = [s for g in groups for s in g]
        for s in samples:
            s.timeline.wasted_seconds = sum(b.wasted_seconds for b in s.branches)
            self.tail.record_rollout(s.ctx.task_id, s.ctx.sample, s.timeline.finished - s.timeline.started)
        result = EpochResult(
            epoch, seconds, [s.timeline for s in samples], memory,
            cache=self.cache.stats() if self.cache is not None else None,
            speculation=dict(self.speculator.stats) if self.speculator is not None else None,
            guard=self.guard.report(),
        )
        self.history.extend(result.trajectories())
        return result

    def fit_selector(self, held_out_epochs: Sequence[int] = ()) -> SelectorReport | None:
        """Train the speculator's selector on every recorded trajectory (between epochs)."""
        if self.speculator is None or not self.history:
            return None
        sel, report = train_selector(self.history, held_out_epochs=held_out_epochs)
        self.speculator.selector = sel
        return report

    async def _drain(self) -> None:
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)
        if self.speculator is not None:
            await self.speculator.drain()
        if self.cache is not None:
            await run_blocking(self.cache.drain)

    def _background(self, aw: Any) -> asyncio.Future[Any]:
        fut = asyncio.ensure_future(aw)
        self._bg.add(fut)
        fut.add_done_callback(self._bg.discard)
        return fut

    def _now(self) -> float:
        return time.monotonic() - self._t0

    # ---- groups ----

    async def _digest(self, task: Task) -> str:
        env = task.environment
        rootfs = str(env.spec.get("rootfs", "host"))
        assert self._digest_lock is not None
        async with self._digest_lock:  # groups start together; a rootfs is resolved once
            if rootfs not in self._digests:
                self._digests[rootfs] = await run_blocking(rootfs_digest, rootfs)
        return template_digest(self._digests[rootfs], env.fingerprint)

    async def _initialized(self, task: Task) -> Workspace:
        ws = self._live.add(await run_blocking(Workspace.create, **task.environment.spec))
        try:
            await run_blocking(task.environment.setup, ws)
        except BaseException:
            await self._destroy(ws)
            raise
        return ws

    async def _run_group(self, task: Task, group_size: int, epoch: int) -> list[_Sample]:
        samples = [
            _Sample(SampleContext(task.id, i, epoch, task.prompt), task.environment.tools,
                    SampleTimeline(task.id, i, epoch, started=self._now()))
            for i in range(group_size)
        ]
        t0 = self._now()
        if self.cache is not None:
            digest = await self._digest(task)
            root = self.cache.root(task.id, digest)
            if root is None:
                ws0 = await self._initialized(task)
                snap = await run_blocking(SharedSnapshot.take, ws0, self.memory)
                await self._destroy(ws0)
                root = self.cache.add_root(task.id, digest, snap)
            for s in samples:
                s.node = root  # no workspace until the first miss
        else:
            ws0 = await self._initialized(task)
            try:
                snap = await run_blocking(SharedSnapshot.take, ws0, self.memory)
            finally:
                await self._destroy(ws0)
            try:
                clones = await run_blocking(snap.snap.fork, group_size)
            finally:
                await run_blocking(snap.release)
            for s, c in zip(samples, clones, strict=True):
                if isinstance(c, Exception):
                    for other in clones:
                        if isinstance(other, Workspace):
                            await self._destroy(other)
                    raise c
                s.ws = self._live.add(c)
        for s in samples:
            s.timeline.add("setup", t0, self._now())
        await asyncio.gather(*(self._run_sample(s) for s in samples))
        return samples

    # ---- one sample ----

    async def _run_sample(self, s: _Sample) -> None:
        tl = s.timeline
        try:
            if s.node is not None:
                self._prefetch(s, None)
            for _ in range(self.max_steps):
                t = self._now()
                action = await self.policy.act(s.ctx, list(s.history))
                tl.add("reason", t, self._now())
                if isinstance(action, FinalAnswer):
                    tl.answer = action.text
                    break
                if not isinstance(action, ToolCall):
                    raise TypeError(f"the policy returned {action!r}, not a ToolCall or FinalAnswer")
                obs = await self._step(s, action)
                s.history.append(Step(action, obs))
                tl.steps.append(s.history[-1])
        except Exception as e:
            tl.errors.append(f"{type(e).__name__}: {e}")
        finally:
            tl.finished = self._now()
            await self._finish(s)

    async def _finish(self, s: _Sample) -> None:
        if s.post is not None:
            with contextlib.suppress(Exception):
                await s.post
        if s.branch is not None:
            with contextlib.suppress(Exception):
                await self._destroy(await s.branch.close())
            s.branch = None
        self._drop_shadow(s)
        if s.ws is not None:
            self._background(self._destroy(s.ws))
            s.ws = None

    async def _destroy(self, ws: Workspace) -> None:
        self._live.discard(ws)
        await run_blocking(ws.destroy)

    async def _step(self, s: _Sample, call: ToolCall) -> str:
        tl = s.timeline
        if s.post is not None:
            # The workspace is being captured or forked for speculation; let that finish first.
            t = self._now()
            await s.post
            s.post = None
            if self._now() - t > 0.001:
                tl.add("post_wait", t, self._now())
        tool = s.tools.get(call.name)
        if tool is None:
            return f"[error] unknown tool {call.name!r}; available: {', '.join(sorted(s.tools))}"
        reusable = self.guard.reusable(tool)

        # 1. A speculative branch that predicted exactly this call.
        if s.branch is not None and reusable:
            t = self._now()
            hit = await s.branch.resolve(call)
            if hit is not None:
                tl.add("spec_hit", t, self._now(), call.key)
                self.tail.record_call(call, hit.exec_seconds)
                await self._adopt_speculation(s, call, hit.observation, hit.exec_seconds, hit.index)
                return hit.observation

        # 2. The prefix cache.
        if self.cache is not None and s.node is not None and reusable:
            child = self.cache.lookup(s.node, call, tool)
            if child is not None:
                served = await self._serve_from_cache(s, call, tool, child)
                if served is not None:
                    return served

        # 3. A miss: run it for real, from the state of the last call served.
        if s.branch is not None:
            t = self._now()
            s.ws = self._live.add(await s.branch.close())
            s.branch = None
            tl.add("spec_miss", t, self._now(), call.key)
        if s.ws is None:
            await self._materialize(s)
        return await self._execute(s, call, tool, reusable)

    async def _serve_from_cache(self, s: _Sample, call: ToolCall, tool: Tool, child: Node) -> str | None:
        tl = s.timeline
        t = self._now()
        try:
            obs = await asyncio.wrap_future(child.result)  # another sample may still be running it
        except Exception:
            return None  # that execution failed; run it ourselves
        if self.guard.should_audit():
            return await self._audit(s, call, tool, child, obs)
        tl.add("cache_hit", t, self._now(), call.key)
        if s.branch is not None:
            branch, s.branch = s.branch, None
            self._background(self._close_and_destroy(branch))
        if s.ws is not None:
            self._background(self._destroy(s.ws))
            s.ws = None
        parent = s.node
        s.node = child
        self._prefetch(s, parent)
        return obs

    async def _audit(self, s: _Sample, call: ToolCall, tool: Tool, child: Node, recorded: str) -> str:
        """Re-execute a hit from its parent state; the policy gets the fresh observation."""
        tl = s.timeline
        t = self._now()
        if s.branch is not None:
            s.ws = self._live.add(await s.branch.close())
            s.branch = None
        if s.ws is None:
            await self._materialize(s)
        assert s.ws is not None
        fresh = await tool.run(s.ws, call.args)
        tl.add("audit", t, self._now(), call.key)
        # Equal: this workspace is now in the child's state. Different: the tool is marked
        # non-deterministic (the cache drops its subtrees) and this sample leaves the tree.
        s.node = child if self.guard.check(call, recorded, fresh, source="audit") else None
        self._after_real_call(s, call, None)
        return fresh

    async def _materialize(self, s: _Sample) -> None:
        tl = s.timeline
        t = self._now()
        assert self.cache is not None and s.node is not None
        ws: Workspace | None = None
        if s.shadow is not None:
            shadow, s.shadow = s.shadow, None
            try:
                ws = await shadow
            except ReplayDiverged as e:
                tl.errors.append(str(e))
                ws = e.workspace
                s.node = None
            except Exception as e:
                tl.errors.append(f"prefetch failed: {e!r}")
        if ws is None:
            try:
                ws = await self.cache.materialize(s.node, s.tools)
            except ReplayDiverged as e:
                # Replay observed something else than what this sample was served: the tool is now
                # marked non-deterministic. Continue from the replayed state, off the tree.
                tl.errors.append(str(e))
                ws = e.workspace
                s.node = None
        s.ws = self._live.add(ws)
        tl.add("materialize", t, self._now())

    async def _execute(self, s: _Sample, call: ToolCall, tool: Tool, reusable: bool) -> str:
        tl = s.timeline
        assert s.ws is not None
        node, created = None, False
        if self.cache is not None and s.node is not None and reusable:
            # If another sample created this node meanwhile, our resulting state equals its node's.
            node, created = self.cache.begin(s.node, call)
        t = self._now()
        try:
            obs = await tool.run(s.ws, call.args)
        except Exception as e:
            if created:
                self.cache.abandon(node, e)  # type: ignore[union-attr,arg-type]
            tl.add("tool", t, self._now(), call.key)
            s.node = None
            return f"[error] {type(e).__name__}: {e}"
        took = self._now() - t
        tl.add("tool", t, t + took, call.key)
        self.tail.record_call(call, took)
        capture = created and self.cache.complete(node, obs, took)  # type: ignore[union-attr,arg-type]
        s.node = node
        self._after_real_call(s, call, node if capture else None)
        return obs

    def _after_real_call(self, s: _Sample, call: ToolCall, capture: Node | None) -> None:
        """Capture the new state for the cache and/or start speculating, while the policy reasons."""
        calls = [h.call for h in s.history] + [call]
        chain = self.speculator.predict(s.ctx.task_id, s.ctx.sample, calls, s.tools,
                                        real_calls=s.timeline.count("tool")) if self.speculator else []
        if capture is None and not chain:
            return
        s.post = asyncio.ensure_future(self._post_call(s, capture, chain))

    async def _post_call(self, s: _Sample, capture: Node | None, chain: list[ToolCall]) -> None:
        assert s.ws is not None
        try:
            snap = await run_blocking(SharedSnapshot.take, s.ws, self.memory)
        except Exception as e:
            s.timeline.errors.append(f"capture failed: {e!r}")
            if capture is not None and self.cache is not None:
                self.cache.attach(capture, None)
            return
        try:
            if capture is not None and self.cache is not None:
                self.cache.attach(capture, snap.acquire())
            if chain and self.speculator is not None:
                try:
                    branch = await self.speculator.launch(s.ws, chain, s.tools, snapshot=snap)
                except Exception as e:
                    s.timeline.errors.append(f"speculation not started: {e!r}")
                    return
                s.branch = branch
                s.branches.append(branch)
                self._live.discard(s.ws)  # held by the branch now
                s.ws = None
        finally:
            await run_blocking(snap.release)

    async def _adopt_speculation(self, s: _Sample, call: ToolCall, obs: str, took: float, index: int) -> None:
        """The sample moves to the speculative state; the cache learns the call like a real one."""
        branch = s.branch
        assert branch is not None
        capture = None
        if self.cache is not None and s.node is not None:
            node, created = self.cache.begin(s.node, call)
            if created and self.cache.complete(node, obs, took):
                if branch.exhausted:
                    capture = node  # captured below, from the adopted workspace
                else:
                    # The chain runs on; the checkpoint taken after this call is the node's state.
                    self._background(self._attach_checkpoint(node, branch, index))
            s.node = node
        if branch.exhausted:
            s.branch = None
            s.ws = self._live.add(await branch.close())
            self._after_real_call(s, call, capture)

    async def _attach_checkpoint(self, node: Node, branch: SpeculativeBranch, index: int) -> None:
        assert self.cache is not None
        cp = await branch.state_after(index)
        self.cache.attach(node, cp)

    async def _close_and_destroy(self, branch: SpeculativeBranch) -> None:
        await self._destroy(await branch.close())

    # ---- rebuilding cached states ahead of a miss ----

    def _prefetch(self, s: _Sample, parent: Node | None) -> None:
        """Start rebuilding the state of the sample's node while its policy reasons, when the next
        call will probably miss there: the node is a leaf that an earlier epoch left behind, or a
        task's root that has no calls below it yet.

        Rebuilding is a fork (plus a disk load or a replay for a state not in memory), so doing it
        for every hit would waste most of them: a node with children, or one a sibling made in
        this epoch (it is likely just ahead and about to add the next call), is rebuilt only on
        an actual miss.
        """
        if not self.prefetch or self.cache is None or s.node is None:
            return
        node = s.node
        # A fresh root has no children either, and every sample of the group leaves it with a
        # fork as Base would: start that fork while the first step is being reasoned.
        likely_miss = not node.children and (node.created < self._t0 or node.parent is None)
        old = s.shadow
        if not likely_miss:
            self._drop_shadow(s)
            return
        if old is not None and parent is not None and node.parent is parent and not node.resident and \
                node.exec_seconds <= self.cache.plan(node).seconds:
            s.shadow = asyncio.ensure_future(self._extend_shadow(old, node, s.tools))
            return
        self._drop_shadow(s)
        s.shadow = asyncio.ensure_future(self._rebuild(node, s.tools))

    async def _rebuild(self, node: Node, tools: ToolSet) -> Workspace:
        assert self.cache is not None
        try:
            return self._live.add(await self.cache.materialize(node, tools))
        except ReplayDiverged as e:
            self._live.add(e.workspace)
            raise

    async def _extend_shadow(self, previous: asyncio.Task[Workspace], node: Node, tools: ToolSet) -> Workspace:
        ws = await previous
        assert self.cache is not None
        try:
            await self.cache._replay(ws, node, tools)
        except ReplayDiverged:
            raise
        except BaseException:
            await run_blocking(ws.destroy)
            raise
        return ws

    def _drop_shadow(self, s: _Sample) -> None:
        if s.shadow is None:
            return
        shadow, s.shadow = s.shadow, None

        async def discard() -> None:
            try:
                ws = await shadow
            except ReplayDiverged as e:
                ws = e.workspace
            except Exception:
                return
            await self._destroy(ws)

        self._background(discard())
