"""NAT for bridged workspaces: one nftables masquerade table shared by all of them, through
nftables' JSON API, and IPv4 forwarding turned on while it exists."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..errors import NetworkError

NAT_FAMILY = "ip"
NAT_TABLE = "bunshin_nat"
NAT_CHAIN = "postrouting"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# The pre-NAT ip_forward value, so that removing the last NAT table restores it.
_FORWARD_SAVED = Path("/run/.bunshin-ip_forward.saved")


def nft_available() -> bool:
    try:
        import nftables  # noqa: F401
    except ImportError:
        return False
    return True


def nft_module() -> Any:
    """Debian's nftables module (NetworkError where it is missing)."""
    try:
        import nftables  # Debian's python3-nftables: only a system-site-packages venv sees it
    except ImportError:
        raise NetworkError(
            "network='bridge' (its guard rules, nat=True, forks, egress policies) needs nftables' Python binding: "
            "apt-get install python3-nftables and use a venv created with --system-site-packages "
            "(or create the workspace without them)"
        ) from None
    return nftables


# One libnftables context per process, for the life of the process, behind a lock (a context is
# not thread-safe). Freeing one closes its netlink socket, and the kernel's release of a
# netfilter socket waits for nf_tables' destroy work when a deleted rule or table has left some:
# an RCU grace period, 6-12 ms here, per context. A context a call made and dropped paid it at
# every teardown (100 ms of a bridged clone's destroy, six or more contexts) and in every
# restore's rules. The context's cache is checked against the kernel's ruleset generation at
# each command, so a long-lived one reads what other processes changed. Its socket was opened
# in the host's network namespace, which is the only one bunshin's tables live in.
_nft_lock = threading.Lock()
_nft_ctx: Any = None


def _reset_after_fork() -> None:
    global _nft_lock, _nft_ctx
    _nft_lock, _nft_ctx = threading.Lock(), None


os.register_at_fork(after_in_child=_reset_after_fork)


def _context(json_output: bool) -> Any:
    """The process's context, made on first use, set to the output asked; hold _nft_lock."""
    global _nft_ctx
    if _nft_ctx is None:
        _nft_ctx = nft_module().Nftables()
    _nft_ctx.set_json_output(json_output)
    return _nft_ctx


def nft_cmd(text: str) -> tuple[int, Any, Any]:
    """Run nft's text commands through the process's context: (rc, output, error)."""
    with _nft_lock:
        return _context(False).cmd(text)


def nft_json(commands: list[dict[str, Any]]) -> dict[str, Any]:
    """Run nft's JSON commands; NetworkError with what nft said when it refuses them."""
    with _nft_lock:
        rc, out, err = _context(True).json_cmd({"nftables": commands})
    if rc != 0:
        raise NetworkError(
            f"nftables refused {json.dumps(commands)[:200]}: {str(err).strip()}; is nf_tables with "
            "masquerade support (CONFIG_NFT_MASQ, CONFIG_NFT_NAT) in the kernel? see 'bunshin doctor'"
        )
    return out if isinstance(out, dict) else {}


def table_rules(family: str, table: str) -> list[dict[str, Any]]:
    """The rules of one nft table, none when the table does not exist."""
    tables = nft_json([{"list": {"tables": {"family": family}}}]).get("nftables", [])
    if not any(t.get("table", {}).get("name") == table for t in tables):
        return []
    out = nft_json([{"list": {"table": {"family": family, "name": table}}}])
    return [item["rule"] for item in out.get("nftables", []) if "rule" in item]


def remove_owned(tables: Iterable[tuple[str, str]], rules: Callable[[str, str], list[dict[str, Any]]],
                 owner: Callable[[dict[str, Any]], str | None], owners: set[str] | None,
                 keep: set[str] | None) -> set[str]:
    """Delete, in each (family, table), the rules whose `owner` is in `owners` (every owner not in
    `keep` when None), and the table once it holds nothing else; the owners whose rules went.
    One deletion per table, so a workspace's rules never stand half removed in it."""
    gone: set[str] = set()
    for fam, table in tables:
        found = rules(fam, table)
        deletes = []
        for r in found:
            ws = owner(r)
            if ws is None or (owners is not None and ws not in owners) or (keep is not None and ws in keep):
                continue
            gone.add(ws)
            deletes.append({"delete": {"rule": {"family": fam, "table": table, "chain": r["chain"],
                                                "handle": r["handle"]}}})
        if deletes:
            nft_json(deletes)
        if found and len(deletes) == len(found):
            nft_json([{"delete": {"table": {"family": fam, "name": table}}}])
    return gone


def _nat_table_exists() -> bool:
    out = nft_json([{"list": {"tables": {"family": NAT_FAMILY}}}])
    return any(
        item.get("table", {}).get("name") == NAT_TABLE and item["table"].get("family") == NAT_FAMILY
        for item in out.get("nftables", [])
    )


def nat_rules() -> list[dict[str, Any]]:
    """The rules of bunshin's NAT table in nftables JSON form; [] when the table is absent."""
    if not _nat_table_exists():
        return []
    out = nft_json([{"list": {"table": {"family": NAT_FAMILY, "name": NAT_TABLE}}}])
    return [item["rule"] for item in out.get("nftables", []) if "rule" in item]


def ensure_nat(net: ipaddress.IPv4Network) -> None:
    table = {"family": NAT_FAMILY, "name": NAT_TABLE}
    prefix = {"prefix": {"addr": str(net.network_address), "len": net.prefixlen}}
    saddr = {"payload": {"protocol": "ip", "field": "saddr"}}
    daddr = {"payload": {"protocol": "ip", "field": "daddr"}}
    # add + delete + add in one transaction: atomically replaces whatever an earlier run
    # (perhaps with another subnet) left, and never shows a moment without the rule.
    nft_json([
        {"add": {"table": table}},
        {"delete": {"table": table}},
        {"add": {"table": table}},
        {"add": {"chain": {**table, "table": NAT_TABLE, "name": NAT_CHAIN, "type": "nat",
                           "hook": "postrouting", "prio": 100, "policy": "accept"}}},
        {"add": {"rule": {"family": NAT_FAMILY, "table": NAT_TABLE, "chain": NAT_CHAIN,
                          "comment": "bunshin workspaces", "expr": [
                              {"match": {"op": "==", "left": saddr, "right": prefix}},
                              {"match": {"op": "!=", "left": daddr, "right": prefix}},
                              {"masquerade": None},
                          ]}}},
    ])
    try:
        current = IP_FORWARD.read_text().strip()
        if current != "1":
            if not _FORWARD_SAVED.exists():
                _FORWARD_SAVED.write_text(current)
            IP_FORWARD.write_text("1")
    except OSError as e:
        raise NetworkError(
            f"cannot enable IPv4 forwarding ({IP_FORWARD}): {e}; run as root in the host's network namespace"
        ) from e


def remove_nat() -> bool:
    """Drop the NAT table and give ip_forward back its pre-NAT value; False if there was no table."""
    removed = False
    if _nat_table_exists():
        nft_json([{"delete": {"table": {"family": NAT_FAMILY, "name": NAT_TABLE}}}])
        removed = True
    with contextlib.suppress(FileNotFoundError):
        value = _FORWARD_SAVED.read_text().strip() or "0"
        try:
            IP_FORWARD.write_text(value)
        except OSError as e:
            raise NetworkError(f"cannot restore {IP_FORWARD} to {value}: {e}; set it by hand") from e
        _FORWARD_SAVED.unlink()
    return removed
