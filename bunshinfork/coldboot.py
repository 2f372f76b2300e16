"""A workspace's files without its memory: E2B's filesystem-only pause and its cold boot.

save() keeps a workspace's layers above its rootfs (flattened; whiteouts and opaque directories
kept) with its spec, egress rules and a caller's extra state, then destroys it: no memory, no
process is kept. boot() is the cold boot that follows: a new workspace (so a new hostname and
boot id, the identity rule) with the files put back as they were. reboot() is the same cold boot
from a workspace paused to disk with its memory (pause_to_disk), its memory ignored: the rescue
for a memory image that will not restore. The files go back by tar run *inside* the new
workspace, as its root, so nothing a saved layer names can reach past that workspace's root.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

from . import idmap
from .errors import WorkspaceStateError
from .fs import SAVED_LAYER, frozen
from .spec import WorkspaceSpec
from .state import SnapshotMeta


class Live(Protocol):
    """What this module uses of a Workspace (it is handed one: the workspace module imports this
    one, not the other way round)."""

    id: str

    @property
    def record(self) -> Any: ...
    @property
    def state_dir(self) -> Path: ...
    @property
    def files(self) -> Any: ...
    @property
    def commands(self) -> Any: ...
    def info(self) -> Any: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def destroy(self) -> None: ...
    def set_egress(self, rules: Any) -> Any: ...


Create = Callable[..., Any]  # create(spec, timeout=...)

_LAYER, _META = "layer", "meta.json"
# The old boot's identity and init: a cold boot gets its own (the identity rule).
_IDENTITY = {".bunshin", "etc/hostname", "etc/hosts"}
_ARCHIVE, _DELETED, _OPAQUE = "/.bunshin-files.tar", "/.bunshin-files.del", "/.bunshin-files.opq"
_APPLY_SECONDS = 600


def saved(dest: Path) -> bool:
    """Whether `dest` holds a filesystem-only pause (save)."""
    return (dest / _META).is_file()


def save(ws: Live, dest: Path, extra: dict[str, Any] | None = None) -> None:
    """E2B's filesystem-only pause: the workspace's files (its layers above the rootfs, flattened,
    whiteouts and opaque directories kept, copied while it is frozen) saved at `dest` with its
    spec, egress rules and `extra` (JSON: a front door's own state); then the workspace is
    destroyed: no memory, no process is kept. A failed save leaves it running, unchanged."""
    rec = ws.record
    fs = rec.fs
    if fs is None or fs.layer is None:
        raise WorkspaceStateError(f"workspace {ws.id} has no layer to keep")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700, parents=True)
    was_frozen = ws.info().state == "paused"
    try:
        if not was_frozen:
            ws.pause()  # the files stop changing while they are copied
        flat = frozen.flatten([fs.layer, *fs.lowers], tmp / _LAYER, subvolume=False)
        os.rename(flat.path, tmp / _LAYER)
        meta = {"spec": rec.spec.to_dict(), "egress": ws.info().egress, "extra": extra or {}}
        (tmp / _META).write_text(json.dumps(meta))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not was_frozen:
            ws.resume()
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    ws.destroy()  # frozen still: nothing it does after the copy is kept or half-kept


def boot(dest: Path, timeout: float | None, create: Create) -> tuple[Any, dict[str, Any]]:
    """The cold boot of a filesystem-only pause: a new workspace (new hostname, new boot id) with
    the saved spec and egress rules, its `timeout` (None or 0: none), and the saved files put
    back as they were (what was deleted deleted); with the `extra` save() kept. `dest` is left
    for the caller to remove once it records the new workspace."""
    meta = json.loads((dest / _META).read_text())
    spec = WorkspaceSpec(**meta["spec"])
    ws = create(spec, timeout=timeout or None)
    try:
        if meta.get("egress") is not None:
            ws.set_egress(meta["egress"])
        _put_back(ws, dest / _LAYER / "upper", idmap.BASE if spec.userns else 0)
    except BaseException:
        ws.destroy()
        raise
    return ws, dict(meta.get("extra") or {})


def reboot(ws: Live, timeout: float | None, keep: tuple[str, ...], create: Create) -> Any:
    """E2B's on_resume="reboot" (connect {"memory": false}) of a workspace paused to disk with
    its memory: a cold boot from the files its pause saved (the saved snapshot's flattened
    layer, its spec), its memory ignored; the files named in `keep` (a front door's state
    beside the record, relative to state_dir) are carried over; the paused workspace is then
    destroyed."""
    saved = ws.record.saved
    if ws.info().state != "paused-to-disk" or saved is None:
        raise WorkspaceStateError(f"workspace {ws.id} is not paused to disk")
    meta = SnapshotMeta.load(Path(saved))
    new = create(meta.spec, timeout=timeout or None)
    try:
        _put_back(new, Path(saved) / SAVED_LAYER / "upper", idmap.BASE if meta.spec.userns else 0)
        for name in keep:
            side = ws.state_dir / name
            if side.is_file():
                (new.state_dir / name).write_text(side.read_text())
    except BaseException:
        new.destroy()
        raise
    ws.destroy()
    return new


def _put_back(ws: Live, upper: Path, shift: int) -> None:
    """The saved layer's entries, written into the new workspace by tar in it (as root: nothing
    it extracts can reach past the workspace's own root), after what the layer's whiteouts
    delete and what its opaque directories hide is removed there."""
    with tempfile.TemporaryFile() as archive:
        whiteouts, opaque = _archive(upper, archive, shift)
        archive.seek(0)
        ws.files.write(_ARCHIVE, archive)
    ws.files.write(_DELETED, b"".join(p.encode() + b"\0" for p in whiteouts))
    ws.files.write(_OPAQUE, b"".join(p.encode() + b"\0" for p in opaque))
    keep = " ".join(f"! -path /{p}" for p in sorted(_IDENTITY))
    script = (f"set -e; xargs -0 -r rm -rf -- < {_DELETED}; "
              f"xargs -0 -r -I% sh -c 'test ! -d \"$1\" || find \"$1\" -mindepth 1 -maxdepth 1 {keep} "
              f"-exec rm -rf -- {{}} +' sh % < {_OPAQUE}; "
              f"tar -xpf {_ARCHIVE} -C / --numeric-owner; rm -f {_ARCHIVE} {_DELETED} {_OPAQUE}")
    result = ws.commands.run(["/bin/sh", "-c", script], timeout=_APPLY_SECONDS)
    if result.exit_code != 0:
        raise WorkspaceStateError(f"putting the saved files back into {ws.id} failed: {result.stderr.strip()}")


def _archive(upper: Path, out: IO[bytes], shift: int) -> tuple[list[str], list[str]]:
    """A tar of the layer's entries (no link followed: they are the sandbox's); the paths its
    whiteouts delete, and its opaque directories (whose earlier contents it hides)."""
    whiteouts: list[str] = []
    opaque: list[str] = []
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = [""]
        while dirs:
            rel = dirs.pop()
            with os.scandir(upper / rel) as it:
                for entry in sorted(it, key=lambda e: e.name):
                    name = f"{rel}/{entry.name}" if rel else entry.name
                    if name in _IDENTITY:
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                        whiteouts.append("/" + name)
                        continue
                    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                        continue  # inert on a nodev root; a socket is nobody's once its process is gone
                    info = tar.gettarinfo(entry.path, arcname=name)
                    if shift:
                        info.uid, info.gid = max(0, info.uid - shift), max(0, info.gid - shift)
                    if info.isreg():
                        with open(entry.path, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
                    if stat.S_ISDIR(st.st_mode):
                        if frozen.is_opaque(entry.path):
                            opaque.append("/" + name)
                        dirs.append(name)
    return whiteouts, opaque
