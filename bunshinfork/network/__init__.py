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

from .. import state
from ..contract import Build, Capture, Check, Held, Part
from ..state import NetworkState
from . import bridge, ports
from .bridge import BRIDGE, clone_link_up, gc, host_ifname, leftover_interfaces, setup, setup_clone, subnet, teardown
from .clones import CAPTURE_FILE, external_flows, load_capture, save_capture
from .nat import NAT_FAMILY, NAT_TABLE, nat_rules, nft_available
from .nsock import destroy_tcp

__all__ = ["BRIDGE", "CAPTURE_FILE", "NAT_FAMILY", "NAT_TABLE", "NetworkPart", "gc", "host_ifname",
           "leftover_interfaces", "nat_rules", "setup", "subnet", "teardown"]


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
        rec.network = setup(rec.id, rec.process.pid, rec.spec.network, nat=rec.spec.nat, egress_spec=rec.spec.egress)

    def capture(self, c: Capture) -> None:
        net = c.source.network
        if net is None or net.mode != "bridge":
            return
        assert c.source.process is not None
        # The source is frozen: its netns's TCP table is the one CRIU dumps.
        save_capture(c.snap.dir, net, external_flows(c.source.process.pid, net.ip))

    def restore(self, b: Build) -> None:
        assert b.source is not None
        captured = load_capture(b.source.dir)
        if captured is None:
            b.rec.network = NetworkState("none")
            return
        source, flows = captured
        # Recorded as soon as its rules exist, so that a failed fork's release removes them too.
        b.rec.network = net = setup_clone(b.rec.id, source, flows, b.rec.spec.egress)

        def finish(pids: list[int]) -> None:
            # Every task is still stopped: the link goes up, and the inherited connections are
            # aborted inside the clone (their RSTs die in the host's raw table) before any runs.
            clone_link_up(b.rec.id, net)
            if flows and pids:
                destroy_tcp(pids[0], flows)

        b.pre_resume.append(finish)

    def release(self, held: Held) -> None:
        if isinstance(held, Build):
            ports.release(held.rec.id)
            teardown(held.rec.id, held.rec.network)

    def gc(self) -> list[str]:
        live = {r.id for r in state.records() if bridge.alive(r)}
        return gc() + ports.gc([state.RUN_ROOT / i for i in state.all_ids()], live)
