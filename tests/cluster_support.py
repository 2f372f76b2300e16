"""A real local multi-node Ray cluster for the bunshinrl.cluster tests and benchmark: every node a
bunshin host of its own (HostConfig.named), loopback only, no dashboard, no usage stats, a small
object store; and a check that nothing of Ray outlives it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray resolves 127.0.0.1 to the machine's outward address when it connects, unless "clusters"
# are off (then it keeps to loopback, as on a laptop); this machine allows loopback only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

OBJECT_STORE_BYTES = 100 << 20


def ray_processes() -> set[int]:
    """Ray's daemons (raylet, gcs_server) and workers running on this machine now."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"/ray/core/src/ray/raylet/raylet" in cmd or b"gcs_server" in cmd or b"ray::" in cmd \
                or b"default_worker.py" in cmd:
            out.add(int(d.name))
    return out


@contextlib.contextmanager
def local_cluster(hosts: Sequence[str]) -> Iterator[object]:
    """One Ray node per name, each offering `bunshin-host-NAME`, with the driver connected."""
    import ray
    from ray.cluster_utils import Cluster

    from bunshinrl.cluster import host_resources

    before = ray_processes()
    common = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                      head_node_args={**common, "resources": host_resources(hosts[0]), "include_dashboard": False})
    try:
        for name in hosts[1:]:
            cluster.add_node(**common, resources=host_resources(name))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
        deadline = time.monotonic() + 30
        while ray_processes() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        left = ray_processes() - before
        assert not left, f"Ray processes outlived the cluster: {sorted(left)}"
