"""Network subsystem (paper §4.6): a workspace's network namespace and its link to the host.

The netns itself is created with the workspace (loopback up). "none": loopback only.
"bridge": a veth on the host bridge `bunshin0` (bridge.py); nat=True adds one nftables
masquerade table shared by every NAT workspace (nat.py). All of it is done over netlink
(pyroute2) and nftables; nothing shells out.

Forking a bridged workspace (clones.py has the details):
- Connections inside the workspace (a client and a server through eth0's address or
  loopback) are part of the captured state: CRIU dumps them with --tcp-established and
  restores them by TCP repair in each clone's own netns. The source is frozen, its netns
  locked by CRIU's nftables lock for the dump only (--leave-running unlocks it), so its own
  connections, inside and out, carry on.
- Inside, a clone is its source: eth0 with the same name, address, MAC and routes (CRIU
  restores the namespace; `veth[eth0]:bn<clone>` names the host end it creates), and the
  same files (resolv.conf). Servers bound to that address keep listening.
- On the host, clones cannot share the bridge with one address, so each clone's veth is a
  routed point-to-point link of its own. The host tells them apart by a conntrack zone per
  clone (original direction) and a fwmark per clone copied into its connections' mark, which
  routes replies by an ip rule to the clone's own table; its traffic is source-NATed to a
  unique address of the subnet (masqueraded instead beyond the subnet for nat=True). Every
  clone is online at once, beside its source and siblings.
- Connections to peers outside the workspace (recorded from the frozen netns at capture)
  are never shared: before CRIU restores a clone, the host drops every packet of those
  4-tuples arriving from the clone's link (raw table, before conntrack and NAT); before its
  tasks resume, each copy is aborted inside the clone (sock_destroy, as `ss -K`), so the
  clone's first read or write fails (ECONNABORTED) at once. The peer only ever sees the
  source's flow and each clone's new ones. Forks of forks and of saved snapshots do the same
  (the capture travels with the snapshot: network.json).

Every bridged workspace, clones included, gets the baseline of guard.py before its link
exists: no host service, no 169.254/16 (and no private range when asked), anti-spoofing on
its port, port isolation when asked; IPv6 is off on both ends of every link, and ping works
without CAP_NET_RAW through each namespace's ping_group_range (PING_GROUPS).

Published ports (ports.py) and egress policies (egress.py) work per workspace, clones
included; domain rules add a host-side Host/SNI proxy per workspace (sniproxy.py, proxies.py).
The census (bunshinfork.census) counts their rules, forwarders and proxies.
"""

from __future__ import annotations

from pyroute2 import IPRoute

from .. import idmap, state
from ..contract import Build, Capture, Check, Held, Part
from ..state import NetworkState, Record
from . import bridge, ports
from .bridge import (
    BRIDGE,
    NS_IPV6_OFF,
    clone_link_up,
    gc,
    host_ifname,
    leftover_interfaces,
    set_egress,
    setup,
    setup_clone,
    subnet,
    teardown,
)
from .clones import CAPTURE_FILE, external_flows, load_capture, save_capture
from .nat import NAT_FAMILY, NAT_TABLE, nat_rules, nft_available
from .nsock import destroy_tcp, sysctls_in

__all__ = ["BRIDGE", "CAPTURE_FILE", "NAT_FAMILY", "NAT_TABLE", "NetworkPart", "gc", "host_ifname",
           "leftover_interfaces", "nat_rules", "set_egress", "setup", "subnet", "teardown"]


def check_netlink() -> Check:
    try:
        with IPRoute() as ipr:
            links = len(ipr.get_links())
    except Exception as e:
        return Check("netlink", False, f"rtnetlink is unusable ({e}); network='bridge' needs it", required=False)
    return Check("netlink", True, f"rtnetlink answers ({links} links); network='bridge' available", required=False)


def check_nftables() -> Check:
    if nft_available():
        return Check("nftables", True, "python3-nftables importable; network='bridge' available", required=False)
    return Check("nftables", False, "nftables' Python binding is not importable (apt-get install python3-nftables, "
                 "venv with --system-site-packages); network='bridge' is unavailable", required=False)


# Root inside has no CAP_NET_RAW (csrc/native.c), as in podman: ping uses ICMP datagram
# sockets, which this opens to every group of the workspace's network namespace (podman's value).
PING_GROUPS = {"ipv4/ping_group_range": "0 2147483647"}


def ping_groups(rec: Record) -> dict[str, str]:
    """PING_GROUPS, or in a user namespace the host gids of its map (written from the host, they
    are read back so by CRIU's dump, which maps them into the namespace for its restore; a gid
    outside the map, as 2147483647, fails the clone's restore with EINVAL)."""
    shift = rec.fs.rootfs.shift if rec.fs is not None else 0
    return {"ipv4/ping_group_range": f"{shift} {shift + idmap.SIZE - 1}"} if shift else PING_GROUPS


class NetworkPart(Part):
    name = "network"
    probes = (check_netlink, check_nftables)

    def prepare(self, b: Build) -> None:
        rec = b.rec
        assert rec.process is not None
        rec.network = setup(rec.id, rec.process.pid, rec.spec.network, nat=rec.spec.nat, egress_spec=rec.spec.egress,
                            block_private=rec.spec.block_private, isolated=rec.spec.port_isolation)
        sysctls_in(rec.process.pid, ping_groups(rec))

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
            groups = ping_groups(b.rec)
            b.pre_resume.append(lambda pids: sysctls_in(pids[0], groups) if pids else None)
            return
        source, flows = captured
        # Recorded as soon as its rules exist, so that a failed fork's release removes them too.
        spec = b.rec.spec
        b.rec.network = net = setup_clone(b.rec.id, source, flows, spec.egress, spec.block_private, spec.port_isolation)
        assert net.host_if is not None
        # CRIU makes the pair, eth0 inside as the source had it and the host end named. In a user
        # namespace it does so through usernsd, which makes eth0 in the clone's namespace
        # directly (criu/patches/0012); moving a device made on the host in instead waits
        # out an rcu_barrier(), 12-32 ms of every restore here.
        b.criu_external.append(f"veth[eth0]:{net.host_if}")

        def finish(pids: list[int]) -> None:
            # Every task is still stopped: the link goes up, and the inherited connections are
            # aborted inside the clone (their RSTs die in the host's raw table) before any runs.
            # IPv6 stays off and ping open inside, whatever the restored namespace says.
            if pids:
                sysctls_in(pids[0], {**NS_IPV6_OFF, **ping_groups(b.rec)})
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
