"""An image's runtime configuration (the OCI config's `config` object), as `docker exec` and
`docker run` apply it: Env, WorkingDir and User for every command, Entrypoint and Cmd for the
workspace's service, ExposedPorts for ws.info()."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..state import Rootfs
from . import store


@dataclass(frozen=True)
class ImageConfig:
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None  # as the image says it: name, uid, name:group or uid:gid
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    exposed_ports: tuple[str, ...] = ()  # "80/tcp"

    @classmethod
    def from_oci(cls, raw: dict[str, Any] | None) -> ImageConfig:
        raw = raw or {}
        env = {}
        for item in raw.get("Env") or []:
            k, _, v = str(item).partition("=")
            if k:
                env[k] = v
        return cls(
            env=env,
            working_dir=raw.get("WorkingDir") or None,
            user=raw.get("User") or None,
            entrypoint=tuple(str(a) for a in raw.get("Entrypoint") or ()),
            cmd=tuple(str(a) for a in raw.get("Cmd") or ()),
            exposed_ports=tuple(sorted(raw.get("ExposedPorts") or {})),
        )

    @property
    def service(self) -> tuple[str, ...]:
        """What `docker run IMAGE` starts: Entrypoint followed by Cmd."""
        return self.entrypoint + self.cmd


def of(rootfs: Rootfs | None) -> ImageConfig | None:
    """The configuration of the image a rootfs was made from; None for other root file systems."""
    if rootfs is None or rootfs.kind != "image":
        return None
    digest = rootfs.digest.split("-u", 1)[0]  # a userns copy's digest names its image's
    rec = store.load_image(digest)
    return ImageConfig.from_oci(rec.get("config")) if rec else ImageConfig()
