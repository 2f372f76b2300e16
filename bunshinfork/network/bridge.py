"""Bridged workspaces: a veth per workspace on the host bridge `bunshin0`, over netlink (pyroute2).

The host end (`bn` + 10 hex of the id) is a port of `bunshin0`, which holds the gateway
address .1 of the subnet (10.213.0.0/16 or $BUNSHIN_SUBNET); the other end is `eth0` inside
the workspace, with a free address of the subnet and a default route via the gateway.

The bridge, the veths and the NAT table are host-wide while workspace records live under a
state root that tests and tools may point elsewhere (BUNSHIN_RUN_ROOT). So every host veth
also carries its owner in its interface alias (`bunshin ws=ID ip=ADDR nat=0|1`): allocation,
NAT refcounting and gc read that as well as the records, and the kernel drops the entry by
itself when the workspace's netns dies.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import os
import re
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute, NetlinkError

from .. import state
from ..errors import NetworkError
from ..host import DEFAULT_SUBNET, HOST, SUBNET_ENV
from ..state import NetworkState, Status
from . import clones, egress, guard, proxies
from .nat import NAT_FAMILY, NAT_TABLE, ensure_nat, nft_available, remove_nat
from .nsock import Flow, sysctls_in

BRIDGE = HOST.bridge
WS_IFNAME = "eth0"
HOST_IF_PREFIX = "bn"
_HOST_IF = re.compile(r"^bn[0-9a-f]{10}$")
_WS_ID = re.compile(r"^ws-([0-9a-f]{12})$")
_ALIAS_TAG = "bunshin"
# Host-wide, not under the (relocatable) state root: the resources it guards are host-wide.
_LOCK_NAME = "bunshin-network"
_LOCK_DIR = Path("/run")


# ---- names and addresses ----

def host_ifname(ws_id: str) -> str:
    """The host end of a workspace's veth: `bn` + 10 hex characters (IFNAMSIZ is 15 with the NUL)."""
    m = _WS_ID.match(ws_id)
    tail = m.group(1)[:10] if m else hashlib.sha256(ws_id.encode()).hexdigest()[:10]
    return HOST_IF_PREFIX + tail


def subnet() -> ipaddress.IPv4Network:
    """The workspace subnet: $BUNSHIN_SUBNET, else 10.213.0.0/16."""
    raw = os.environ.get(SUBNET_ENV, "").strip() or DEFAULT_SUBNET
    try:
        net = ipaddress.ip_network(raw, strict=False)
    except ValueError:
        raise NetworkError(
            f"{SUBNET_ENV}={raw!r} is not a network; set it to an IPv4 CIDR such as {DEFAULT_SUBNET} "
            "or unset it"
        ) from None
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 30:
        raise NetworkError(
            f"{SUBNET_ENV}={raw!r} must be an IPv4 network of /30 or larger (gateway plus one workspace), "
            f"such as {DEFAULT_SUBNET}"
        )
    return net


def _gateway(net: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    return net.network_address + 1


# IPv6 is off on the workspace side of every link, and on `default` so that no interface made
# later comes up with it; loopback keeps ::1. The host ends and the bridge have it off too: a
# link-local address there is a host address that no IPv4 rule covers.
NS_IPV6_OFF = {"ipv6/conf/default/disable_ipv6": "1", f"ipv6/conf/{WS_IFNAME}/disable_ipv6": "1"}


def host_ipv6_off(ifname: str) -> None:
    """Turn IPv6 off on a host interface (before it goes up: no link-local address is ever made).
    Per interface, it goes with the interface; nothing to do in a kernel without IPv6."""
    with contextlib.suppress(FileNotFoundError):
        Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6").write_text("1")


def ns_ipv6_off(init_pid: int) -> None:
    """IPv6 off inside a workspace: `default`, and eth0 where it exists already (a clone's)."""
    sysctls_in(init_pid, NS_IPV6_OFF)


def _lock() -> contextlib.AbstractContextManager[None]:
    return state.lock(_LOCK_NAME, root=_LOCK_DIR)


# ---- who holds what ----

@dataclass(frozen=True)
class _HostVeth:
    name: str
    index: int
    owner: str | None  # workspace id from the alias; None for a veth bunshin did not label
    ip: str | None
    nat: bool
    peer_elsewhere: bool  # the other end lives in another netns (a workspace's, normally)
    zone: int | None = None  # a clone's (clones.py)
    snat: str | None = None


def _host_veths(ipr: IPRoute) -> list[_HostVeth]:
    out = []
    for link in ipr.get_links():
        name = str(link.get("ifname"))
        if not _HOST_IF.match(name) or _link_kind(link) != "veth":
            continue
        fields = _parse_alias(str(link.get("ifalias") or ""))
        out.append(_HostVeth(
            name=name, index=link["index"], owner=fields.get("ws"), ip=fields.get("ip"),
            nat=fields.get("nat") == "1", peer_elsewhere=link.get("link_netnsid") is not None,
            zone=int(fields["zone"]) if fields.get("zone", "").isdigit() else None, snat=fields.get("snat"),
        ))
    return out


def _parse_alias(alias: str) -> dict[str, str]:
    words = alias.split()
    if not words or words[0] != _ALIAS_TAG:
        return {}
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


def _records() -> dict[str, tuple[NetworkState, bool]]:
    """ws id -> (network state, alive) for every workspace record under the state root that has one."""
    out: dict[str, tuple[NetworkState, bool]] = {}
    for rec in state.records():
        if rec.network is None:
            continue
        out[rec.id] = (rec.network, alive(rec))
    return out


def alive(rec: state.Record) -> bool:
    if rec.status is Status.RUNNING:
        return rec.init_alive()
    if rec.status is Status.CREATING:
        return rec.creator_alive()
    return False


def _allocate(net: ipaddress.IPv4Network, taken: set[str]) -> ipaddress.IPv4Address:
    gateway = _gateway(net)
    for addr in net.hosts():
        if addr != gateway and str(addr) not in taken:
            return addr
    raise NetworkError(
        f"no free address left in {net} ({len(taken)} workspaces hold one); destroy workspaces, "
        f"run 'bunshin gc', or set {SUBNET_ENV} to a larger network"
    )


def _taken_addresses(records: dict[str, tuple[NetworkState, bool]], veths: list[_HostVeth],
                     ws_id: str) -> set[str]:
    """Workspace addresses and clones' source-NAT addresses in use or reserved."""
    # Dead records keep their address until gc: their veth may still be on its way out.
    taken = {a for i, (n, _) in records.items() if i != ws_id for a in (n.ip, n.snat) if a}
    taken |= {a for v in veths if v.owner != ws_id for a in (v.ip, v.snat) if a}
    if nft_available():
        taken |= {snat for i, (_, snat) in clones.reservations().items() if i != ws_id and snat}
    return taken


# ---- netlink helpers ----

def _lookup(ipr: IPRoute, name: str) -> int | None:
    found = ipr.link_lookup(ifname=name)
    return found[0] if found else None


def _link_kind(link: Any) -> str | None:
    kind = link.get(("linkinfo", "kind"))
    return str(kind) if kind is not None else None


def _delete_index(ipr: IPRoute, index: int, name: str) -> bool:
    """Delete the link; False if it was already gone."""
    try:
        ipr.link("del", index=index)
    except NetlinkError as e:
        # A dying netns takes the veth pair with it in the background; losing that race is success.
        if e.code == errno.ENODEV:
            return False
        raise NetworkError(f"cannot delete interface {name}: {e}; run 'bunshin gc' as root to retry") from e
    return True


def _netlink_failure(what: str, e: NetlinkError) -> NetworkError:
    if e.code in (errno.EOPNOTSUPP, errno.EAFNOSUPPORT):
        hint = "the kernel lacks bridge or veth support (CONFIG_BRIDGE, CONFIG_VETH); use network='none'"
    elif e.code == errno.EPERM:
        hint = "run as root with CAP_NET_ADMIN"
    elif e.code == errno.EEXIST:
        hint = "a leftover interface is in the way; run 'bunshin gc'"
    else:
        hint = "see 'bunshin doctor'"
    return NetworkError(f"{what}: {e.args[-1] if e.args else e}; {hint}")


def _bridge_mac() -> str:
    # A fixed, locally administered MAC: otherwise the bridge takes the lowest port MAC and
    # changes it whenever a workspace comes or goes, breaking the other workspaces' ARP
    # entry for the gateway.
    return "02:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(5))


def _ws_mac() -> str:
    """A workspace's eth0 MAC: locally administered unicast, chosen before the link exists."""
    return "02:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(5))


def _ensure_bridge(ipr: IPRoute, net: ipaddress.IPv4Network, in_use: bool) -> int:
    """The bridge's index, creating it and (re)addressing it as needed.

    in_use: live workspaces are attached, so an address of another subnet must not be replaced.
    """
    gateway = str(_gateway(net))
    idx = _lookup(ipr, BRIDGE)
    if idx is None:
        _check_overlap(ipr, net, None)
        try:
            ipr.link("add", ifname=BRIDGE, kind="bridge", address=_bridge_mac())
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise _netlink_failure(f"cannot create bridge {BRIDGE}", e) from e
        idx = _lookup(ipr, BRIDGE)
        if idx is None:
            raise NetworkError(f"bridge {BRIDGE} vanished right after creation; is another tool removing it?")
    else:
        kind = _link_kind(ipr.get_links(idx)[0])
        if kind != "bridge":
            raise NetworkError(
                f"host interface {BRIDGE} exists but is a {kind or 'non-bridge'} device; delete it "
                "(it is not bunshin's) or run bunshin on a host where that name is free"
            )
    have = {(a.get("address"), a["prefixlen"]) for a in ipr.get_addr(index=idx, family=socket.AF_INET)}
    if (gateway, net.prefixlen) not in have:
        _check_overlap(ipr, net, idx)
        if have and in_use:
            old = ", ".join(f"{a}/{p}" for a, p in sorted(have))
            raise NetworkError(
                f"bridge {BRIDGE} serves {old} for running workspaces but {SUBNET_ENV} asks for {net}; "
                "use the same subnet, or destroy those workspaces and run 'bunshin gc' first"
            )
        try:
            for addr, plen in have:
                ipr.addr("del", index=idx, address=addr, prefixlen=plen)
            ipr.addr("add", index=idx, address=gateway, prefixlen=net.prefixlen)
        except NetlinkError as e:
            what = f"cannot give {BRIDGE} the gateway address {gateway}/{net.prefixlen}"
            raise _netlink_failure(what, e) from e
    host_ipv6_off(BRIDGE)
    ipr.link("set", index=idx, state="up")
    return idx


def _check_overlap(ipr: IPRoute, net: ipaddress.IPv4Network, bridge_idx: int | None) -> None:
    """Refuse a subnet that another host interface already uses: its traffic would be hijacked."""
    for a in ipr.get_addr(family=socket.AF_INET):
        if a["index"] == bridge_idx:
            continue
        other = ipaddress.ip_interface(f"{a.get('address')}/{a['prefixlen']}").network
        if other.overlaps(net):
            ifname = a.get("label") or f"index {a['index']}"
            raise NetworkError(
                f"workspace subnet {net} overlaps {other} on host interface {ifname}; "
                f"set {SUBNET_ENV} to an unused private range"
            )


@contextlib.contextmanager
def _netns_fd(init_pid: int) -> Iterator[int]:
    try:
        fd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetworkError(f"workspace init {init_pid} is gone; its network cannot be set up") from None
    try:
        own = os.stat("/proc/self/ns/net")
        theirs = os.fstat(fd)
        if (own.st_dev, own.st_ino) == (theirs.st_dev, theirs.st_ino):
            # Plumbing "eth0" into our own netns would rewire the host.
            raise NetworkError(
                f"process {init_pid} shares this process's network namespace; a workspace needs its own "
                "(CLONE_NEWNET), so this is a bug in the caller"
            )
        yield fd
    finally:
        os.close(fd)


def _nat_in_use(ipr: IPRoute, exclude: str) -> bool:
    if any(v.nat and v.owner != exclude for v in _host_veths(ipr)):
        return True
    return any(alive and n.nat for i, (n, alive) in _records().items() if i != exclude)


# ---- public API ----

def _policy(raw: object) -> egress.EgressPolicy | None:
    policy = egress.parse(raw)
    return None if policy is None or not (policy.allow_out or policy.deny_out) else policy


def _proxy(ws_id: str, policy: egress.EgressPolicy, gateway: str | None) -> tuple[str, int] | None:
    """Start the workspace's domain-rule proxy if its policy needs one: (address, port)."""
    if not policy.needs_proxy:
        return None
    assert gateway is not None
    return gateway, proxies.start(ws_id, policy.domains, gateway)


def setup(ws_id: str, init_pid: int, mode: str, nat: bool = False, egress_spec: object = None,
          block_private: bool = False, isolated: bool = False) -> NetworkState:
    """Give the workspace whose init is `init_pid` its network; the result goes into its record.
    block_private: refuse the private ranges beyond the workspaces' subnet; isolated: no other
    workspace reaches it, it reaches none (guard.py)."""
    if mode == "none":
        if nat:
            raise NetworkError("nat=True needs network='bridge'")
        return NetworkState("none")
    if mode == "bridge":
        return _setup_bridge(ws_id, init_pid, nat, _policy(egress_spec), block_private, isolated)
    raise NetworkError(f"unknown network mode {mode!r}; use 'none' or 'bridge'")


def _setup_bridge(ws_id: str, init_pid: int, nat: bool, policy: egress.EgressPolicy | None,
                  block_private: bool, isolated: bool) -> NetworkState:
    net = subnet()
    host_if = host_ifname(ws_id)
    with _lock(), _netns_fd(init_pid) as nsfd, IPRoute() as ipr:
        records = _records()
        veths = _host_veths(ipr)
        in_use = any(v.peer_elsewhere for v in veths) or any(
            alive and n.mode == "bridge" for i, (n, alive) in records.items() if i != ws_id
        )
        br_idx = _ensure_bridge(ipr, net, in_use)
        ip = _allocate(net, _taken_addresses(records, veths, ws_id))
        result = NetworkState(mode="bridge", bridge=BRIDGE, host_if=host_if, ip=str(ip),
                              prefixlen=net.prefixlen, gateway=str(_gateway(net)), nat=bool(nat))
        try:
            # Before the link exists: nothing can leave ahead of the guard and the policy.
            mac = _ws_mac()
            guard.install(guard.Guard(ws_id, host_if, str(ip), net, BRIDGE, mac, block_private, isolated))
            if policy is not None:
                egress.install(ws_id, policy, host_if, str(ip), BRIDGE, _proxy(ws_id, policy, result.gateway))
            # Before eth0 exists: it is born with IPv6 off.
            ns_ipv6_off(init_pid)
            _plumb(ipr, nsfd, ws_id, result, br_idx, mac)
            if nat:
                ensure_nat(net)
        except BaseException:
            with contextlib.suppress(Exception):
                guard.remove({ws_id})
            with contextlib.suppress(Exception):
                if policy is not None:
                    egress.remove({ws_id})
                    proxies.stop(ws_id)
            with contextlib.suppress(Exception):
                idx = _lookup(ipr, host_if)
                if idx is not None:
                    _delete_index(ipr, idx, host_if)
            with contextlib.suppress(Exception):
                if nat and not _nat_in_use(ipr, exclude=ws_id):
                    remove_nat()
            raise
    return result


def _plumb(ipr: IPRoute, nsfd: int, ws_id: str, net: NetworkState, br_idx: int, mac: str) -> None:
    host_if = net.host_if
    try:
        # The peer is born inside the workspace netns as eth0, so no temporary name ever
        # shows on the host and nothing there can race for it; with the MAC its port's
        # anti-spoofing rules already name.
        ipr.link("add", ifname=host_if, kind="veth", peer={"ifname": WS_IFNAME, "net_ns_fd": nsfd, "address": mac})
    except NetlinkError as e:
        raise _netlink_failure(f"cannot create veth {host_if}", e) from e
    idx = _lookup(ipr, host_if)
    if idx is None:
        raise NetworkError(f"veth {host_if} vanished right after creation; did the workspace die?")
    alias = f"{_ALIAS_TAG} ws={ws_id} ip={net.ip} nat={int(net.nat)}"
    host_ipv6_off(host_if)
    try:
        ipr.link("set", index=idx, ifalias=alias)
        ipr.link("set", index=idx, master=br_idx, state="up")
    except NetlinkError as e:
        raise _netlink_failure(f"cannot attach {host_if} to {BRIDGE}", e) from e
    try:
        # flags=0: never let pyroute2 create a netns should the init have died meanwhile.
        with IPRoute(netns=nsfd, flags=0) as ns:
            ws_idx = _lookup(ns, WS_IFNAME)
            if ws_idx is None:
                raise NetworkError(f"{WS_IFNAME} did not appear inside the workspace; did the workspace die?")
            ns.addr("add", index=ws_idx, address=net.ip, prefixlen=net.prefixlen)
            ns.link("set", index=ws_idx, state="up")
            ns.route("add", dst="0.0.0.0/0", gateway=net.gateway)
    except NetlinkError as e:
        raise _netlink_failure(f"cannot configure {WS_IFNAME} inside the workspace", e) from e


def setup_clone(ws_id: str, source: NetworkState, flows: list[Flow], egress_spec: object = None,
                block_private: bool = False, isolated: bool = False) -> NetworkState:
    """Reserve a clone's zone and source-NAT address and install its host rules, before CRIU
    restores it (the veth `veth[eth0]:<host_if>` is CRIU's to create; link_up finishes it)."""
    assert source.ip is not None and source.prefixlen is not None
    net = ipaddress.ip_network(f"{source.ip}/{source.prefixlen}", strict=False)
    assert isinstance(net, ipaddress.IPv4Network)
    host_if = host_ifname(ws_id)
    with _lock(), IPRoute() as ipr:
        records = _records()
        veths = _host_veths(ipr)
        zones = {z for z, _ in clones.reservations().values()}
        zones |= {n.zone for n, _ in records.values() if n.zone} | {v.zone for v in veths if v.zone}
        result = NetworkState(mode="bridge", host_if=host_if, ip=source.ip, prefixlen=source.prefixlen,
                              gateway=source.gateway, nat=source.nat, zone=clones.allocate_zone(zones),
                              snat=str(_allocate(net, _taken_addresses(records, veths, ws_id) | {source.ip})))
        try:
            if result.nat:
                ensure_nat(net)
            clones.install(ws_id, host_if, result, net, flows)
            assert result.zone is not None
            clones.rule_up(ipr, result.zone)  # the socket setup_clone holds
            guard.install(guard.Guard(ws_id, host_if, source.ip, net, None, None, block_private, isolated))
            if (policy := _policy(egress_spec)) is not None:
                # The clone's own proxy (its own port: the clones' connections, one inside
                # address for all, stay distinct flows after the redirect).
                egress.install(ws_id, policy, host_if, source.ip, None, _proxy(ws_id, policy, result.gateway))
        except BaseException:
            with contextlib.suppress(Exception):
                clones.remove({ws_id})
            with contextlib.suppress(Exception):
                clones.rules_down({result.zone} if result.zone else set())
            with contextlib.suppress(Exception):
                guard.remove({ws_id})
            with contextlib.suppress(Exception):
                egress.remove({ws_id})
            with contextlib.suppress(Exception):
                proxies.stop(ws_id)
            with contextlib.suppress(Exception):
                if result.nat and not _nat_in_use(ipr, exclude=ws_id):
                    remove_nat()
            raise
    return result


def set_egress(ws_id: str, net: NetworkState | None, egress_spec: object) -> None:
    """Replace a running workspace's egress rules by `egress_spec` (a spec's egress), under the
    lock that setup and teardown hold, so that its rules never race their removal."""
    policy = _policy(egress_spec)
    if net is None or net.mode != "bridge" or (policy is None and not nft_available()):
        return  # no link to hold, or no rules: none was ever installed without nftables
    with _lock():
        # Domain rules live in the proxy's arguments: a new policy gets a proxy of its own,
        # started before its rules point at it, and the old one stops once its rules are gone.
        old = proxies.pids(ws_id)
        proxy = _proxy(ws_id, policy, net.gateway) if policy is not None else None
        try:
            egress.replace(ws_id, net, policy, proxy)
        except BaseException:
            proxies.stop_pids(proxies.pids(ws_id) - old)
            raise
        proxies.stop_pids(old)


def clone_link_up(ws_id: str, net: NetworkState) -> None:
    """The clone's host end, made by CRIU's restore: labelled, addressed, routed, up."""
    assert net.host_if is not None
    alias = f"{_ALIAS_TAG} ws={ws_id} ip={net.ip} nat={int(net.nat)} zone={net.zone} snat={net.snat}"
    clones.link_up(net.host_if, alias, net)


def teardown(ws_id: str, record: NetworkState | None) -> None:
    """Undo setup(). Idempotent: what is already gone is fine.

    No record (setup never returned: the creator crashed or setup failed) still removes
    a veth labelled with this workspace's id.
    """
    if record is not None and record.mode != "bridge":
        return
    host_if = (record.host_if if record is not None else None) or host_ifname(ws_id)
    with _lock(), IPRoute() as ipr:
        mine = [v for v in _host_veths(ipr) if v.name == host_if]
        for v in mine:
            # Another workspace's label means a name collision: that veth is not ours to remove.
            if v.owner == ws_id or (record is not None and v.owner is None):
                _delete_index(ipr, v.index, v.name)
        zones = {z for z in [record.zone if record is not None else None] + [v.zone for v in mine] if z}
        if zones or (record is None and nft_available()):
            clones.remove({ws_id})
            clones.rules_down(zones)
        if nft_available():
            guard.remove({ws_id})
            egress.remove({ws_id})
        proxies.stop(ws_id)
        nat = (record is not None and record.nat) or any(v.nat and v.owner == ws_id for v in mine)
        if nat and not _nat_in_use(ipr, exclude=ws_id):
            remove_nat()


def leftover_interfaces() -> list[str]:
    """Every workspace host veth currently present (used by gc and the leak checks)."""
    with IPRoute() as ipr:
        return sorted(v.name for v in _host_veths(ipr))


def gc() -> list[str]:
    """Remove workspace veths no live workspace owns; the bridge and NAT table once none needs them.

    A veth whose other end still sits in another network namespace and whose owner has no
    record under this state root is kept: it may belong to a workspace of another state root.
    Returns what was removed: interface names, and `ip bunshin_nat` for the NAT table.
    """
    removed: list[str] = []
    with _lock(), IPRoute() as ipr:
        records = _records()
        live = {i: n for i, (n, alive) in records.items() if alive and n.mode == "bridge"}
        keep = {n.host_if or host_ifname(i) for i, n in live.items()}
        remaining: list[_HostVeth] = []
        for v in _host_veths(ipr):
            known_dead = v.owner is not None and v.owner in records and v.owner not in live
            orphan = v.name not in keep and (known_dead or not v.peer_elsewhere)
            if orphan and _delete_index(ipr, v.index, v.name):
                removed.append(v.name)
            elif not orphan:
                remaining.append(v)
        if nft_available():
            # A veth kept above may be a live workspace of another state root: its rules stay
            # too (a guard removed from under a running workspace would let it reach the host).
            live_ids = {rec.id for rec in state.records() if alive(rec)} | {v.owner for v in remaining if v.owner}
            removed += [f"{clones.FAMILY} {clones.TABLE} ws={w}" for w in clones.remove(keep=live_ids)]
            removed += clones.rules_down(keep={n.zone for n in live.values() if n.zone})
            removed += [f"{egress.FAMILY} {egress.TABLE} ws={w}" for w in egress.remove(keep=live_ids)]
            removed += [f"{guard.FAMILY} {guard.TABLE} ws={w}" for w in guard.remove(keep=live_ids)]
        removed += proxies.gc({rec.id for rec in state.records() if alive(rec)})
        nat_needed = any(v.nat for v in remaining) or any(n.nat for n in live.values())
        # Without the binding no NAT table can have been made, and gc must still work.
        if not nat_needed and nft_available() and remove_nat():
            removed.append(f"{NAT_FAMILY} {NAT_TABLE}")
        br = _lookup(ipr, BRIDGE)
        if br is not None and not live and _link_kind(ipr.get_links(br)[0]) == "bridge":
            # Any port still attached (another root's workspace, or something an admin added)
            # keeps the bridge.
            ports = [link for link in ipr.get_links() if link.get("master") == br]
            if not ports and _delete_index(ipr, br, BRIDGE):
                removed.append(BRIDGE)
    return removed
