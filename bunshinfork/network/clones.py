"""A bridged workspace's clones: each on its own routed link, told apart by conntrack zone.

Every clone keeps its source's eth0, address, MAC, routes and resolv.conf (CRIU restores the
namespace as it was), so the host sees N workspaces with one inside address. They cannot
share the bridge (ARP would collide), so each clone's host veth `bn<id>` is a point-to-point
link of its own, off the bridge, and the host keeps them apart by:

- conntrack zone (original direction only): `iifname bn<id> ct original zone set Z` before
  conntrack, so that identical tuples of two clones are two flows; replies are looked up in
  the default zone, where the NAT below made them unique;
- source NAT to a unique address of the subnet (`snat`), allocated like a workspace address:
  for non-NAT workspaces every forwarded packet, for NAT ones only traffic into the subnet
  (the rest is masqueraded by nat.py's rule, which picks unique ports across zones);
- a mark per clone on its connections (ct mark), copied onto their reply packets (fwmark),
  and an ip rule sending that mark to the clone's own routing table (`default dev bn<id>`):
  replies, de-NATed back to the shared inside address, are routed by mark, not by address;
- proxy ARP and the gateway address on bn<id>: the clone still thinks it sits on the subnet.

Connections the source had to peers outside the workspace are recorded at capture (the
frozen netns's TCP table). Each clone's host link drops every packet of those 4-tuples in
the raw table, installed before CRIU restores the clone (and before TCP repair mode ends,
when the kernel sends its first window probe), and the clone's copies are destroyed inside
its namespace before its tasks resume (nsock.destroy_tcp). The peer only ever sees the
source's flow and each clone's new ones.

All rules live in one nftables table, `ip bunshin_fork`, each commented
`bunshin ws=ID zone=Z snat=ADDR`: the comments are also the reservation of zones and
addresses while the clone's veth does not exist yet, and what gc and the census read.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute, NetlinkError

from ..errors import NetworkError
from ..state import NetworkState
from .nsock import Flow

FAMILY = "ip"
TABLE = "bunshin_fork"
CAPTURE_FILE = "network.json"
ZONES = range(1, 65536)
MARK_BASE = 0x62000000  # fwmark and routing table of zone Z: MARK_BASE | Z
RULE_PRIORITY = 10213
_LISTEN, _TIME_WAIT, _CLOSE = 0x0A, 0x06, 0x07


def mark(zone: int) -> int:
    return MARK_BASE | zone


# ---- capture ----

def _hex_addr(field: str) -> tuple[str, int]:
    addr, port = field.split(":")
    return str(ipaddress.IPv4Address(bytes.fromhex(addr)[::-1])), int(port, 16)


def external_flows(init_pid: int, ws_ip: str | None) -> list[Flow]:
    """The TCP connections of the workspace's netns whose peer is outside it."""
    flows = []
    with open(f"/proc/{init_pid}/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if int(cols[3], 16) in (_LISTEN, _TIME_WAIT, _CLOSE):
                continue
            src, sport = _hex_addr(cols[1])
            dst, dport = _hex_addr(cols[2])
            if ipaddress.IPv4Address(dst).is_loopback or dst in (ws_ip, src, "0.0.0.0"):
                continue
            flows.append(Flow(src, sport, dst, dport))
    return flows


def save_capture(snap_dir: Path, net: NetworkState, flows: list[Flow]) -> None:
    data = {"mode": net.mode, "ip": net.ip, "prefixlen": net.prefixlen, "gateway": net.gateway,
            "bridge": net.bridge, "nat": net.nat, "external": [f.as_list() for f in flows]}
    (snap_dir / CAPTURE_FILE).write_text(json.dumps(data))


def load_capture(snap_dir: Path) -> tuple[NetworkState, list[Flow]] | None:
    try:
        data = json.loads((snap_dir / CAPTURE_FILE).read_text())
    except FileNotFoundError:
        return None
    net = NetworkState(mode=data["mode"], bridge=data.get("bridge"), ip=data["ip"], prefixlen=data["prefixlen"],
                       gateway=data["gateway"], nat=bool(data["nat"]))
    return net, [Flow(str(a), int(b), str(c), int(d)) for a, b, c, d in data["external"]]


# ---- nftables ----

def _nft_text(text: str) -> None:
    from .nat import nft_cmd
    rc, _, err = nft_cmd(text)
    if rc != 0:
        raise NetworkError(f"nftables refused the clone rules: {str(err).strip()[:300]}; is nf_tables with "
                           "conntrack zones and NAT in the kernel? see 'bunshin doctor'")


def _nft_json(cmd: dict[str, Any]) -> dict[str, Any]:
    from .nat import nft_json
    return nft_json([cmd])


def table_rules() -> list[dict[str, Any]]:
    """The clone rules in nftables JSON form; [] when the table is absent."""
    tables = _nft_json({"list": {"tables": {"family": FAMILY}}}).get("nftables", [])
    if not any(t.get("table", {}).get("name") == TABLE for t in tables):
        return []
    out = _nft_json({"list": {"table": {"family": FAMILY, "name": TABLE}}})
    return [item["rule"] for item in out.get("nftables", []) if "rule" in item]


def _comment_fields(rule: dict[str, Any]) -> dict[str, str]:
    words = str(rule.get("comment") or "").split()
    if not words or words[0] != "bunshin":
        return {}
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


def reservations() -> dict[str, tuple[int, str]]:
    """ws id -> (zone, snat address) of every clone that has rules."""
    out: dict[str, tuple[int, str]] = {}
    for r in table_rules():
        f = _comment_fields(r)
        if "ws" in f and "zone" in f:
            out[f["ws"]] = (int(f["zone"]), f.get("snat", ""))
    return out


def install(ws_id: str, host_if: str, net: NetworkState, subnet: ipaddress.IPv4Network, flows: list[Flow]) -> None:
    """The clone's rules, in one transaction: drop its inherited flows, zone, mark, source NAT."""
    assert net.zone is not None and net.snat is not None
    zone, m = net.zone, mark(net.zone)
    c = f'comment "bunshin ws={ws_id} zone={zone} snat={net.snat}"'
    iif = f'iifname "{host_if}"'
    lines = [
        f"add table {FAMILY} {TABLE}",
        f"add chain {FAMILY} {TABLE} raw {{ type filter hook prerouting priority raw; policy accept; }}",
        f"add chain {FAMILY} {TABLE} mangle {{ type filter hook prerouting priority mangle; policy accept; }}",
        f"add chain {FAMILY} {TABLE} out {{ type route hook output priority mangle; policy accept; }}",
        f"add chain {FAMILY} {TABLE} postnat {{ type nat hook postrouting priority 99; policy accept; }}",
    ]
    for fl in flows:
        lines.append(f"add rule {FAMILY} {TABLE} raw {iif} ip saddr {fl.src} ip daddr {fl.dst} "
                     f"tcp sport {fl.sport} tcp dport {fl.dport} drop {c}")
    lines += [
        f"add rule {FAMILY} {TABLE} raw {iif} ct original zone set {zone} {c}",
        f"add rule {FAMILY} {TABLE} mangle {iif} ct direction original ct mark set {m:#x} {c}",
        # Only replies are routed by the mark: the clone's own packets go by the main table.
        f"add rule {FAMILY} {TABLE} mangle ct direction reply ct mark {m:#x} meta mark set {m:#x} {c}",
        f"add rule {FAMILY} {TABLE} out ct direction reply ct mark {m:#x} meta mark set {m:#x} {c}",
    ]
    scope = f"ip daddr {subnet} " if net.nat else ""
    lines.append(f"add rule {FAMILY} {TABLE} postnat {iif} {scope}snat to {net.snat} {c}")
    _nft_text("\n".join(lines) + "\n")


def remove(owners: set[str] | None = None, keep: set[str] | None = None) -> list[str]:
    """Delete the rules of the clones in `owners` (every clone but those in `keep` when None),
    and the table once empty. Returns the owners whose rules went."""
    rules = table_rules()
    gone: set[str] = set()
    deletes = []
    for r in rules:
        ws = _comment_fields(r).get("ws")
        if ws is None or (owners is not None and ws not in owners) or (keep is not None and ws in keep):
            continue
        gone.add(ws)
        deletes.append({"delete": {"rule": {"family": FAMILY, "table": TABLE, "chain": r["chain"],
                                            "handle": r["handle"]}}})
    if deletes:
        from .nat import nft_json
        nft_json(deletes)
    if rules and len(deletes) == len(rules):
        _nft_json({"delete": {"table": {"family": FAMILY, "name": TABLE}}})
    return sorted(gone)


def allocate_zone(taken: set[int]) -> int:
    for z in ZONES:
        if z not in taken:
            return z
    raise NetworkError(f"every conntrack zone ({len(ZONES)}) is held by a clone; destroy clones or run 'bunshin gc'")


# ---- routing ----

def _sysctl(host_if: str, key: str, value: str) -> None:
    Path(f"/proc/sys/net/ipv4/conf/{host_if}/{key}").write_text(value)


def link_up(host_if: str, alias: str, net: NetworkState) -> None:
    """Bring the clone's host end up as its own routed segment (see the module docstring)."""
    assert net.zone is not None and net.gateway is not None
    m = mark(net.zone)
    try:
        idx = socket.if_nametoindex(host_if)  # an ioctl, where a netlink lookup dumps every link
    except OSError:
        raise NetworkError(f"the clone's veth {host_if} is missing after its restore") from None
    try:
        with IPRoute() as ipr:
            _sysctl(host_if, "proxy_arp", "1")
            _sysctl(host_if, "rp_filter", "0")
            # Before it goes up: no link-local address, a host address no IPv4 rule covers.
            with contextlib.suppress(FileNotFoundError):
                Path(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6").write_text("1")
            ipr.addr("add", index=idx, address=net.gateway, prefixlen=32)
            ipr.link("set", index=idx, ifalias=alias, state="up")
            ipr.route("add", dst="0.0.0.0/0", oif=idx, table=m)
    except NetlinkError as e:
        raise NetworkError(f"cannot route the clone's link {host_if}: {e}; run 'bunshin gc'") from e


def rule_up(ipr: IPRoute, zone: int) -> None:
    """The ip rule sending the clone's marked replies to its own table, made before its restore:
    it names no device, and every step taken then is one fewer while the clone's tasks wait."""
    m = mark(zone)
    try:
        ipr.rule("add", family=socket.AF_INET, priority=RULE_PRIORITY, fwmark=m, table=m)
    except NetlinkError as e:
        raise NetworkError(f"cannot add the clone's ip rule for zone {zone}: {e}; run 'bunshin gc'") from e


def rules_down(zones: set[int] | None = None, keep: set[int] | None = None) -> list[str]:
    """Delete the clones' ip rules (the tables' routes go with their veths). Returns them by mark."""
    removed = []
    with IPRoute() as ipr:
        for r in ipr.get_rules(family=socket.AF_INET):
            if r.get("priority") != RULE_PRIORITY:
                continue
            fwmark = r.get("fwmark") or 0
            zone = fwmark & ~MARK_BASE if fwmark & MARK_BASE == MARK_BASE else None
            if zone is None or (zones is not None and zone not in zones) or (keep is not None and zone in keep):
                continue
            with contextlib.suppress(NetlinkError):
                ipr.rule("del", family=socket.AF_INET, priority=RULE_PRIORITY, fwmark=fwmark, table=fwmark)
                removed.append(f"rule fwmark {fwmark:#x}")
    return removed


def leftover_rules() -> set[str]:
    """The clones' ip rules present now (the census)."""
    with IPRoute() as ipr:
        return {f"rule fwmark {(r.get('fwmark') or 0):#x}" for r in ipr.get_rules(family=socket.AF_INET)
                if r.get("priority") == RULE_PRIORITY}
