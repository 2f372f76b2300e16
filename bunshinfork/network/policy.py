"""Egress policy as the user writes it (WorkspaceSpec.egress, E2B's network={...}), parsed
and checked with no I/O; egress.py enforces it. Kept apart so that the spec can check a policy
without importing what enforces it."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SpecError

ALL_TRAFFIC = "0.0.0.0/0"
_DOMAIN = re.compile(r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}\.?$", re.IGNORECASE)
E2B_KEYS = {"allow_out", "deny_out", "allow_public_traffic"}
E2B_UNSUPPORTED = {"rules", "egress_proxy", "dns_servers", "mask_request_host"}


@dataclass(frozen=True)
class EgressPolicy:
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()

    @property
    def closed(self) -> bool:
        return ALL_TRAFFIC in self.deny_out and not self.allow_out

    def to_dict(self) -> dict[str, list[str]]:
        return {"allow_out": list(self.allow_out), "deny_out": list(self.deny_out)}


CLOSED = EgressPolicy(deny_out=(ALL_TRAFFIC,))


def _cidr(raw: object, where: str) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise SpecError(f"egress {where}: {raw!r} is not an address, CIDR or domain")
    try:
        net = ipaddress.ip_network(raw.strip(), strict=False)
    except ValueError:
        if _DOMAIN.match(raw.strip()):
            if where == "deny_out":
                raise SpecError(f"egress deny_out: {raw!r} is a domain; deny_out takes CIDRs only "
                                "(E2B's rule: domains only in allow_out)") from None
            raise SpecError(f"egress allow_out: domain {raw!r} needs the Host/SNI proxy, which this host "
                            "does not run yet; allow its addresses as CIDRs instead") from None
        raise SpecError(f"egress {where}: {raw!r} is not an IPv4 address, CIDR or domain") from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise SpecError(f"egress {where}: {raw!r} is IPv6; workspaces have IPv4 only")
    return str(net)


def parse(value: object) -> EgressPolicy | None:
    """A spec's egress: None (no policy), "closed", an EgressPolicy, or E2B's dict."""
    if value is None or isinstance(value, EgressPolicy):
        return value
    if value == "closed":
        return CLOSED
    if not isinstance(value, Mapping):
        raise SpecError(f"egress must be None, 'closed' or {{'allow_out': [...], 'deny_out': [...]}}, got {value!r}")
    unknown = set(value) - {"allow_out", "deny_out"}
    if unknown:
        raise SpecError(f"egress has unknown keys {sorted(unknown)}; use allow_out and deny_out")
    lists = {}
    for key in ("allow_out", "deny_out"):
        items = value.get(key) or []
        if isinstance(items, str) or not isinstance(items, (list, tuple)):
            raise SpecError(f"egress {key} must be a list of CIDRs, got {items!r}")
        lists[key] = tuple(dict.fromkeys(_cidr(i, key) for i in items))
    return EgressPolicy(lists["allow_out"], lists["deny_out"])


def from_e2b(network: Mapping[str, Any] | None, allow_internet_access: bool = True) -> EgressPolicy | None:
    """E2B's Sandbox.create(network=..., allow_internet_access=...) as an egress policy.

    allow_public_traffic (inbound to the sandbox's public URLs) has nothing to do here and is
    accepted when True; rules, egress_proxy, dns_servers and mask_request_host are a SpecError.
    allow_internet_access=False is deny_out 0.0.0.0/0, as in E2B."""
    network = dict(network or {})
    bad = set(network) & E2B_UNSUPPORTED
    if bad:
        raise SpecError(f"network={{...}}: {sorted(bad)} cannot apply to a local workspace; "
                        "use allow_out and deny_out")
    unknown = set(network) - E2B_KEYS - E2B_UNSUPPORTED
    if unknown:
        raise SpecError(f"network={{...}} has unknown keys {sorted(unknown)}")
    if network.pop("allow_public_traffic", True) is not True:
        raise SpecError("network allow_public_traffic=False has no meaning here: nothing reaches a workspace "
                        "from outside unless a port is published")
    policy = parse(network) if network else None
    if not allow_internet_access:
        deny = ((policy.deny_out if policy else ()) + (ALL_TRAFFIC,))
        policy = EgressPolicy(policy.allow_out if policy else (), tuple(dict.fromkeys(deny)))
    return policy


# ---- nftables ----
