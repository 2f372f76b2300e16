"""E2B's network options of a sandbox (Sandbox.create(network=..., allow_internet_access=...),
update_network) as the workspace's egress policy, and back for get_info.

E2B's shapes, as e2b 2.63 takes them: allow_out and deny_out are lists of CIDRs, addresses
(and, in allow_out, domains), or callables given a context (ctx.all_traffic is "0.0.0.0/0",
ctx.rules the `rules` mapping) that return such a list. allow_internet_access=False is
deny_out 0.0.0.0/0 (allow_out still wins). What they mean, and what cannot apply to a local
sandbox (rules, egress_proxy, dns_servers, mask_request_host: a typed error), is
bunshinfork.egress_from_e2b's to say; this module only resolves the shapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgumentException
from ..network.policy import EgressPolicy
from ..network.policy import from_e2b as egress_from_e2b

ALL_TRAFFIC = "0.0.0.0/0"
# What update_network reads of its argument; E2B's SDK drops any other key from the request.
UPDATE_KEYS = ("allow_out", "deny_out", "rules", "egress_proxy", "dns_servers")


@dataclass(frozen=True)
class NetworkSelectorContext:
    """What an allow_out/deny_out callable is given (E2B's SandboxNetworkSelectorContext)."""

    all_traffic: str = ALL_TRAFFIC
    rules: Mapping[str, Any] = field(default_factory=dict)


def _selector(value: object, rules: Mapping[str, Any]) -> object:
    if callable(value):
        value = value(NetworkSelectorContext(ALL_TRAFFIC, rules))
    if isinstance(value, (list, tuple)):
        return list(value)
    return value  # not a list: egress_from_e2b says what is wrong with it


def _https_ports(value: object) -> None:
    """https_ports: which public URLs re-encrypt to the sandbox. A local sandbox's ports are
    reached directly (get_host), TLS and all, so there is nothing to configure; still checked."""
    if not isinstance(value, (list, tuple)) or any(isinstance(p, bool) or not isinstance(p, int)
                                                   or not 1 <= p <= 65535 for p in value):
        raise InvalidArgumentException(f"network https_ports must be a list of port numbers, got {value!r}")


# network.maskRequestHost: a host, or host:port, for the Host header a sandbox's ports get;
# ${PORT} stands for the port asked for (E2B's pool.MaskRequestHostPortPlaceholder). ASCII only,
# nothing that could end a header or start another (E2B's validateNetworkConfig refuses
# non-ASCII and what splitHostPortOptional cannot split).
PORT_PLACEHOLDER = "${PORT}"
_MASK = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.${}-]+)(?::(?:\d{1,5}|\$\{PORT\}))?")
_MASK_MAX = 255


def check_mask_request_host(value: object) -> str:
    """network.maskRequestHost as given at create, checked (InvalidArgumentException otherwise)."""
    if not isinstance(value, str) or not 0 < len(value) <= _MASK_MAX or not _MASK.fullmatch(value) \
            or "$" in value.replace(PORT_PLACEHOLDER, ""):
        raise InvalidArgumentException(f"mask request host is not valid: {value!r}")
    return value


def masked_host(mask: str, port: int) -> str:
    """The Host a request to `port` is sent in with (E2B's orchestrator proxy.go)."""
    return mask.replace(PORT_PLACEHOLDER, str(port))


def create_policy(network: Mapping[str, Any] | None, allow_internet_access: bool | None) -> EgressPolicy | None:
    """Sandbox.create's network= and allow_internet_access= (None: E2B's default, on)."""
    if network is not None and not isinstance(network, Mapping):
        raise InvalidArgumentException(f"network must be a dict of E2B's network options, got {network!r}")
    resolved: dict[str, Any] = dict(network or {})
    rules = resolved.get("rules") or {}
    for key in ("allow_out", "deny_out"):
        if resolved.get(key) is None:
            resolved.pop(key, None)  # E2B's SDK sends a None selector as no selector
        else:
            resolved[key] = _selector(resolved[key], rules if isinstance(rules, Mapping) else {})
    if "https_ports" in resolved:
        ports = resolved.pop("https_ports")
        if ports is not None:
            _https_ports(ports)
    for key in ("egress_proxy", "dns_servers", "rules", "mask_request_host"):
        if key in resolved and resolved[key] is None:
            del resolved[key]  # None is E2B's "not set" for these (its SDK's `is not None`)
    return egress_from_e2b(resolved, allow_internet_access is None or bool(allow_internet_access))


def update_policy(network: Mapping[str, Any]) -> tuple[EgressPolicy | None, bool]:
    """update_network's argument: the policy that replaces the sandbox's, and whether internet
    access is on. As in E2B, what it leaves out is cleared, not kept."""
    if not isinstance(network, Mapping):
        raise InvalidArgumentException(f"network must be a dict (E2B's SandboxNetworkUpdate), got {network!r}")
    internet = network.get("allow_internet_access", True)
    if not isinstance(internet, bool):
        raise InvalidArgumentException(f"allow_internet_access must be True or False, got {internet!r}")
    given = {k: network[k] for k in UPDATE_KEYS if k in network}
    return create_policy(given, internet), internet


def info(egress: Mapping[str, list[str]] | None) -> dict[str, Any]:
    """SandboxInfo.network: the allow_out and deny_out in force (allow_internet_access=False
    shows as deny_out 0.0.0.0/0); empty when everything is allowed."""
    if not egress:
        return {}
    return {"allow_out": list(egress.get("allow_out") or []), "deny_out": list(egress.get("deny_out") or [])}

