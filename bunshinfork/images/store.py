"""The image layer store: every image layer unpacked once, keyed by its uncompressed digest.

    CACHE/images/layers/<hex>     a layer's files, as an overlay lower (diff_id sha256:<hex>)
    CACHE/images/configs/<id>.json an image: its layers (bottom first) and its configuration
    CACHE/l/<short>               a short link to a layer, as Docker's overlay2 keeps in l/

Workspaces stack the short links, not the layers' own paths, so that the overlay options of an
image of many layers stay below frozen.MAX_OPTIONS: CRIU reads mountinfo lines of at most
4 KiB. Images sharing a base share its layers' inodes, so the host caches their pages once.

A layer is unpacked into a temporary name (.tmp-<hex>-*) under a per-layer lock and renamed
into place only once its digest checked: a half-unpacked or corrupt layer is never used. The
store is a content-addressed cache like the Debian one (nothing in it is a workspace's
state): gc only removes the temporaries a crashed unpack left.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .. import state
from ..errors import CorruptLayer, ImageError
from . import templates, unpack

CACHE = Path(os.environ.get("BUNSHIN_CACHE", "/var/cache/bunshin"))
ROOT = CACHE / "images"
LAYERS = ROOT / "layers"
CONFIGS = ROOT / "configs"
LINKS = CACHE / "l"
TMP = ".tmp-"
SHORT = 12  # hex digits of a short link's name; longer only on a clash
_DIFF_ID = re.compile(r"^sha256:([0-9a-f]{64})$")


_hardened: set[str] = set()


def harden() -> None:
    """Once per process: the image store is nosuid,nodev (a self-bind of ROOT: images ship
    setuid files and capabilities, which must give the host's users nothing), ROOT 0711 and
    LAYERS 0700, so that no local user reaches a layer's files; the saved templates' root
    (snapshots of workspaces) 0700. Fixes a store made before, as set-up reuses CACHE."""
    from ..fs.store import PRIVATE_MODE, ROOT_MODE, seal  # fs imports this package

    if str(ROOT) in _hardened or os.geteuid() != 0:  # only root changes them
        return
    ROOT.mkdir(parents=True, exist_ok=True)
    seal(ROOT)
    os.chmod(ROOT, ROOT_MODE)
    LAYERS.mkdir(mode=PRIVATE_MODE, exist_ok=True)
    os.chmod(LAYERS, PRIVATE_MODE)
    if templates.ROOT.parent.is_dir():
        templates.ROOT.mkdir(mode=PRIVATE_MODE, exist_ok=True)
        os.chmod(templates.ROOT, PRIVATE_MODE)
    _hardened.add(str(ROOT))


class LayerWarning(UserWarning):
    """Some entries of a layer are missing: device nodes, which layers may not carry (unpack.py)."""


def hex_of(diff_id: str) -> str:
    m = _DIFF_ID.match(diff_id)
    if not m:
        raise CorruptLayer(f"{diff_id!r} is not a sha256 layer digest")
    return m.group(1)


def path(diff_id: str) -> Path:
    return LAYERS / hex_of(diff_id)


def has(diff_id: str) -> bool:
    return path(diff_id).is_dir()


def link(diff_id: str) -> str:
    """The short path a workspace stacks for this layer (made if missing)."""
    h = hex_of(diff_id)
    LINKS.mkdir(parents=True, exist_ok=True)
    target = os.path.relpath(LAYERS / h, LINKS)
    for n in (SHORT, 24, 64):
        p = LINKS / h[:n]
        try:
            os.symlink(target, p)
            return str(p)
        except FileExistsError:
            if os.readlink(p) == target:
                return str(p)
    raise ImageError(f"{LINKS} has a link for {diff_id} that points elsewhere; remove {LINKS / h[:SHORT]}")


@contextlib.contextmanager
def _layer_lock(h: str, blocking: bool = True):
    LAYERS.mkdir(parents=True, exist_ok=True)
    fd = os.open(LAYERS / f".{h}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        yield
    finally:
        os.close(fd)


def add(diff_id: str, opener: Callable[[], IO[bytes]]) -> list[str]:
    """Unpack the layer `opener` streams (uncompressed) into the store unless it is there;
    returns the nodes that could not be made. CorruptLayer when its digest is not `diff_id`."""
    h = hex_of(diff_id)
    harden()
    dest = LAYERS / h
    if dest.is_dir():
        return []
    with _layer_lock(h):
        if dest.is_dir():
            return []
        tmp = Path(tempfile.mkdtemp(dir=LAYERS, prefix=f"{TMP}{h}-"))
        try:
            os.chmod(tmp, 0o755)
            with opener() as stream:
                done = unpack.unpack(stream, tmp)
            if done.diff_id != diff_id:
                raise CorruptLayer(f"layer {diff_id} is corrupt: its content's digest is {done.diff_id}")
            os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if done.skipped:
        warnings.warn(f"layer {diff_id}: {len(done.skipped)} entries could not be made and are missing: "
                      + "; ".join(done.skipped[:5]), LayerWarning, stacklevel=2)
    return done.skipped


def image_id(config: bytes) -> str:
    return "sha256:" + hashlib.sha256(config).hexdigest()


def save_image(image: str, diff_ids: list[str], config: dict) -> str:
    """Record an image (its layers, bottom first, and its configuration) by its id; returns
    the digest its Rootfs carries."""
    digest = "img-" + hex_of(image)[:16]
    CONFIGS.mkdir(parents=True, exist_ok=True)
    out = CONFIGS / f"{digest}.json"
    if not out.exists():
        tmp = out.with_name(f"{TMP}{digest}-{os.getpid()}")
        tmp.write_text(json.dumps({"id": image, "diff_ids": diff_ids, "config": config}))
        os.rename(tmp, out)
    return digest


def load_image(digest: str) -> dict | None:
    """What save_image recorded under `digest`, or None."""
    if not re.fullmatch(r"img-[0-9a-f]{16}", digest):
        return None
    try:
        return json.loads((CONFIGS / f"{digest}.json").read_text())
    except (OSError, ValueError):
        return None


def lowerdirs(diff_ids: list[str]) -> tuple[str, ...]:
    """An image's layers as overlay lowers, top first. A layer that comes twice (an empty RUN's)
    is stacked once, where it is highest: its lower copy shows nothing the upper one hides."""
    harden()
    seen: set[str] = set()
    out = []
    for d in reversed(diff_ids):
        if d in seen:
            continue
        seen.add(d)
        if not has(d):
            raise ImageError(f"layer {d} is missing from the layer store {LAYERS}")
        out.append(link(d))
    return tuple(out)


def temporaries() -> set[str]:
    """Unpacks in progress or abandoned (the tests' leak census counts them)."""
    found: set[str] = set()
    for d in (ROOT, LAYERS, CONFIGS):
        if d.is_dir():
            found |= {str(d / n) for n in os.listdir(d) if n.startswith(TMP)}
    return found


def gc() -> list[str]:
    """Remove temporaries whose unpack is no longer running (its layer's lock is free)."""
    removed = []
    for p in sorted(temporaries()):
        name = Path(p).name
        h = name[len(TMP):].split("-", 1)[0]
        if Path(p).parent == LAYERS:
            try:
                with _layer_lock(h, blocking=False):
                    shutil.rmtree(p, ignore_errors=True)
            except BlockingIOError:
                continue
        else:
            pid = name.rsplit("-", 1)[-1]
            if pid.isdigit() and state.proc_starttime(int(pid)) is not None:
                continue
            with contextlib.suppress(OSError):
                os.unlink(p)
        removed.append(p)
    return removed
