"""Every bridged workspace's baseline rules, whatever its egress policy: what no workspace reaches.

- The host: a workspace opens no connection to any host address (the gateway on bunshin0, the
  host's other addresses, a clone's link). Only replies to the host's own connections come in,
  and connections a host rule redirected on purpose (`ct status dnat`: the domain-rule proxy
  that egress.py points at the gateway). A refusal is immediate: a TCP reset, else ICMP
  admin-prohibited.
- Link-local 169.254.0.0/16 (cloud metadata services live there) is refused; with
  `block_private`, so are the private ranges (RFC 1918 and the shared 100.64.0.0/10) other than
  the workspaces' own subnet, whose traffic is the business of port isolation.

- Anti-spoofing, on every port: a bridge port passes only IPv4 and ARP frames with the
  workspace's own MAC, its own IPv4 source address and its own ARP sender (bridge family, before
  the bridge decides anything: IPv6, VLAN tags and every other ethertype go too); a clone's
  routed link passes only IPv4 from its own address and ARP for it (inet and arp families).
  Root inside with raw sockets (a privileged workspace) can forge frames, never deliver them.

- Port isolation (`port_isolation`, which `bunshin serve` turns on): the workspace and every
  other workspace reach each other by no path. Bridged frames from and to its port are dropped
  in the bridge family's forward hook, which sees them whatever br_netfilter does (with
  bridge-nf-call-iptables on, the ip-family hooks see them too); routed packets (a clone's, or a
  hairpin through the gateway) are refused in the inet forward hook, between any workspace
  address and its own. Library workspaces keep Docker's traffic between containers unless asked.

Rules are per workspace, in tables `inet`, `bridge` and `arp` `bunshin_guard` (comments `bunshin
ws=ID guard`, which gc and the census read), and go in before the workspace's link exists. They
match a clone on its own link, and a source by its address behind the bridge, which
anti-spoofing holds it to.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from ..errors import NetworkError
from .nat import table_rules

FAMILY = "inet"
TABLE = "bunshin_guard"
LINK_LOCAL = "169.254.0.0/16"
PRIVATE = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
_TAG = "guard"


@dataclass(frozen=True)
class Guard:
    """What a workspace's guard rules are made of."""

    ws_id: str
    host_if: str  # its host veth
    ip: str  # its address inside
    subnet: ipaddress.IPv4Network
    bridge: str | None  # the bridge it is a port of; None for a clone (a routed link of its own)
    mac: str | None = None  # eth0's, for a bridge port
    block_private: bool = False
    isolated: bool = False

    @property
    def comment(self) -> str:
        return f'comment "bunshin ws={self.ws_id} {_TAG}"'

    @property
    def match(self) -> str:
        return f'iifname "{self.bridge}" ip saddr {self.ip}' if self.bridge else f'iifname "{self.host_if}"'


def _nft_text(text: str) -> None:
    from .nat import nft_cmd
    rc, _, err = nft_cmd(text)
    if rc != 0:
        raise NetworkError(f"nftables refused the workspace's guard rules: {str(err).strip()[:300]}; "
                           "is nf_tables with reject and conntrack in the kernel? see 'bunshin doctor'")


def _set(items: tuple[str, ...]) -> str:
    return "{ " + ", ".join(items) + " }"


def _reject(pre: str, c: str) -> list[str]:
    return [f"{pre} meta l4proto tcp reject with tcp reset {c}", f"{pre} reject with icmpx type admin-prohibited {c}"]


def _inet_lines(g: Guard) -> list[str]:
    m, c, t = g.match, g.comment, f"{FAMILY} {TABLE}"
    lines = [f"add table {t}"]
    for hook in ("input", "forward"):
        lines.append(f"add chain {t} {hook} {{ type filter hook {hook} priority filter; policy accept; }}")
    lines += [f"add rule {t} input {m} ct status dnat accept {c}",
              f"add rule {t} input {m} ct state {{ established, related }} accept {c}",
              *_reject(f"add rule {t} input {m}", c),
              *_reject(f"add rule {t} forward {m} ip daddr {LINK_LOCAL}", c)]
    if g.block_private:
        lines += _reject(f"add rule {t} forward {m} ip daddr != {g.subnet} ip daddr {_set(PRIVATE)}", c)
    if g.isolated:
        lines += _reject(f"add rule {t} forward {m} ip daddr {g.subnet}", c)
        if g.bridge:
            # Into it from any workspace, clones included (their source address is one of the
            # subnet's until the host's NAT, after this hook). A clone has no address of its own.
            lines += _reject(f"add rule {t} forward ip daddr {g.ip} ip saddr {g.subnet}", c)
    if g.bridge is None:
        # A clone's link: the bridge-family rules below never see it.
        i = f'iifname "{g.host_if}"'
        lines += [f"add chain {t} pre {{ type filter hook prerouting priority raw; policy accept; }}",
                  f"add rule {t} pre {i} meta nfproto != ipv4 drop {c}",
                  f"add rule {t} pre {i} ip saddr != {g.ip} drop {c}",
                  f"add table arp {TABLE}",
                  f"add chain arp {TABLE} in {{ type filter hook input priority filter; policy accept; }}",
                  f"add rule arp {TABLE} in {i} arp saddr ip != {g.ip} drop {c}"]
    return lines


def _bridge_lines(g: Guard) -> list[str]:
    assert g.mac is not None
    i, c, t = f'iifname "{g.host_if}"', g.comment, f"bridge {TABLE}"
    return [f"add table {t}",
            f"add chain {t} pre {{ type filter hook prerouting priority filter; policy accept; }}",
            f"add rule {t} pre {i} ether saddr != {g.mac} drop {c}",
            f"add rule {t} pre {i} ether type != {{ ip, arp }} drop {c}",
            f"add rule {t} pre {i} ether type ip ip saddr != {g.ip} drop {c}",
            f"add rule {t} pre {i} ether type arp arp saddr ip != {g.ip} drop {c}",
            f"add rule {t} pre {i} ether type arp arp saddr ether != {g.mac} drop {c}",
            *([f"add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}",
               f"add rule {t} forward {i} drop {c}", f'add rule {t} forward oifname "{g.host_if}" drop {c}']
              if g.isolated else [])]


def install(g: Guard) -> None:
    """The workspace's guard rules, in one transaction."""
    lines = _inet_lines(g) + (_bridge_lines(g) if g.bridge else [])
    _nft_text("\n".join(lines) + "\n")


def _tables() -> tuple[tuple[str, str], ...]:
    return ((FAMILY, TABLE), ("bridge", TABLE), ("arp", TABLE))


def _owner(rule: dict[str, Any]) -> str | None:
    words = str(rule.get("comment") or "").split()
    if len(words) == 3 and words[0] == "bunshin" and words[1].startswith("ws=") and words[2] == _TAG:
        return words[1][3:]
    return None


def all_rules() -> set[str]:
    """Every guard rule present, by table, owner and handle (the census)."""
    return {f"{fam} {t} {_owner(r)} {r['handle']}" for fam, t in _tables() for r in table_rules(fam, t)}


def remove(owners: set[str] | None = None, keep: set[str] | None = None,
           families: tuple[str, ...] | None = None) -> list[str]:
    """Delete the guard rules of `owners` (of every workspace not in `keep` when None), in the
    tables of `families` (all when None); each table once empty. Returns the owners whose rules went."""
    from .nat import remove_owned
    tables = [(fam, t) for fam, t in _tables() if families is None or fam in families]
    return sorted(remove_owned(tables, table_rules, _owner, owners, keep))
