"""Container images as workspaces, layer by layer (see docs/images.md).

A rootfs 'docker:IMAGE', 'oci:DIR[:TAG]' or 'registry:REF' becomes the image's layers, each
unpacked once into the layer store (store.py, unpack.py) and stacked as overlay lowers under
the workspace's private upper, never flattened. Its configuration (config.py) gives every
command the image's Env, WorkingDir and User, and the workspace its service and ports.
"""

from __future__ import annotations

from ..state import Rootfs
from . import config, reference, store
from .config import ImageConfig

__all__ = ["ImageConfig", "by_digest", "config", "is_image", "reference", "resolve", "store"]

is_image = reference.is_image


def resolve(source: str) -> Rootfs:
    """The Rootfs of an image reference, its layers unpacked into the store as needed."""
    ref = reference.parse(source)
    if ref.kind == "docker":
        from . import docker_engine

        image, diff_ids, cfg = docker_engine.fetch(ref.name)
    elif ref.kind == "oci":
        from . import oci_layout

        image, diff_ids, cfg = oci_layout.fetch(ref.name, ref.tag)
    else:
        from . import registry

        image, diff_ids, cfg = registry.fetch(ref.name)
    digest = store.save_image(image, diff_ids, cfg)
    return Rootfs(kind="image", lowerdirs=store.lowerdirs(diff_ids), digest=digest, source=str(ref))


def by_digest(source: str, digest: str) -> Rootfs | None:
    """The Rootfs of an image the store already holds whole, without asking its source (a saved
    snapshot or template loads with no engine or registry at hand); None if it does not."""
    rec = store.load_image(digest)
    if rec is None or not all(store.has(d) for d in rec["diff_ids"]):
        return None
    return Rootfs(kind="image", lowerdirs=store.lowerdirs(rec["diff_ids"]), digest=digest, source=source)
