"""bunshinrl.cluster on a real local Ray cluster of two nodes, each its own bunshin host (state
root, cgroup parent, bridge, layer store), with real workspaces: the SDK and cache operations
remotely, per-host isolation, prefix-affinity routing, identical results to a single host,
a host actor killed mid-epoch, gc of a dead host, replication of a hot prefix (its snapshot
through the object store or a shared directory), and Base, Spec and Full on the cluster."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import ray
import rl_support
from cluster_support import local_cluster

from bunshinfork.host import HostConfig, named_hosts
from bunshinfork.memory import ksm
from bunshinrl import (
    DeterminismGuard,
    FinalAnswer,
    RolloutCore,
    RolloutEngine,
    SampleContext,
    SnapshotBackend,
    Speculator,
    Step,
    TailPolicy,
    Task,
    ToolCall,
    ToolPrefixCache,
)
from bunshinrl.calls.policy import Action
from bunshinrl.cluster import ClusterEngine, RayWorkspacePool, Replication
from bunshinrl.rollout.wiring import CoreConfig, build_core

# Tasks and policies travel to the host actors by value (Ray's own cloudpickle): Ray's workers
# cannot import tests/.
ray.cloudpickle.register_pickle_by_value(rl_support)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HOSTS = ("ta", "tb")
C = ToolCall
COMMON = [C("touch", {"name": "a"}), C("bump", {"n": 1}), C("sleeper", {"id": 7})]
SCRIPTS = {0: [*COMMON, C("bump", {"n": 2}), C("state")], 1: [*COMMON, C("touch", {"name": "z"}), C("state")],
           2: [COMMON[0], C("bump", {"n": 5}), C("state")]}


def _verify(ws) -> float:  # type: ignore[no-untyped-def]
    out = ws.commands.run("curl -s http://127.0.0.1:9000/value", timeout=30).stdout.strip()
    return float(out) / 10


def task(task_id: str = "ct") -> Task:
    return Task(task_id, "Bump the counter.", rl_support.tools(), rl_support.setup, verify=_verify,
                fingerprint="cluster-test-counter-v1")


class Scripted:
    """Sample i emits SCRIPTS[i]; `pause` seconds per step (a model's think time)."""

    def __init__(self, pause: float = 0.05) -> None:
        self.pause = pause

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        await asyncio.sleep(self.pause)
        script = SCRIPTS[ctx.sample]
        return script[len(history)] if len(history) < len(script) else FinalAnswer("done")


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    with local_cluster(HOSTS) as c:
        yield c


@contextlib.contextmanager
def _pool(core: Callable[[], RolloutCore] | None = None) -> Iterator[RayWorkspacePool]:
    p = RayWorkspacePool(core=core, cache_bytes=512 << 20)
    try:
        yield p
    finally:
        out = p.shutdown()
    assert set(out) == set(HOSTS)
    assert not named_hosts(), "a pool host's state root outlived the pool"
    # Ray kills a retired host's actor: a boost of ksmd it held must be gone before that, not
    # left listed under a dead pid until some later process prunes it.
    holders = json.loads(ksm.BOOST_PATH.read_text())["holders"] if ksm.BOOST_PATH.exists() else {}
    assert set(holders) <= {str(os.getpid())}, f"retired hosts still hold ksmd's boost: {holders}"


@pytest.fixture
def pool(cluster: object) -> Iterator[RayWorkspacePool]:
    with _pool() as p:
        yield p


def depth_core() -> RolloutCore:
    """A host core that captures every state (the depth policy): replication's test needs the
    hot prefix held at its full depth, which the default policy keeps only behind long steps."""
    return build_core(CoreConfig(cache_bytes=512 << 20, snapshot_policy="depth", critical_path_captures=False,
                                 persist_between_epochs=False))


@pytest.fixture
def depth_pool(cluster: object) -> Iterator[RayWorkspacePool]:
    with _pool(depth_core) as p:
        yield p


def _single_host(policy: Scripted, t: Task, epochs: int) -> list:
    cache = ToolPrefixCache(SnapshotBackend(), 512 << 20)
    engine = RolloutEngine(policy, cache=cache)
    try:
        return [asyncio.run(engine.run_epoch([t], 3, e)) for e in range(epochs)]
    finally:
        cache.close()


def _rewards(result) -> dict[str, float | None]:  # type: ignore[no-untyped-def]
    return {f"{s.task_id}/{s.sample}": s.reward for s in result.samples}


def test_pool_hosts_are_separate_bunshin_hosts_with_the_sdk(pool: RayWorkspacePool) -> None:
    assert sorted(pool.hosts) == sorted(HOSTS)
    info = {h: ray.get(pool.actor(h).ping.remote()) for h in HOSTS}
    for h in HOSTS:
        cfg = HostConfig.named(h)
        assert info[h]["run_root"] == str(cfg.run_root) and info[h]["cgroup_parent"] == cfg.cgroup_parent
        assert info[h]["bridge"] == cfg.bridge and info[h]["layer_store"] == str(cfg.layer_store)
    assert info["ta"]["pid"] != info["tb"]["pid"]
    # The default host captures with the policy every other driver builds (never after every call).
    shared = {"policy": CoreConfig.snapshot_policy, "critical_path": CoreConfig.critical_path_captures}
    assert shared == {"policy": "cost", "critical_path": True}
    assert all(ray.get(pool.actor(h).stats.remote())["captures"] == shared for h in HOSTS)
    a, b = pool.actor("ta"), pool.actor("tb")
    ws = ray.get(a.create.remote())
    ray.get(a.write_file.remote(ws, "/root/x", "from ta"))
    assert ray.get(a.run.remote(ws, "cat /root/x"))[:2] == (0, "from ta")
    assert (HostConfig.named("ta").run_root / ws).is_dir() and not (HostConfig.named("tb").run_root / ws).exists()
    assert not Path("/run/bunshin", ws).exists()  # not this (default) host's either
    snap = ray.get(a.snapshot.remote(ws))
    (clone,) = ray.get(a.fork.remote(snap, 1))
    ray.get(a.write_file.remote(clone, "/root/x", "clone"))
    assert ray.get(a.read_file.remote(ws, "/root/x")) == "from ta"
    assert ray.get(a.read_file.remote(clone, "/root/x")) == "clone"
    # gc on the other host touches nothing of this one's, although this one's creator is alive
    # and that one's gc destroys every workspace whose creator is gone.
    assert ray.get(b.gc.remote())["reaped"] == []
    assert ray.get(a.run.remote(clone, "true"))[0] == 0
    ray.get(a.destroy.remote(clone))
    ray.get(a.destroy.remote(ws))
    ray.get(a.release.remote(snap))


def test_cache_operations_remotely(depth_pool: RayWorkspacePool) -> None:
    # record() hands over a workspace whose state must be kept (the depth policy's): under the
    # default policy a later materialise would replay the call, whose real observation is not
    # the one this test records by hand.
    pool = depth_pool
    t = task("cops")
    a = pool.actor("ta")
    ray.get([pool.actor(h).register.remote([t]) for h in HOSTS])
    assert ray.get(a.lookup.remote(t.id, [])) == -1
    ws, depth = ray.get(a.materialise.remote(t.id, COMMON))  # creates the root state: depth 0
    assert depth == 0 and ray.get(a.lookup.remote(t.id, [])) == 0
    obs = ray.get(a.run.remote(ws, "mkdir -p /root/files && echo a > /root/files/a && ls /root/files"))[1]
    assert ray.get(a.record.remote(t.id, COMMON[:1], obs.strip(), ws))
    ray.get(a.destroy.remote(ws))
    assert ray.get(a.lookup.remote(t.id, COMMON)) == 1
    ws2, depth = ray.get(a.materialise.remote(t.id, COMMON))
    assert depth == 1 and ray.get(a.read_file.remote(ws2, "/root/files/a")).strip() == "a"
    ray.get(a.destroy.remote(ws2))
    assert ray.get(pool.actor("tb").lookup.remote(t.id, COMMON)) == -1  # the other shard holds none


def test_affinity_routes_to_the_prefix_and_matches_one_host(pool: RayWorkspacePool) -> None:
    t = task("aff")
    engine = ClusterEngine(Scripted(), pool)
    results = [asyncio.run(engine.run_epoch([t], 3, e)) for e in range(2)]
    (_, first, why0), (_, second, why1) = engine.stats.placements
    assert why0 == "least-loaded" and (second, why1) == (first, "prefix")
    # Samples of one group share their common prefix (a sibling's call still running is waited for).
    assert results[0].cache_hits + results[0].sibling_waits > 0
    assert results[1].cache_hits > results[0].cache_hits
    local = _single_host(Scripted(), t, 2)
    for mine, theirs in zip(results, local, strict=True):
        assert mine.observations() == theirs.observations()
        assert _rewards(mine) == _rewards(theirs) and None not in _rewards(mine).values()
    rnd = ClusterEngine(Scripted(), pool, routing="random", seed=1)
    assert asyncio.run(rnd.run_epoch([t], 3, 0)).observations() == local[0].observations()


def test_a_host_killed_mid_epoch_loses_workspaces_not_the_epoch(pool: RayWorkspacePool) -> None:
    t = task("kill")
    engine = ClusterEngine(Scripted(pause=0.3), pool)

    async def epoch_with_a_kill() -> object:
        run = asyncio.ensure_future(engine.run_epoch([t], 3, 0))
        while engine.stats.steps < 3:  # some steps done on the host, no sample finished
            await asyncio.sleep(0.02)
        victim = engine.stats.placements[0][1]
        pool.kill(victim)
        return victim, await run

    victim, result = asyncio.run(epoch_with_a_kill())
    assert engine.stats.restarts >= 2
    assert sorted(s.sample for s in result.samples) == [0, 1, 2] and not any(s.errors for s in result.samples)
    local = _single_host(Scripted(), t, 1)[0]
    assert result.observations() == local.observations() and _rewards(result) == _rewards(local)
    cfg = HostConfig.named(victim)
    left = {n for n in os.listdir(cfg.run_root) if n.startswith("ws-")}
    assert left, "the dead host's workspaces were expected to outlive its actor until gc"
    out = pool.gc(victim)
    assert set(out["reaped"]) <= left and not {n for n in os.listdir(cfg.run_root) if n.startswith("ws-")}
    assert victim in pool.hosts


@pytest.mark.parametrize("through", ["object-store", "shared-dir"])
def test_a_hot_prefix_is_replicated_to_a_cold_host(depth_pool: RayWorkspacePool, tmp_path: Path,
                                                  through: str) -> None:
    pool = depth_pool
    t = task(f"rep-{through[0]}")
    if through == "shared-dir":
        pool.replication = Replication(str(tmp_path))
    engine = ClusterEngine(Scripted(), pool, replicate_above=0)  # every host with the root counts as busy
    results = [asyncio.run(engine.run_epoch([t], 3, 0))]
    first = engine.stats.placements[0][1]
    known = [[s.call for s in tl.steps] for tl in results[0].samples]
    hot = max(known, key=len)
    # The group's prefixes are on the busy host only: epoch 1 goes to the cold one, with the
    # root state, the group's calls, and the state where the group branches (after COMMON).
    assert [ray.get(pool.actor(h).lookup.remote(t.id, hot)) for h in (first, *set(HOSTS) - {first})] == \
        [len(hot), -1]
    results.append(asyncio.run(engine.run_epoch([t], 3, 1)))
    (_, _, why0), (_, second, why1) = engine.stats.placements
    assert why0 == "least-loaded" and why1 == "replicated" and second != first
    assert engine.stats.replicated == 1 and engine.stats.bytes_moved > 1 << 20
    cold = ray.get(pool.actor(second).stats.remote())
    assert cold["imported_bytes"] == engine.stats.bytes_moved
    # The root's state and the hot prefix's came; a second visitor's warm copy of a served state
    # may be captured there as well, when no reasoning step had been measured on that host yet to
    # say the capture would not fit (claim_capture: timing, not replication).
    assert cold["cache"]["resident"] == 2 + cold["cache"]["captures_on_demand"], cold
    # Every call the group made (the verifier's too) is served on the cold host from what came:
    # nothing ran there, and the observations and rewards are a single host's.
    assert all(ray.get(pool.actor(second).lookup.remote(t.id, k)) == len(k) for k in known)
    assert results[1].hit_rate == 1.0 and cold["cache"]["misses"] == 0
    local = _single_host(Scripted(), t, 2)
    for mine, theirs in zip(results, local, strict=True):
        assert mine.observations() == theirs.observations() and _rewards(mine) == _rewards(theirs)
    # The moved state is the hot prefix's deepest the busy host held: where the group branches
    # (after COMMON) unless a capture there had not finished when it was asked. A new call after
    # COMMON forks it there and replays only the calls between it and COMMON's end.
    [at] = engine.stats.moved_depths
    assert 1 <= at <= len(hot)
    replayed = ray.get(pool.actor(second).stats.remote())["cache"]["replayed_calls"]
    ws, depth = ray.get(pool.actor(second).materialise.remote(t.id, [*COMMON, C("state")]))
    assert depth == 3
    state = ray.get(pool.actor(second).run.remote(ws, "ls /root/files; curl -s http://127.0.0.1:9000/value"))[1]
    assert state.split() == ["a", "1"]
    ray.get(pool.actor(second).destroy.remote(ws))
    below = at if at <= len(COMMON) else 0  # a state past the branch is not on COMMON's path
    assert ray.get(pool.actor(second).stats.remote())["cache"]["replayed_calls"] == replayed + len(COMMON) - below


# ---- Base, Spec and Full on the cluster ----

def speculating_task() -> Task:
    return Task("spec", "Bump the counter.", rl_support.tools(), rl_support.setup, verify=_verify,
                fingerprint="cluster-test-counter-v1")


class Predictable:
    """Every epoch starts with a call of its own (so it is a real call, not a cache hit, in Full
    too, and speculation starts after it); then samples 0 and 1 call the slow tool, sample 2 does
    not: a selector fitted on epoch 0 predicts the slow call for all three, so in epoch 1 it is
    adopted twice and rolled back once. Sample i thinks 0.1 s longer than sample i-1 (one order
    of who runs a shared call first), 0.5 s more before the slow call."""

    async def act(self, ctx: SampleContext, history: Sequence[Step]) -> Action:
        await asyncio.sleep(0.1 + 0.1 * ctx.sample + (0.5 if len(history) == 1 else 0))
        second = C("bump", {"n": 1}) if ctx.sample == 2 else C("slow", {"s": 0.4})
        script = [C("touch", {"name": f"e{ctx.epoch}"}), second, C("state")]
        return script[len(history)] if len(history) < len(script) else FinalAnswer("done")


def make_core(config: str) -> RolloutCore:
    """The one core a single host and every host of the pool run: Base, Spec or Full."""
    guard = DeterminismGuard()
    cache = ToolPrefixCache(SnapshotBackend(), 512 << 20, guard=guard) if config == "full" else None
    spec = Speculator(depth=2, min_probability=0.0, tail=TailPolicy(slow_tool_seconds=0.3)) \
        if config in ("spec", "full") else None
    return RolloutCore(cache=cache, speculator=spec, guard=guard)


async def _two_epochs(engine: RolloutEngine | ClusterEngine, t: Task) -> list:
    out = [await engine.run_epoch([t], 3, 0)]
    engine.fit_selector()
    out.append(await engine.run_epoch([t], 3, 1))
    return out


@pytest.mark.parametrize("config", ["base", "spec", "full"])
def test_base_spec_and_full_on_the_cluster_match_one_host(cluster: object, config: str) -> None:
    t = speculating_task()
    with _pool(functools.partial(make_core, config)) as pool:
        mine = asyncio.run(_two_epochs(ClusterEngine(Predictable(), pool), t))
    local_core = make_core(config)
    local = RolloutEngine(Predictable(), core=local_core)
    try:
        theirs = asyncio.run(_two_epochs(local, t))
    finally:
        asyncio.run(local.close())
        if local_core.cache is not None:
            local_core.cache.close()
    for m, o in zip(mine, theirs, strict=True):
        assert m.trajectories() == o.trajectories() and m.observations() == o.observations()
        assert _rewards(m) == _rewards(o) and None not in _rewards(m).values()
        assert not any(s.errors for s in m.samples), [s.errors for s in m.samples]
    adopted = [sum(s.count("spec_hit") for s in r.samples) for r in mine]
    rolled_back = [sum(s.count("spec_miss") for s in r.samples) for r in mine]
    if config == "base":
        assert mine[1].speculation is None and adopted == rolled_back == [0, 0]
        return
    # Nothing to predict from before the selector has seen an epoch; after it, the hosts ran
    # the predicted calls in forks while the driver's policy reasoned.
    assert adopted[0] == rolled_back[0] == 0 and mine[1].speculation["launched"] >= 1
    assert adopted[1] >= 1
    if config == "spec":  # every sample ran its first call for real and speculated after it
        assert adopted[1] == 2 and rolled_back[1] == 1
    else:
        assert mine[1].cache_hits > 0
