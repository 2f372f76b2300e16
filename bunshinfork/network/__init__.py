"""Network subsystem (paper §4.6): a workspace's network namespace and its link to the host.

The netns itself is created with the workspace (loopback up). Connections inside it (a
browser and its local server) are part of the captured state: CRIU restores them by TCP
repair in each clone's own netns. Connections to the outside are never duplicated, so only
`network="none"` workspaces fork.

"none": loopback only. "bridge": a veth on the host bridge `bunshin0` (bridge.py); nat=True
adds one nftables masquerade table shared by every NAT workspace (nat.py). All of it is done
over netlink (pyroute2) and nftables' JSON API; nothing shells out.
"""

from .bridge import BRIDGE, gc, host_ifname, leftover_interfaces, setup, subnet, teardown
from .nat import NAT_FAMILY, NAT_TABLE, nat_rules

__all__ = ["BRIDGE", "NAT_FAMILY", "NAT_TABLE", "gc", "host_ifname", "leftover_interfaces", "nat_rules", "setup",
           "subnet", "teardown"]
