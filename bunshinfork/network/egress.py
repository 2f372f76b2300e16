"""Egress policy: what a bridged workspace may reach, with E2B's semantics, enforced on the host.

    WorkspaceSpec(network="bridge", egress={"allow_out": [...], "deny_out": [...]})

- deny_out: IPv4 CIDRs (or addresses); allow_out: CIDRs, and domain names (below);
- a destination in allow_out is allowed whatever deny_out says (allow wins);
- else one in deny_out is rejected; everything else is allowed (no allow_out: all not denied);
- "closed" is deny_out=["0.0.0.0/0"]: nothing leaves the workspace (bunshinrl's speculation).

A rejected connection is refused at once: TCP gets a reset, anything else an ICMP
admin-prohibited, never a silent drop into a timeout. The rules live in the host's nftables
(table `ip bunshin_egress`, forward and input hooks, so the host's own services count as
outside too), matched on the workspace's host veth (a clone's own link) or on its address
behind the bridge, where a bridge-family rule drops frames from its port with any other
source address: nothing inside the workspace, root included, can lift them. Between two ports
of the bridge (whose frames the ip family sees only when br_netfilter's bridge-nf-call-iptables
is on) the bridge family holds the policy too, dropping new connections. Clones inherit
their source's policy (it is part of the spec) on their own links. Every reject rule counts
what it refused (refused()).

Domain names in allow_out ("pypi.org", "*.github.com": any subdomain, not the apex) are matched
on the HTTP Host header (port 80) and the TLS SNI (port 443) by a proxy of the workspace's own
on the host (sniproxy.py, started by proxies.py; a clone gets its own, so clones inherit
the rules and their flows stay apart although they share one inside address):

- only when deny_out is not empty (otherwise everything is allowed already);
- a chain `proxy` (nat prerouting) redirects the workspace's new TCP connections to ports 80
  and 443 of addresses that deny_out covers and allow_out's CIDRs do not, to gateway:<port>
  where its proxy listens; the input chain accepts exactly those redirected connections;
- the proxy reads the first bytes (ClientHello or request head, never decrypting, with a
  deadline), matches the name, resolves it on the host (never with the workspace's DNS) and
  connects to the client's destination if that is one of the name's addresses, else to the
  name's first address: a lying Host or SNI reaches only the allowed name's own servers;
- anything else is reset at once. The TCP handshake has completed with the proxy by then,
  so a denied name reads as ConnectionResetError, where a denied CIDR is refused at connect.

What Host/SNI matching cannot see or decide (docs/network.md says it for users): QUIC/HTTP3
(UDP 443) and every other port follow the CIDR rules only; encrypted ClientHello (ECH) shows
only its outer, public name; a request without a name (an IP literal without Host, TLS without
SNI, HTTP/2 cleartext with prior knowledge) is reset; only a connection's first request is
read, later ones on it go to the same server; and a server that routes by a name inside the
encrypted stream (domain fronting on a CDN) may serve another site than the allowed one.
"""

from __future__ import annotations

from typing import Any

from ..errors import NetworkError
from ..state import NetworkState
from .nat import table_rules
from .policy import ALL_TRAFFIC, CLOSED, E2B_KEYS, E2B_UNSUPPORTED, EgressPolicy, from_e2b, parse

FAMILY = "ip"
TABLE = "bunshin_egress"
BRIDGE_TABLE = "bunshin_egress_ports"
PROXY_CHAIN = "proxy"
PROXY_PORTS = (80, 443)  # HTTP's Host and TLS's SNI
__all__ = ["ALL_TRAFFIC", "CLOSED", "E2B_KEYS", "E2B_UNSUPPORTED", "EgressPolicy", "from_e2b", "parse"]


def _nft_text(text: str) -> None:
    from .nat import nft_cmd
    rc, _, err = nft_cmd(text)
    if rc != 0:
        raise NetworkError(f"nftables refused the egress rules: {str(err).strip()[:300]}")


def _set(items: tuple[str, ...]) -> str:
    return "{ " + ", ".join(items) + " }"


def install(ws_id: str, policy: EgressPolicy, host_if: str, ip: str, bridge: str | None,
            proxy: tuple[str, int] | None = None) -> None:
    """The workspace's egress rules: on its own link (a clone), or by address behind `bridge`
    with its port held to that address (the source). `proxy` (gateway, port): where its
    domain-rule proxy listens, for a policy that needs one."""
    c = f'comment "bunshin ws={ws_id} egress"'
    match = f'iifname "{bridge}" ip saddr {ip}' if bridge else f'iifname "{host_if}"'
    lines = [f"add table {FAMILY} {TABLE}"]
    for hook in ("forward", "input"):
        lines.append(f"add chain {FAMILY} {TABLE} {hook} {{ type filter hook {hook} priority filter; policy accept; }}")
    if proxy is not None:
        gw, port = proxy
        lines.append(f"add chain {FAMILY} {TABLE} {PROXY_CHAIN} {{ type nat hook prerouting priority dstnat; "
                     "policy accept; }")
        # Only what deny_out would refuse is the proxy's to judge: an allowed CIDR or an
        # address not denied goes straight out.
        allowed = f"ip daddr != {_set(policy.allow_out)} " if policy.allow_out else ""
        lines.append(f"add rule {FAMILY} {TABLE} {PROXY_CHAIN} {match} ip daddr {_set(policy.deny_out)} {allowed}"
                     f"tcp dport {_set(tuple(map(str, PROXY_PORTS)))} dnat to {gw}:{port} {c}")
        # The redirected connection arrives at the host's own address, which deny_out may cover.
        lines.append(f"add rule {FAMILY} {TABLE} input {match} ct state new ct status dnat "
                     f"ip daddr {gw} tcp dport {port} accept {c}")
    for hook in ("forward", "input"):
        pre = f"add rule {FAMILY} {TABLE} {hook} {match} ct state new"
        if policy.allow_out:
            lines.append(f"{pre} ip daddr {_set(policy.allow_out)} accept {c}")
        if policy.deny_out:
            lines.append(f"{pre} ip daddr {_set(policy.deny_out)} meta l4proto tcp counter reject with tcp reset {c}")
            lines.append(f"{pre} ip daddr {_set(policy.deny_out)} counter reject with icmp type admin-prohibited {c}")
    if bridge:
        hook = "type filter hook prerouting priority filter; policy accept;"
        lines += [f"add table bridge {BRIDGE_TABLE}", f"add chain bridge {BRIDGE_TABLE} pre {{ {hook} }}",
                  f'add rule bridge {BRIDGE_TABLE} pre iifname "{host_if}" ether type ip ip saddr != {ip} drop {c}',
                  _BRIDGE_FORWARD]
        fwd = f'add rule bridge {BRIDGE_TABLE} forward iifname "{host_if}" ether type ip'
        if policy.allow_out:
            lines.append(f"{fwd} ip daddr {_set(policy.allow_out)} accept {c}")
        if policy.deny_out:
            lines += [f"{fwd} ip daddr {_set(policy.deny_out)} {new} drop {c}" for new in _BRIDGED_NEW]
    _nft_text("\n".join(lines) + "\n")


# Between two ports of the bridge a frame meets no ip-family hook unless br_netfilter's
# bridge-nf-call-iptables is on, so the policy holds there in the bridge family too, whatever
# that sysctl says. Without conntrack there (nf_conntrack_bridge), a new TCP connection is told
# by its SYN, and anything else to a denied address goes, replies included; and this kernel's
# bridge family cannot reject (no NFT_BRIDGE_REJECT): a drop, not a refusal.
_BRIDGE_FORWARD = (f"add chain bridge {BRIDGE_TABLE} forward {{ type filter hook forward priority filter; "
                   "policy accept; }")
_BRIDGED_NEW = ("tcp flags & (syn | ack) == syn", "ip protocol != tcp")


def _owner(rule: dict[str, Any], tag: str | None = None) -> str | None:
    """The workspace a rule is for; with `tag`, only rules of a hold with that tag."""
    words = str(rule.get("comment") or "").split()
    ours = len(words) in (3, 4) and words[0] == "bunshin" and words[2] == "egress" and words[1].startswith("ws=")
    if ours and (tag is None or (len(words) == 4 and words[3] == tag)):
        return words[1][3:]
    return None


HOLD = "hold"


def hold_closed(ws_id: str, net: NetworkState | None) -> bool:
    """Close the workspace's egress on top of its own policy until release_hold (bunshinrl's
    speculation: an uncommitted call must have no remote effect). The rules go first in their
    chains, so no allow_out of the workspace's lifts them. False for a workspace with no link."""
    if net is None or net.mode != "bridge" or not net.host_if or not net.ip:
        return False
    c = f'comment "bunshin ws={ws_id} egress {HOLD}"'
    match = f'iifname "{net.host_if}"' if net.zone is not None else f'iifname "{net.bridge}" ip saddr {net.ip}'
    lines = [f"add table {FAMILY} {TABLE}",
             f"add chain {FAMILY} {TABLE} {PROXY_CHAIN} {{ type nat hook prerouting priority dstnat; policy accept; }}",
             # Nothing goes to the domain proxy while held: a reject after that redirect never
             # reached the client (it timed out), while the forward chain's reject below does.
             f"insert rule {FAMILY} {TABLE} {PROXY_CHAIN} {match} accept {c}"]
    for hook in ("forward", "input"):
        lines.append(f"add chain {FAMILY} {TABLE} {hook} {{ type filter hook {hook} priority filter; policy accept; }}")
        pre = f"insert rule {FAMILY} {TABLE} {hook} {match} ct state new"
        # insert puts each at the head: the catch-all goes in first so that TCP's reset precedes it.
        lines.append(f"{pre} counter reject with icmp type admin-prohibited {c}")
        lines.append(f"{pre} meta l4proto tcp counter reject with tcp reset {c}")
    if net.zone is None:
        # To the other ports, in the bridge family too (install's _BRIDGED_NEW); first again.
        lines += [f"add table bridge {BRIDGE_TABLE}", _BRIDGE_FORWARD]
        lines += [f'insert rule bridge {BRIDGE_TABLE} forward iifname "{net.host_if}" ether type ip {new} drop {c}'
                  for new in _BRIDGED_NEW]
    _nft_text("\n".join(lines) + "\n")
    return True


def release_hold(ws_id: str) -> None:
    remove({ws_id}, tag=HOLD)


def all_rules() -> set[str]:
    """Every per-workspace rule present, by owner and handle (the census): the egress policies'
    and the guard's (guard.py), which every bridged workspace has."""
    from . import guard
    return {f"{fam} {t} {_owner(r)} {r['handle']}" for fam, t in ((FAMILY, TABLE), ("bridge", BRIDGE_TABLE))
            for r in table_rules(fam, t)} | guard.all_rules()


def refused(ws_id: str, tag: str | None = None) -> int:
    """How many packets the workspace's reject rules (those of a hold with `tag`) have refused."""
    n = 0
    for r in table_rules(FAMILY, TABLE):
        if _owner(r, tag) == ws_id:
            n += sum(e["counter"]["packets"] for e in r["expr"] if isinstance(e, dict) and "counter" in e)
    return n


def remove(owners: set[str] | None = None, keep: set[str] | None = None, tag: str | None = None) -> list[str]:
    """Delete the egress rules of `owners` (of every workspace not in `keep` when None); the
    tables once empty. Returns the owners whose rules went."""
    from .nat import remove_owned
    tables = ((FAMILY, TABLE), ("bridge", BRIDGE_TABLE))
    return sorted(remove_owned(tables, table_rules, lambda r: _owner(r, tag), owners, keep))


def replace(ws_id: str, net: NetworkState | None, policy: EgressPolicy | None,
            proxy: tuple[str, int] | None = None) -> None:
    """Put `policy` in place of the workspace's own egress rules, on a running workspace (E2B's
    update_network). The new rules go in before the old ones go, so that no packet meets the
    workspace with neither in place: until then a packet the old rules decide gets their
    verdict, any other the new one's. A speculation's hold (its tag) stays as it is. Nothing to
    do for a workspace with no link: its policy matters once it has one (never, today).
    `proxy`: where the new policy's domain-rule proxy listens, if it needs one (install's)."""
    if net is None or net.mode != "bridge" or not net.host_if or not net.ip:
        return
    old = [(fam, table, r) for fam, table in ((FAMILY, TABLE), ("bridge", BRIDGE_TABLE))
           for r in table_rules(fam, table) if _owner(r) == ws_id and _owner(r, HOLD) is None]
    if policy is not None and (policy.allow_out or policy.deny_out):
        # A clone matches on its own link; a source by its address behind the bridge (install's doc).
        install(ws_id, policy, net.host_if, net.ip, None if net.zone is not None else net.bridge, proxy)
    if old:
        from .nat import nft_json
        nft_json([{"delete": {"rule": {"family": fam, "table": table, "chain": r["chain"], "handle": r["handle"]}}}
                  for fam, table, r in old])
        for fam, table in ((FAMILY, TABLE), ("bridge", BRIDGE_TABLE)):
            if not table_rules(fam, table) and any(f == fam and t == table for f, t, _ in old):
                nft_json([{"delete": {"table": {"family": fam, "name": table}}}])
