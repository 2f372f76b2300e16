"""Images from a local Docker engine, through the `docker` SDK's image save.

The engine's `save` writes the legacy archive (manifest.json, <config>.json and one
uncompressed layer.tar per layer, as docker 20.10 does), never a container export: each layer
goes into the store on its own, keyed by its diff_id and checked against it. The save is
skipped when every diff_id in the image's RootFS.Layers is already in the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import tarfile
import tempfile
from typing import Any

from ..errors import CorruptLayer, EngineUnavailable, ImageError, ImageNotFound, UnsupportedMediaType
from . import store

TIMEOUT = 120.0  # seconds the engine may take to answer any one request (a save streams)


def client() -> Any:
    try:
        import docker  # type: ignore[import-untyped]
    except ImportError as e:
        raise EngineUnavailable("rootfs 'docker:...' needs the docker SDK: pip install 'bunshin[docker]'") from e
    try:
        c = docker.from_env(timeout=TIMEOUT)
        c.ping()
    except Exception as e:
        raise EngineUnavailable(
            f"no Docker engine is reachable ({e.__class__.__name__}: {e}); start dockerd or set DOCKER_HOST, "
            "or use rootfs='oci:DIR', 'registry:REF', 'host', 'debian' or a directory"
        ) from e
    return c


def fetch(name: str) -> tuple[str, list[str], dict]:
    """The image `name` (id, diff_ids bottom first, configuration), its layers in the store."""
    import docker  # type: ignore[import-untyped]

    c = client()
    try:
        try:
            img = c.images.get(name)
        except docker.errors.ImageNotFound:
            raise ImageNotFound(f"the Docker engine has no image {name!r}; build or pull it first "
                                "(or use rootfs='registry:REF')") from None
        rootfs = img.attrs.get("RootFS") or {}
        if rootfs.get("Type") != "layers":
            raise UnsupportedMediaType(f"image {name!r} has a root file system of type {rootfs.get('Type')!r}")
        diff_ids = list(rootfs.get("Layers") or [])
        if not all(store.has(d) for d in diff_ids):
            _save_layers(img, name, diff_ids)
        return img.id, diff_ids, img.attrs.get("Config") or {}
    except docker.errors.DockerException as e:
        raise ImageError(f"reading docker image {name!r} failed: {e}") from e
    finally:
        c.close()


def _save_layers(img: Any, name: str, diff_ids: list[str]) -> None:
    store.ROOT.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=store.ROOT, prefix=f"{store.TMP}save-", suffix=f"-{os.getpid()}")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in img.save(chunk_size=1 << 20, named=False):
                f.write(chunk)
        with tarfile.open(tmp) as archive:
            try:
                manifest = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
            except (KeyError, ValueError, TypeError) as e:
                raise UnsupportedMediaType(f"the engine's save of {name!r} has no legacy manifest.json") from e
            if len(manifest) != 1 or len(manifest[0].get("Layers", [])) != len(diff_ids):
                raise CorruptLayer(f"the engine's save of {name!r} lists {len(manifest[0].get('Layers', []))} "
                                   f"layers where its RootFS has {len(diff_ids)}")
            for diff_id, member in zip(diff_ids, manifest[0]["Layers"], strict=True):
                if store.has(diff_id):
                    continue

                def opener(member: str = member) -> Any:
                    f = archive.extractfile(member)
                    if f is None:
                        raise CorruptLayer(f"the save of {name!r} has no file {member}")
                    return f

                try:
                    store.add(diff_id, opener)
                except KeyError as e:
                    raise CorruptLayer(f"the save of {name!r} lacks its layer {member}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
