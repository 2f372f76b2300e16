"""Many hosts: a Ray-backed workspace pool with prefix-affinity routing (the `ray` extra).

    import ray
    from bunshinrl.cluster import ClusterEngine, RayWorkspacePool

    ray.init(address="auto")                 # nodes started with --resources '{"bunshin-host-a": 1}'
    with RayWorkspacePool(core=make_core) as pool:   # one WorkspaceHost actor per bunshin host,
        engine = ClusterEngine(policy, pool)           # each running make_core()'s RolloutCore
        result = asyncio.run(engine.run_epoch(tasks, group_size=8))
        engine.fit_selector()                          # Spec/Full: one selector for the pool
"""

from .engine import ClusterEngine, ClusterStats, Placement
from .host import NoCache, WorkspaceHost
from .pool import RESOURCE_PREFIX, RayWorkspacePool, Replication, discover, host_resources

__all__ = ["RESOURCE_PREFIX", "ClusterEngine", "ClusterStats", "NoCache", "Placement", "RayWorkspacePool",
           "Replication", "WorkspaceHost", "discover", "host_resources"]
