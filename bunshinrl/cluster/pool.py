"""RayWorkspacePool: one WorkspaceHost actor per bunshin host of a Ray cluster.

A Ray node is a bunshin host when it offers the custom resource `bunshin-host-NAME` (one
unit): `ray start --resources '{"bunshin-host-a": 1}'` on a real machine, or
`Cluster.add_node(resources=...)` in a local test cluster. The pool finds the hosts in the
cluster's node resources and places each host's actor by that resource: no hostname appears
in code. Each actor's environment makes it host NAME (HostConfig.named), so several nodes on
one machine keep their state roots, cgroups, bridges and layer stores apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bunshinfork import HostConfig

from .host import CoreFactory, WorkspaceHost

RESOURCE_PREFIX = "bunshin-host-"


def host_resources(name: str) -> dict[str, float]:
    """What a Ray node offers to be bunshin host `name`."""
    HostConfig.named(name)  # validates the name
    return {RESOURCE_PREFIX + name: 1.0}


def discover() -> list[str]:
    """The bunshin hosts of the connected Ray cluster: alive nodes' `bunshin-host-*` resources."""
    import ray

    names = {k[len(RESOURCE_PREFIX):] for n in ray.nodes() if n.get("Alive")
             for k in n.get("Resources", {}) if k.startswith(RESOURCE_PREFIX)}
    return sorted(names)


@dataclass(frozen=True)
class Replication:
    """How a hot snapshot travels to a cold host: through Ray's object store (shared_dir None)
    or as a directory in `shared_dir`, a file system every host mounts (NFS, a shared disk)."""

    shared_dir: str | None = None


class RayWorkspacePool:
    """The hosts' actors. `hosts` defaults to every bunshin host in the cluster (ray.init()
    first). core: what each host runs its rollouts on, a function returning a RolloutCore,
    called on the host (it travels there by value, as Ray's tasks do): Base, the cache, Spec or
    Full, exactly as a single host's RolloutEngine(core=...) would; default: a prefix cache of
    cache_bytes per host (the host's shard) and no speculation."""

    def __init__(self, hosts: Sequence[str] | None = None, *, core: CoreFactory | None = None,
                 cache_bytes: int = 1 << 30, memory: str = "auto", replication: Replication | None = None,
                 start_timeout: float = 120.0) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayWorkspacePool needs a Ray connection: call ray.init() first")
        names = list(hosts) if hosts is not None else discover()
        if not names:
            raise RuntimeError(f"no Ray node offers a {RESOURCE_PREFIX}NAME resource: start nodes with "
                               f"--resources '{{\"{RESOURCE_PREFIX}a\": 1}}'")
        self.core = core
        self.cache_bytes = cache_bytes
        self.memory = memory
        self.replication = replication or Replication()
        self.start_timeout = start_timeout
        self._actors: dict[str, Any] = {n: self._start(n) for n in names}
        self.dead: set[str] = set()
        ray.get([a.ping.remote() for a in self._actors.values()], timeout=start_timeout)

    def _start(self, name: str) -> Any:
        import ray

        cls = ray.remote(WorkspaceHost)
        # num_cpus=0: a host's work runs in its workspaces, not in Ray's CPU slots; one actor per
        # node, held there by the node's own resource.
        return cls.options(resources=host_resources(name), num_cpus=0, max_restarts=0, max_concurrency=256,
                           runtime_env={"env_vars": HostConfig.named(name).env()}).remote(
            name, self.cache_bytes, self.memory, self.core)

    @property
    def hosts(self) -> list[str]:
        """The hosts whose actors are alive (as far as the pool has seen)."""
        return [n for n in self._actors if n not in self.dead]

    def actor(self, name: str) -> Any:
        return self._actors[name]

    def mark_dead(self, name: str) -> None:
        self.dead.add(name)

    def kill(self, name: str) -> None:
        """Kill host `name`'s actor (its workspaces stay until gc): a host failure, for tests."""
        import ray

        ray.kill(self._actors[name], no_restart=True)
        self.mark_dead(name)

    def gc(self, name: str) -> dict[str, list[str]]:
        """Clean up host `name` after its actor died: a new actor on that node destroys what the
        dead one left under the host's state root and runs bunshinfork's gc there (and only there)."""
        import ray

        self._actors[name] = self._start(name)
        out = ray.get(self._actors[name].shutdown.remote(), timeout=self.start_timeout)
        self.dead.discard(name)
        return out

    def shutdown(self) -> dict[str, dict[str, list[str]]]:
        """Release every host's workspaces, snapshots and cache, gc each host, and remove the
        hosts' own directories; dead hosts get a fresh actor for that first."""
        import ray

        out: dict[str, dict[str, list[str]]] = {}
        for name in list(self._actors):
            if name in self.dead:
                self._actors[name] = self._start(name)
            try:
                out[name] = ray.get(self._actors[name].retire.remote(), timeout=self.start_timeout)
            finally:
                with contextlib.suppress(Exception):
                    ray.kill(self._actors[name], no_restart=True)
        self._actors.clear()
        return out

    def __enter__(self) -> RayWorkspacePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
