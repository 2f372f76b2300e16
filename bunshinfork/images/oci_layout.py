"""Images from an OCI image layout directory (index.json, blobs/sha256/...), as skopeo and
buildah write them. Every blob read is checked against its digest, and every layer's
uncompressed content against the config's diff_ids."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ..errors import CorruptLayer, ImageError, ImageNotFound, ImageReferenceError, UnsupportedMediaType
from . import store
from .unpack import HashingReader

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
REF_NAME = "org.opencontainers.image.ref.name"
PLAIN = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.nondistributable.v1.tar",
         "application/vnd.docker.image.rootfs.diff.tar")
GZIP = ("application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip")
# zstd layers go through Debian's zstd tool (set-up installs it), a real decoder rather than a
# Python binding the project would have to add.
ZSTD = ("application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd")
ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = 0x184D2A50  # 0x184D2A50-0x184D2A5F
KNOWN = PLAIN + GZIP + ZSTD
UNPACKS = "uncompressed, gzip and zstd layers"
MAX_JSON = 4 << 20  # an index, manifest or config larger than this is not one
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def _blob(layout: Path, digest: str) -> Path:
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise UnsupportedMediaType(f"blob digest {digest!r} is not sha256:<64 hex digits>")
    p = layout / "blobs" / "sha256" / digest.split(":", 1)[1]
    if not p.is_file():
        raise CorruptLayer(f"OCI layout {layout} lacks the blob {digest}")
    return p


def _json_blob(layout: Path, digest: str) -> dict[str, Any]:
    p = _blob(layout, digest)
    with open(p, "rb") as f:
        raw = f.read(MAX_JSON + 1)
    if len(raw) > MAX_JSON:
        raise CorruptLayer(f"blob {digest} in {layout} is too large for JSON")
    if store.image_id(raw) != digest:
        raise CorruptLayer(f"blob {digest} in {layout} is corrupt (its content's digest differs)")
    try:
        out = json.loads(raw)
    except ValueError as e:
        raise CorruptLayer(f"blob {digest} in {layout} is not JSON: {e}") from e
    if not isinstance(out, dict):
        raise CorruptLayer(f"blob {digest} in {layout} is not a JSON object")
    return out


def _pick(layout: Path, descs: list[dict[str, Any]], tag: str | None, where: str) -> dict[str, Any]:
    if tag is not None:
        descs = [d for d in descs if (d.get("annotations") or {}).get(REF_NAME) == tag]
        if not descs:
            raise ImageNotFound(f"OCI layout {layout} has no image tagged {tag!r} ({where})")
    if len(descs) != 1:
        raise ImageReferenceError(f"OCI layout {layout} holds {len(descs)} images; name one: oci:{layout}:TAG")
    return descs[0]


def _manifest(layout: Path, desc: dict[str, Any]) -> dict[str, Any]:
    """The image manifest `desc` names, through an index for this host's platform."""
    for _ in range(4):
        media = desc.get("mediaType")
        if media in (INDEX, DOCKER_LIST):
            idx = _json_blob(layout, desc.get("digest", ""))
            arch = _ARCH.get(platform.machine(), platform.machine())
            fits = [d for d in idx.get("manifests") or []
                    if (d.get("platform") or {}).get("os", "linux") == "linux"
                    and (d.get("platform") or {}).get("architecture", arch) == arch]
            if not fits:
                raise ImageNotFound(f"OCI layout {layout} has no image for linux/{arch}")
            desc = fits[0]
        elif media in (MANIFEST, DOCKER_MANIFEST):
            return _json_blob(layout, desc.get("digest", ""))
        else:
            raise UnsupportedMediaType(f"OCI layout {layout}: manifest media type {media!r} is not supported")
    raise UnsupportedMediaType(f"OCI layout {layout}: indexes nest too deep")


@contextlib.contextmanager
def _layer_stream(blob: Path, digest: str, media: str) -> Iterator[IO[bytes]]:
    if media in ZSTD:
        with _zstd_stream(blob, digest) as inner:
            yield inner
        return
    with open(blob, "rb") as raw:
        outer = HashingReader(raw)
        inner: IO[bytes]
        if media in PLAIN:
            inner = outer  # type: ignore[assignment]
        elif media in GZIP:
            inner = gzip.GzipFile(fileobj=outer)  # type: ignore[arg-type]
        else:
            raise UnsupportedMediaType(f"layer {digest} has media type {media!r}; bunshin unpacks {UNPACKS}")
        try:
            yield inner
            while inner.read(1 << 20):
                pass
        except (OSError, EOFError) as e:
            raise CorruptLayer(f"layer {digest} does not decompress: {e}") from e
        outer.drain()
        if outer.digest() != digest:
            raise CorruptLayer(f"layer blob {digest} is corrupt: its content's digest is {outer.digest()}")


@contextlib.contextmanager
def _zstd_stream(blob: Path, digest: str) -> Iterator[IO[bytes]]:
    """The blob decompressed by `zstd -d`, its compressed digest checked first (the tool reads
    the same open file; what it writes is checked against the diff_id as every layer is)."""
    tool = shutil.which("zstd")
    if tool is None:
        raise UnsupportedMediaType(f"layer {digest} is zstd-compressed and this host has no zstd tool "
                                   "(apt-get install zstd; scripts/setup.sh installs it)")
    with open(blob, "rb") as raw:
        outer = HashingReader(raw)
        outer.drain()
        if outer.digest() != digest:
            raise CorruptLayer(f"layer blob {digest} is corrupt: its content's digest is {outer.digest()}")
        # The tool also reads gzip, xz and lz4: the label must be the truth (a zstd frame, or a
        # skippable frame before one).
        magic = int.from_bytes(os.pread(raw.fileno(), 4, 0).ljust(4, b"\0"), "little")
        if magic != ZSTD_MAGIC and magic & 0xFFFFFFF0 != ZSTD_SKIPPABLE:
            raise CorruptLayer(f"layer {digest} does not decompress: it is labelled zstd but is not zstd")
        # The tool reads the descriptor itself: rewind it, not the buffer in front of it.
        os.lseek(raw.fileno(), 0, os.SEEK_SET)
        proc = subprocess.Popen([tool, "-d", "-c", "-q", "--no-progress"], stdin=raw, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            yield proc.stdout
            while proc.stdout.read(1 << 20):
                pass
            err = proc.stderr.read(4096).decode(errors="replace").strip()
            if proc.wait() != 0:
                raise CorruptLayer(f"layer {digest} does not decompress: zstd: {err or proc.returncode}")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()


def fetch(directory: str, tag: str | None) -> tuple[str, list[str], dict]:
    """The image at `directory` (tagged `tag`): its id, diff_ids bottom first and configuration,
    its layers in the store."""
    layout = Path(directory)
    try:
        index = json.loads((layout / "index.json").read_text())
        marker = json.loads((layout / "oci-layout").read_text())
    except FileNotFoundError:
        raise ImageNotFound(f"{directory} is not an OCI image layout (no index.json or oci-layout)") from None
    except (OSError, ValueError) as e:
        raise ImageError(f"OCI layout {directory} is unreadable: {e}") from e
    if not isinstance(marker, dict) or marker.get("imageLayoutVersion") != "1.0.0" or not isinstance(index, dict):
        raise UnsupportedMediaType(f"{directory} is not an OCI image layout of version 1.0.0")
    manifest = _manifest(layout, _pick(layout, list(index.get("manifests") or []), tag, "index.json"))
    cfg_desc = manifest.get("config") or {}
    config = _json_blob(layout, cfg_desc.get("digest", ""))
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
    layer_descs = list(manifest.get("layers") or [])
    if len(diff_ids) != len(layer_descs):
        raise CorruptLayer(f"image in {directory} has {len(layer_descs)} layers but {len(diff_ids)} diff_ids")
    for diff_id, desc in zip(diff_ids, layer_descs, strict=True):
        if store.has(diff_id):
            continue
        blob_digest = desc.get("digest", "")
        media = desc.get("mediaType", "")
        blob = _blob(layout, blob_digest)
        if media not in KNOWN:
            raise UnsupportedMediaType(f"layer {blob_digest} has media type {media!r}; bunshin unpacks {UNPACKS}")

        def opener(blob: Path = blob, digest: str = blob_digest, media: str = media) -> Any:
            return _layer_stream(blob, digest, media)

        store.add(diff_id, opener)
    return cfg_desc["digest"], diff_ids, config.get("config") or {}


def exists(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "index.json"))
