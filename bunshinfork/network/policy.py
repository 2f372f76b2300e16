"""Egress policy as the user writes it (WorkspaceSpec.egress, E2B's network={...}), parsed
and checked with no I/O; egress.py enforces it. Kept apart so that the spec can check a policy
without importing what enforces it.

Domain names follow E2B's syntax: an exact name ("pypi.org") or one leading wildcard
("*.github.com": every subdomain at any depth, not the apex); lowercased, a trailing dot
dropped; a bare "*" and any other "*" are malformed."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import SpecError
from .sniproxy import is_hostname, name_matches

ALL_TRAFFIC = "0.0.0.0/0"
# E2B's resolver when allow_out holds a domain and no dns_servers are given: it is allowed too.
E2B_DEFAULT_DNS = "8.8.8.8/32"
E2B_KEYS = {"allow_out", "deny_out", "allow_public_traffic"}
E2B_UNSUPPORTED = {"rules", "egress_proxy", "dns_servers", "mask_request_host"}


@dataclass(frozen=True)
class EgressPolicy:
    allow_out: tuple[str, ...] = ()  # CIDRs
    deny_out: tuple[str, ...] = ()  # CIDRs
    domains: tuple[str, ...] = ()  # allow_out's domain names, matched on Host and SNI

    @property
    def closed(self) -> bool:
        return ALL_TRAFFIC in self.deny_out and not self.allow_out and not self.domains

    @property
    def needs_proxy(self) -> bool:
        """Domains only matter for what deny_out denies: with nothing denied all is allowed."""
        return bool(self.domains and self.deny_out)

    def allows_name(self, name: str) -> bool:
        return name_matches(name, self.domains)

    def to_dict(self) -> dict[str, list[str]]:
        return {"allow_out": [*self.allow_out, *self.domains], "deny_out": list(self.deny_out)}


CLOSED = EgressPolicy(deny_out=(ALL_TRAFFIC,))


def domain(raw: str) -> str | None:
    """The normal form of a domain rule, or None when `raw` is not one."""
    name = raw.strip().lower()
    name = name[:-1] if name.endswith(".") else name
    bare = name[2:] if name.startswith("*.") else name
    if not is_hostname(bare) or ("." not in bare and bare == name):
        return None  # "*.com" is a rule (E2B allows it); a single label alone is not a domain
    return name


def _entry(raw: object, where: str) -> tuple[str, bool]:
    """(CIDR or domain, is_domain)."""
    if not isinstance(raw, str) or not raw.strip():
        raise SpecError(f"egress {where}: {raw!r} is not an address, CIDR or domain")
    try:
        net = ipaddress.ip_network(raw.strip(), strict=False)
    except ValueError:
        name = domain(raw)
        if name is None:
            raise SpecError(f"egress {where}: {raw!r} is not an IPv4 address, CIDR or domain "
                            "(a domain is 'example.com' or '*.example.com')") from None
        if where == "deny_out":
            raise SpecError(f"egress deny_out: {raw!r} is a domain; deny_out takes CIDRs only "
                            "(E2B's rule: domains only in allow_out)") from None
        return name, True
    if not isinstance(net, ipaddress.IPv4Network):
        raise SpecError(f"egress {where}: {raw!r} is IPv6; workspaces have IPv4 only")
    return str(net), False


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
    lists: dict[str, list[tuple[str, bool]]] = {}
    for key in ("allow_out", "deny_out"):
        items = value.get(key) or []
        if isinstance(items, str) or not isinstance(items, (list, tuple)):
            raise SpecError(f"egress {key} must be a list of CIDRs (and, in allow_out, domains), got {items!r}")
        lists[key] = [_entry(i, key) for i in items]
    allow = tuple(dict.fromkeys(e for e, is_name in lists["allow_out"] if not is_name))
    names = tuple(dict.fromkeys(e for e, is_name in lists["allow_out"] if is_name))
    return EgressPolicy(allow, tuple(dict.fromkeys(e for e, _ in lists["deny_out"])), names)


def from_e2b(network: Mapping[str, Any] | None, allow_internet_access: bool = True) -> EgressPolicy | None:
    """E2B's Sandbox.create(network=..., allow_internet_access=...) as an egress policy.

    allow_public_traffic (inbound to the sandbox's public URLs) has nothing to do here and is
    accepted when True; rules, egress_proxy, dns_servers and mask_request_host are a SpecError.
    allow_internet_access=False is deny_out 0.0.0.0/0, as in E2B. A domain in allow_out also
    allows E2B's default resolver 8.8.8.8, as E2B does when no dns_servers are given."""
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
    if policy is not None and policy.domains and E2B_DEFAULT_DNS not in policy.allow_out:
        policy = replace(policy, allow_out=(*policy.allow_out, E2B_DEFAULT_DNS))
    if not allow_internet_access:
        deny = ((policy.deny_out if policy else ()) + (ALL_TRAFFIC,))
        policy = EgressPolicy(policy.allow_out if policy else (), tuple(dict.fromkeys(deny)),
                              policy.domains if policy else ())
    return policy

