"""Which bunshin host this process is: its state root, cgroup parent, bridge, subnet and layer store.

Everything host-wide that bunshinfork names comes from one HostConfig, read once from the
environment when bunshinfork is imported (the defaults are a machine's one host). Two hosts
on one machine (the nodes of a local Ray cluster, bunshinrl.cluster) are two processes with
two configurations: neither sees, gc's or frees the other's workspaces, cgroups, veths or
layers. `HostConfig.named(name)` derives a complete, non-clashing configuration for one of
several hosts on a machine, and `env()` is what a child process needs to become that host.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

RUN_ROOT_ENV = "BUNSHIN_RUN_ROOT"
CGROUP_PARENT_ENV = "BUNSHIN_CGROUP_PARENT"
BRIDGE_ENV = "BUNSHIN_BRIDGE"
SUBNET_ENV = "BUNSHIN_SUBNET"
LAYERS_ENV = "BUNSHIN_LAYERS"

DEFAULT_RUN_ROOT = Path("/run/bunshin")
DEFAULT_CGROUP_PARENT = "bunshin"
DEFAULT_BRIDGE = "bunshin0"
DEFAULT_SUBNET = "10.213.0.0/16"
DEFAULT_LAYERS = Path("/var/lib/bunshin/layers")
# Named hosts of one machine live here (state roots) and under /var/lib/bunshin/hosts (layer
# stores): one place to list them from, which the test suite's leak check does.
HOSTS_RUN_ROOT = Path("/run/bunshin-hosts")
HOSTS_LAYERS = Path("/var/lib/bunshin/hosts")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,6}$")  # the bridge name "bs-" + name stays under IFNAMSIZ


@dataclass(frozen=True)
class HostConfig:
    run_root: Path = DEFAULT_RUN_ROOT
    cgroup_parent: str = DEFAULT_CGROUP_PARENT
    bridge: str = DEFAULT_BRIDGE
    subnet: str = DEFAULT_SUBNET
    layer_store: Path = DEFAULT_LAYERS

    def __post_init__(self) -> None:
        if not self.cgroup_parent or "/" in self.cgroup_parent or self.cgroup_parent in (".", ".."):
            raise ValueError(f"cgroup_parent {self.cgroup_parent!r} must be one directory name")
        if not 0 < len(self.bridge) <= 15 or "/" in self.bridge or " " in self.bridge:
            raise ValueError(f"bridge {self.bridge!r} must be an interface name of 1-15 characters")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> HostConfig:
        e = os.environ if env is None else env
        return cls(run_root=Path(e.get(RUN_ROOT_ENV) or DEFAULT_RUN_ROOT),
                   cgroup_parent=e.get(CGROUP_PARENT_ENV) or DEFAULT_CGROUP_PARENT,
                   bridge=e.get(BRIDGE_ENV) or DEFAULT_BRIDGE,
                   subnet=(e.get(SUBNET_ENV) or "").strip() or DEFAULT_SUBNET,
                   layer_store=Path(e.get(LAYERS_ENV) or DEFAULT_LAYERS))

    @classmethod
    def named(cls, name: str) -> HostConfig:
        """Host `name` of several on one machine: a state root of its own under
        /run/bunshin-hosts, cgroup parent `bunshin-NAME`, bridge `bs-NAME` on a /24 of
        10.214.0.0/16 picked from the name, and a layer store under /var/lib/bunshin/hosts."""
        if not _NAME.match(name):
            raise ValueError(f"host name {name!r}: 1-7 of [a-z0-9-], starting with a letter or digit")
        third = int.from_bytes(hashlib.sha256(name.encode()).digest()[:2], "big") % 256
        return cls(run_root=HOSTS_RUN_ROOT / name, cgroup_parent=f"bunshin-{name}", bridge=f"bs-{name}",
                   subnet=f"10.214.{third}.0/24", layer_store=HOSTS_LAYERS / name / "layers")

    def env(self) -> dict[str, str]:
        """The environment that makes a new process this host (before it imports bunshinfork)."""
        return {RUN_ROOT_ENV: str(self.run_root), CGROUP_PARENT_ENV: self.cgroup_parent, BRIDGE_ENV: self.bridge,
                SUBNET_ENV: self.subnet, LAYERS_ENV: str(self.layer_store)}


def named_hosts() -> list[HostConfig]:
    """The named hosts with a state root on this machine now."""
    if not HOSTS_RUN_ROOT.is_dir():
        return []
    return [HostConfig.named(n) for n in sorted(os.listdir(HOSTS_RUN_ROOT)) if _NAME.match(n)]


HOST = HostConfig.from_env()
