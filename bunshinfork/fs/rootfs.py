"""Read-only lower layers for workspace root file systems.

Four sources:
- "host": the host's own /usr (and the merged-/usr symlinks /bin, /sbin, /lib*) under a
  generated skeleton that hides every other top-level entry of the host (whiteouts and
  opaque directories) and supplies a minimal /etc. The host's /etc, /root, /home and
  /var never show through.
- "debian": a debootstrap-built bookworm with what E2B's base image gives a sandbox (python3,
  sudo, git, curl, CA certificates), cached after the first build. `bunshin serve`'s `base`.
- a directory path.
- a container image ("docker:IMAGE", "oci:DIR[:TAG]", "registry:REF"): its layers, each
  unpacked once into the image layer store and stacked as lowers (bunshinfork.images).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import idmap, images, state
from ..errors import RootfsError
from ..state import Rootfs

CACHE = Path(os.environ.get("BUNSHIN_CACHE", "/var/cache/bunshin"))
HOST_KEEP = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Directories every workspace has; created empty and opaque so the host's never show through.
SKELETON_DIRS = {
    "etc": 0o755, "root": 0o700, "home": 0o755, "var": 0o755, "tmp": 0o1777, "run": 0o755,
    "proc": 0o555, "dev": 0o755, "sys": 0o555, "mnt": 0o755, "opt": 0o755, "srv": 0o755,
    "media": 0o755, "boot": 0o755,
}
VAR_DIRS = ("var/tmp", "var/log", "var/lib", "var/cache", "var/spool", "var/mail")
# Non-secret host configuration that programs from /usr expect to find.
HOST_ETC_COPY = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "python3", "python3.11",
    "fonts", "mime.types", "protocols", "services", "ethertypes", "inputrc", "debian_version",
    "os-release", "bash.bashrc", "X11", "gai.conf", "ca-certificates",
)
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# E2B's base template (e2b-dev/E2B templates/base) gives its user python3, git, curl, ps and
# password-less sudo; serve's `base` is this rootfs, so a sandbox's tools are the rootfs's own
# (ownable by a user namespace), not the host's /usr.
DEBIAN_PACKAGES = ("python3", "sudo", "git", "curl", "ca-certificates", "procps")


def resolve(source: str, shift: int = 0) -> Rootfs:
    """Turn a spec's rootfs string into lower layers, building and caching them as needed;
    with `shift`, a copy owned by the host ids a user namespace maps its own to (shifted)."""
    if source == "host":
        found = host()
    elif source in ("debian", f"debian:{DEBIAN_SUITE}"):
        found = debian()
    elif images.is_image(source):
        found = images.resolve(source)
    else:
        found = directory(source)
    return shifted(found, idmap.IdMap(shift, idmap.SIZE)) if shift else found


SHIFTED = "userns"  # CACHE/rootfs/userns-BASE/DIGEST: a rootfs's copy for one id range
_SOURCE = ".bunshin-source"  # beside a shifted copy's layers: what it was copied from


def shifted(rf: Rootfs, m: idmap.IdMap) -> Rootfs:
    """A copy of `rf` whose files belong to the host ids `m` maps theirs to, built once per
    range and cached, as Docker's userns-remap keeps /var/lib/docker/100000.100000. Root
    inside a user namespace can use and change only the files of ids its map holds; the
    host's own ids show as nobody and refuse it. The host's /usr cannot be given away, so
    rootfs='host' is refused before this (WorkspaceSpec.validate)."""
    if rf.kind == "host":
        raise RootfsError("the host's own /usr cannot be shifted into a user namespace; use rootfs='debian', "
                          "a directory or 'docker:IMAGE'")
    dest = CACHE / "rootfs" / f"{SHIFTED}-{m.base}" / rf.digest
    if not (dest / _SOURCE).exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with state.lock(f"shift-{rf.digest}", root=dest.parent):
            if not (dest / _SOURCE).exists():
                _copy_shifted(rf, dest, m)
    return Rootfs(kind=rf.kind, lowerdirs=tuple(str(dest / str(i)) for i in range(len(rf.lowerdirs))),
                  digest=f"{rf.digest}-u{m.base}", source=rf.source, shift=m.base)


def _copy_shifted(rf: Rootfs, dest: Path, m: idmap.IdMap) -> None:
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{rf.digest}-"))
    try:
        for i, lower in enumerate(rf.lowerdirs):
            # cp -a keeps what copytree would not: device nodes (overlay whiteouts), hard links,
            # trusted.* xattrs (opaque directories) and file capabilities; reflinks where it can.
            proc = subprocess.run(["cp", "-a", "--reflink=auto", "--", f"{lower}/.", str(tmp / str(i))],
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RootfsError(f"copying {lower} for a user namespace failed: {proc.stderr.strip()[-500:]}")
            idmap.shift_tree(tmp / str(i), m)
        (tmp / _SOURCE).write_text(json.dumps({"source": rf.source, "digest": rf.digest, "kind": rf.kind}))
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shifted_orphans(in_use: set[str]) -> list[str]:
    """Remove shifted copies of directory rootfs whose directory is gone or changed and whose
    layers no workspace or snapshot (`in_use`: their lowerdirs) stacks: nothing can ask for
    them again. Copies of the Debian and image caches stay, as those caches do."""
    removed = []
    for rng in sorted((CACHE / "rootfs").glob(f"{SHIFTED}-*")):
        for copy in sorted(p for p in rng.iterdir() if not p.name.startswith(".")):
            try:
                meta = json.loads((copy / _SOURCE).read_text())
                if meta["kind"] != "dir":
                    continue
                current = None
                with contextlib.suppress(RootfsError, OSError):
                    current = directory(meta["source"]).digest
            except (OSError, ValueError, KeyError):
                current = None  # an unfinished or unreadable copy
            if current == copy.name or any(str(p).startswith(f"{copy}/") for p in in_use):
                continue
            shutil.rmtree(copy, ignore_errors=True)
            with contextlib.suppress(OSError):
                (rng / f".shift-{copy.name}.lock").unlink()
            removed.append(str(copy))
    return removed


def _generated_etc() -> dict[str, str]:
    return {
        "passwd": "root:x:0:0:root:/root:/bin/bash\n"
        "daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": "root:x:0:\ndaemon:x:1:\ntty:x:5:\nusers:x:100:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "resolv.conf": "# no DNS inside the workspace unless its network mode provides one\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n"
        "networks: files\nprotocols: files\nservices: files\nethers: files\nrpc: files\n",
        "profile": 'export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"\n',
        "hostname": "workspace\n",
        "shells": "/bin/sh\n/bin/bash\n/usr/bin/bash\n",
    }


def _host_digest() -> str:
    h = hashlib.sha256()
    h.update(json.dumps(sorted(os.listdir("/"))).encode())
    h.update(json.dumps(_generated_etc(), sort_keys=True).encode())
    for name in HOST_ETC_COPY:
        p = Path("/etc") / name
        if p.exists() or p.is_symlink():
            st = p.lstat()
            h.update(f"{name}:{st.st_mtime_ns}:{st.st_size}".encode())
    h.update(b"v1")
    return h.hexdigest()[:16]


def _whiteout(path: Path) -> None:
    os.mknod(path, 0o600 | 0o020000, os.makedev(0, 0))


def _opaque(path: Path) -> None:
    os.setxattr(path, "trusted.overlay.opaque", b"y")


def _build_host_skeleton(dest: Path) -> None:
    dest.mkdir(mode=0o755)
    host_entries = set(os.listdir("/"))
    for name in sorted(host_entries - set(HOST_KEEP) - set(SKELETON_DIRS)):
        _whiteout(dest / name)
    for name, mode in SKELETON_DIRS.items():
        d = dest / name
        d.mkdir()
        os.chmod(d, mode)
        _opaque(d)
    for rel in VAR_DIRS:
        (dest / rel).mkdir(parents=True, exist_ok=True)
    os.chmod(dest / "var/tmp", 0o1777)
    for name in HOST_KEEP:
        # Hosts without merged /usr keep these as real directories; they show through as-is.
        if name not in host_entries:
            continue
        if not Path("/", name).is_symlink() and not Path("/", name).is_dir():
            _whiteout(dest / name)
    etc = dest / "etc"
    for name in HOST_ETC_COPY:
        src = Path("/etc") / name
        if src.is_symlink():
            os.symlink(os.readlink(src), etc / name)
        elif src.is_dir():
            shutil.copytree(src, etc / name, symlinks=True)
        elif src.is_file():
            shutil.copy2(src, etc / name)
    for name, text in _generated_etc().items():
        (etc / name).write_text(text)
    os.symlink("/usr/share/zoneinfo/Etc/UTC", etc / "localtime")


def host() -> Rootfs:
    root = state.run_root()
    digest = _host_digest()
    layer = root / "layers" / f"host-{digest}"
    if not layer.is_dir():
        layer.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=layer.parent, prefix=".build-"))
        try:
            _build_host_skeleton(tmp / "root")
            try:
                os.rename(tmp / "root", layer)
            except OSError:
                if not layer.is_dir():  # a concurrent builder won the race otherwise
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return Rootfs(kind="host", lowerdirs=(str(layer), "/"), digest=f"host-{digest}", source="host")


def _dir_digest(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}:{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def directory(path: str) -> Rootfs:
    p = Path(path)
    if not p.is_absolute():
        raise RootfsError(f"rootfs {path!r} is neither 'host', 'debian', 'docker:IMAGE', 'oci:DIR', "
                          "'registry:REF' nor an absolute path")
    if not p.is_dir():
        raise RootfsError(f"rootfs directory {path} does not exist; create it or use rootfs='host'")
    if not any((p / sh).exists() or (p / sh).is_symlink() for sh in ("bin/sh", "usr/bin/sh")):
        raise RootfsError(f"rootfs directory {path} has no /bin/sh; commands cannot run in it")
    if os.stat(p).st_dev == os.stat(state.run_root()).st_dev:
        raise RootfsError(
            f"rootfs directory {path} lies on the same file system as {state.RUN_ROOT}; "
            "overlayfs refuses overlapping layers, so keep it elsewhere"
        )
    return Rootfs(kind="dir", lowerdirs=(str(p.resolve()),), digest=f"dir-{_dir_digest(p)}", source=str(p))


def debian(suite: str = DEBIAN_SUITE, mirror: str = DEBIAN_MIRROR) -> Rootfs:
    """A minbase debootstrap of `suite` with DEBIAN_PACKAGES, built once and cached under
    CACHE/rootfs; rebuilt when the package list changed since (its marker names it)."""
    dest = CACHE / "rootfs" / f"debian-{suite}"
    marker = f"{suite} {','.join(DEBIAN_PACKAGES)}\n"
    if not _built(dest, marker):
        if not shutil.which("debootstrap"):
            raise RootfsError("debootstrap is not installed; run scripts/setup.sh or apt-get install debootstrap")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with state.lock(f"debootstrap-{suite}", root=dest.parent):
            if not _built(dest, marker):
                tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".debian-{suite}-"))
                try:
                    proc = subprocess.run(
                        ["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", suite,
                         str(tmp), mirror],
                        capture_output=True, text=True, timeout=1800,
                    )
                    if proc.returncode != 0:
                        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
                        raise RootfsError(f"debootstrap {suite} failed (exit {proc.returncode}):\n{tail}")
                    # apt's downloaded packages are no part of a sandbox's file system.
                    for deb in (tmp / "var/cache/apt/archives").glob("*.deb"):
                        deb.unlink()
                    (tmp / ".bunshin-complete").write_text(marker)
                    shutil.rmtree(dest, ignore_errors=True)
                    os.rename(tmp, dest)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    st = (dest / ".bunshin-complete").stat()
    digest = hashlib.sha256(f"debian-{suite}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return Rootfs(kind="debian", lowerdirs=(str(dest),), digest=f"debian-{digest}", source=f"debian:{suite}")


def _built(dest: Path, marker: str) -> bool:
    try:
        return (dest / ".bunshin-complete").read_text() == marker
    except OSError:
        return False
