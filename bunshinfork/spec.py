"""WorkspaceSpec: what a workspace is made of. Validated before anything is created."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from .errors import SpecError

NETWORK_MODES = ("none", "bridge")
CGROUP_VERSIONS = ("auto", "v1", "v2")
_HOSTNAME = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MIN_MEMORY = 16 << 20
MIN_DISK = 1 << 20  # below this overlayfs's own work files and a shell's history do not fit
MAX_DISK = 1 << 60  # a qgroup limit and tmpfs's size= are 64-bit; past an exbibyte is a typo


def parse_size(value: int | str | None, what: str) -> int | None:
    """Bytes from an int or a string such as '512M' or '2GiB'."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise SpecError(f"{what} must be a size in bytes or a string like '512M', not {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise SpecError(f"{what}={value!r} is not a size; use bytes or a string like '512M' or '2G'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise SpecError(f"{what} must be positive, got {value!r}")
    return n


@dataclass
class WorkspaceSpec:
    """Everything a workspace is created from.

    rootfs: "host" (the host's /usr under a generated /etc; the default), "debian"
      (debootstrap, cached), a container image ("docker:IMAGE" from a Docker engine,
      "oci:DIR[:TAG]" an OCI image layout, "registry:REF" copied with skopeo; its layers are
      stacked, and its Env, WorkingDir and User apply to commands), or an absolute directory.
    memory_limit / pids_limit: enforced by the workspace's cgroup; the OOM killer acts inside it.
    network: "none" (loopback only) or "bridge" (a veth on the bunshin0 bridge; nat=True adds
      masquerading to the host's uplink).
    egress: what the workspace may reach, E2B's rules: {"allow_out": [CIDR or domain...],
      "deny_out": [CIDR...]} (allow wins; no allow_out: all not denied is allowed; domains,
      "name" or "*.name", are matched on HTTP Host and TLS SNI), or "closed" (nothing leaves).
      Enforced by the host's nftables and proxy, rejected at once; forks inherit it. On
      network="none" there is nothing to enforce. See bunshinfork.network.egress.
    block_private: a bridged workspace is refused the private ranges (10/8, 172.16/12, 192.168/16,
      100.64/10) beyond the workspaces' own subnet, as it always is 169.254/16 and the host's own
      services. See bunshinfork.network.guard.
    port_isolation: a bridged workspace and every other workspace reach each other by no path
      (bridged or routed); `bunshin serve` turns it on. Off, workspaces on the bridge reach each
      other as Docker's containers do. See bunshinfork.network.guard.
    storage_dir: where the private writable layers live; a btrfs directory makes each layer a
      subvolume (see storage.setup_btrfs_loop). Default: the state root's tmpfs.
    ksm: opt every process into kernel samepage merging (prctl PR_SET_MEMORY_MERGE), so the
      "ksm" fork engine can merge a source with its clones. ksmd only runs during fork bursts.
    cpu_limit: the CPU time its processes get together, in cores (1.5: one and a half CPUs'
      worth per period, as `docker run --cpus`); a CFS bandwidth quota on its cgroup. A fork
      inherits it. None: unbounded.
    disk_limit: what the workspace may write, in bytes or a string like '512M': its private
      layer is held to it (a btrfs simple-quota limit on its subvolume, or a tmpfs of that size
      where layers live on the state root's tmpfs), and so is each of its tmpfs mounts (/tmp,
      /dev/shm). Past it, writes fail with EDQUOT (btrfs) or ENOSPC (tmpfs) inside the
      workspace only. A file of the snapshot it was forked from counts only for the blocks the
      workspace rewrites (its copy-up shares the extents by reflink); a root file system file
      counts whole once modified. A fork inherits it. None: unbounded.
    privileged: keep every capability and an unmasked /proc. By default root inside a workspace
      has Docker's default capability set (no CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_MKNOD, ...)
      and /proc/sys, /proc/sysrq-trigger and friends are read-only or masked.
    userns: run the workspace in a user namespace of its own, as Docker's userns-remap does:
      root inside is host uid 100000 (ids 0-65535 map to 100000-165535), so even a process
      that escapes the other namespaces holds no privilege on the host, and privileged=True
      gives root capabilities over the workspace's own namespaces only. Its rootfs is a copy
      owned by those ids, made once per rootfs and cached; rootfs='host' (the host's own
      /usr) cannot be given away and is refused. Forks keep the map.
    start: "entrypoint" starts an image rootfs's Entrypoint and Cmd (as `docker run` does) as
      the workspace's service once it is up, in the background, as the image's User in its
      WorkingDir with its Env; None starts nothing.
    """

    rootfs: str = "host"
    hostname: str | None = None
    memory_limit: int | str | None = None
    disk_limit: int | str | None = None
    cpu_limit: float | None = None
    pids_limit: int | None = None
    network: str = "none"
    nat: bool = False
    env: dict[str, str] = field(default_factory=dict)
    storage_dir: str | None = None
    cgroup: str = "auto"
    ksm: bool = True
    mount_sysfs: bool = True
    privileged: bool = False
    userns: bool = False
    start: str | None = None
    egress: dict[str, list[str]] | str | None = None
    block_private: bool = False
    port_isolation: bool = False

    def validate(self) -> WorkspaceSpec:
        """Return a normalised copy, or raise SpecError saying what to change."""
        if not isinstance(self.rootfs, str) or not self.rootfs or "\0" in self.rootfs:
            raise SpecError("rootfs must be 'host', 'debian', 'docker:IMAGE' or an absolute directory path")
        for name in ("nat", "ksm", "mount_sysfs", "privileged", "userns", "block_private", "port_isolation"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.userns and self.rootfs == "host":
            raise SpecError("userns=True needs a rootfs it can own: 'debian', a directory or 'docker:IMAGE'; "
                            "the host's own /usr (rootfs='host') cannot be shifted to the namespace's ids")
        if self.storage_dir is not None and (
            not isinstance(self.storage_dir, str) or not self.storage_dir.startswith("/") or "\0" in self.storage_dir
        ):
            raise SpecError(f"storage_dir must be an absolute directory path, got {self.storage_dir!r}")
        if not isinstance(self.env, dict):
            raise SpecError(f"env must be a dict of names to values, got {type(self.env).__name__}")
        # fullmatch: `$` alone also matches before a trailing newline, which would reach sethostname.
        if self.hostname is not None and (not isinstance(self.hostname, str) or not _HOSTNAME.fullmatch(self.hostname)):
            raise SpecError(f"hostname {self.hostname!r} is not a valid host name (letters, digits, '-', <= 63)")
        mem = parse_size(self.memory_limit, "memory_limit")
        if mem is not None and mem < MIN_MEMORY:
            raise SpecError(f"memory_limit {mem} bytes is below the {MIN_MEMORY >> 20} MiB a workspace needs")
        disk = parse_size(self.disk_limit, "disk_limit")
        if disk is not None and disk < MIN_DISK:
            raise SpecError(f"disk_limit {disk} bytes is below the {MIN_DISK >> 20} MiB a workspace needs")
        if disk is not None and disk > MAX_DISK:
            raise SpecError(f"disk_limit {disk} bytes is past {MAX_DISK} (1 EiB); use None for no limit")
        if self.cpu_limit is not None and (
            isinstance(self.cpu_limit, bool) or not isinstance(self.cpu_limit, (int, float))
            or not 0.01 <= self.cpu_limit <= 4096
        ):
            raise SpecError(f"cpu_limit must be a number of cores from 0.01 to 4096, got {self.cpu_limit!r}")
        if self.pids_limit is not None and (
            isinstance(self.pids_limit, bool) or not isinstance(self.pids_limit, int) or self.pids_limit < 4
        ):
            raise SpecError(f"pids_limit must be an integer >= 4 (init, shim, shell, command), got {self.pids_limit!r}")
        if not isinstance(self.network, str) or self.network not in NETWORK_MODES:
            raise SpecError(f"unknown network mode {self.network!r}; use one of {', '.join(NETWORK_MODES)}")
        if self.nat and self.network != "bridge":
            raise SpecError("nat=True needs network='bridge'")
        from .network.policy import parse as parse_egress  # the network package imports this module
        policy = parse_egress(self.egress)
        if not isinstance(self.cgroup, str) or self.cgroup not in CGROUP_VERSIONS:
            raise SpecError(f"unknown cgroup layout {self.cgroup!r}; use one of {', '.join(CGROUP_VERSIONS)}")
        if self.start is not None and self.start != "entrypoint":
            raise SpecError(f"start must be None or 'entrypoint', got {self.start!r}")
        if self.start == "entrypoint" and not self.rootfs.startswith(("docker:", "oci:", "registry:")):
            raise SpecError("start='entrypoint' needs an image rootfs ('docker:IMAGE', 'oci:DIR' or 'registry:REF')")
        for k, v in self.env.items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
                raise SpecError(f"env entry {k!r}={v!r} is invalid: names are non-empty without '=' or NUL")
        cpu = None if self.cpu_limit is None else float(self.cpu_limit)
        return WorkspaceSpec(**{**asdict(self), "memory_limit": mem, "disk_limit": disk, "cpu_limit": cpu,
                                "egress": policy.to_dict() if policy is not None else None})

    def to_dict(self) -> dict:
        return asdict(self)
