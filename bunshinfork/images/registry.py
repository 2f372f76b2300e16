"""Images from a registry, copied with skopeo (Debian's) into one shared OCI layout under the
image cache, then read as an OCI layout: no registry client of bunshin's own.

TLS is verified unless the registry is on loopback (as the Docker engine treats 127.0.0.0/8 and
localhost as insecure registries) or BUNSHIN_REGISTRY_TLS_VERIFY=0 says otherwise;
BUNSHIN_REGISTRY_TLS_VERIFY=1 verifies even on loopback. A reference already copied is used
from the cache; pull() copies it again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

from .. import state
from ..errors import ImageError, ImageNotFound
from . import store

LAYOUT = store.ROOT / "oci"
TIMEOUT = 1800.0  # seconds a copy may take (a large image over a slow link)
_LOOPBACK = ("localhost", "127.", "[::1]")


def tag_for(ref: str) -> str:
    """The cache layout's tag for `ref` (an OCI tag cannot hold '/' or '@')."""
    return "r" + hashlib.sha256(ref.encode()).hexdigest()[:32]


def tls_verify(ref: str) -> bool:
    forced = os.environ.get("BUNSHIN_REGISTRY_TLS_VERIFY")
    if forced is not None:
        return forced.strip().lower() not in ("0", "false", "no")
    domain = ref.split("/", 1)[0] if "/" in ref else ""
    return not domain.startswith(_LOOPBACK)


def cached(ref: str) -> bool:
    import json

    try:
        index = json.loads((LAYOUT / "index.json").read_text())
    except (OSError, ValueError):
        return False
    tag = tag_for(ref)
    return any((m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag
               for m in index.get("manifests") or [])


def pull(ref: str, tls: bool | None = None) -> str:
    """Copy `ref` into the cache layout; returns the layout's tag for it."""
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError("rootfs 'registry:...' needs skopeo: apt-get install skopeo (scripts/setup.sh does)")
    verify = tls_verify(ref) if tls is None else tls
    tag = tag_for(ref)
    LAYOUT.parent.mkdir(parents=True, exist_ok=True)
    with state.lock("registry-cache", root=LAYOUT.parent):
        try:
            proc = subprocess.run(
                [skopeo, "copy", "--quiet", f"--src-tls-verify={'true' if verify else 'false'}",
                 f"docker://{ref}", f"oci:{LAYOUT}:{tag}"],
                capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise ImageError(f"skopeo copy of {ref!r} ran past {TIMEOUT:.0f}s and was stopped") from e
    if proc.returncode != 0:
        err = proc.stderr.strip()[-800:]
        if any(s in err for s in ("manifest unknown", "name unknown", "not found")):
            raise ImageNotFound(f"registry has no image {ref!r}: {err}")
        raise ImageError(f"skopeo copy of {ref!r} failed (exit {proc.returncode}): {err}")
    return tag


def fetch(ref: str) -> tuple[str, list[str], dict]:
    from . import oci_layout

    tag = tag_for(ref) if cached(ref) else pull(ref)
    return oci_layout.fetch(str(LAYOUT), tag)
