"""Network subsystem (paper §4.6): a workspace's network namespace and its link to the host.

The netns itself is created with the workspace (loopback up). Connections inside it (a
browser and its local server) are part of the captured state: CRIU restores them by TCP
repair in each clone's own netns. Connections to the outside are never duplicated, so only
`network="none"` workspaces fork.

"none": loopback only. "bridge": a veth on the host bridge `bunshin0` (bridge.py); nat=True
adds one nftables masquerade table shared by every NAT workspace (nat.py). All of it is done
over netlink (pyroute2) and nftables' JSON API; nothing shells out.
"""

from __future__ import annotations

from pyroute2 import IPRoute

from ..contract import Build, Capture, Check, Held, Part
from ..errors import ForkError
from ..state import NetworkState
from .bridge import BRIDGE, gc, host_ifname, leftover_interfaces, setup, subnet, teardown
from .nat import NAT_FAMILY, NAT_TABLE, nat_rules, nft_available

__all__ = ["BRIDGE", "NAT_FAMILY", "NAT_TABLE", "NetworkPart", "gc", "host_ifname", "leftover_interfaces",
           "nat_rules", "setup", "subnet", "teardown"]


def check_netlink() -> Check:
    try:
        with IPRoute() as ipr:
            links = len(ipr.get_links())
    except Exception as e:
        return Check("netlink", False, f"rtnetlink is unusable ({e}); network='bridge' needs it", required=False)
    return Check("netlink", True, f"rtnetlink answers ({links} links); network='bridge' available", required=False)


def check_nftables() -> Check:
    if nft_available():
        return Check("nftables", True, "python3-nftables importable; nat=True available", required=False)
    return Check("nftables", False, "nftables' Python binding is not importable (apt-get install python3-nftables, "
                 "venv with --system-site-packages); nat=True is unavailable", required=False)


class NetworkPart(Part):
    name = "network"
    probes = (check_netlink, check_nftables)

    def prepare(self, b: Build) -> None:
        rec = b.rec
        assert rec.process is not None
        rec.network = setup(rec.id, rec.process.pid, rec.spec.network, nat=rec.spec.nat)

    def capture(self, c: Capture) -> None:
        net = c.source.network
        if net is not None and net.mode != "none":
            raise ForkError(
                f"workspace {c.source.id} uses network={net.mode!r}; forking supports "
                "network='none' workspaces (their internal TCP connections survive)"
            )

    def restore(self, b: Build) -> None:
        b.rec.network = NetworkState("none")

    def release(self, held: Held) -> None:
        if isinstance(held, Build):
            teardown(held.rec.id, held.rec.network)

    def gc(self) -> list[str]:
        return gc()
