"""Cgroup yards: the host's cgroup hierarchies as CRIU wants to find them.

CRIU's dump and restore (--manage-cgroups) work on the cgroup hierarchies through a "yard": a
directory with one entry per hierarchy, named after its controllers. Given none, each CRIU
makes one itself, mounting every hierarchy afresh (ten mounts here, the cgroup2 one alone 9 ms)
and unmounting them at the end; and a cgroup2 mount without options resets favordynmods
host-wide (below). A yard here is a directory of symlinks to where the host already mounts the
hierarchies (no mount of our own, so nothing to leak); CRIU's --cgroup-yard then mounts nothing
for an entry that exists. Where a hierarchy is not mounted here, there is no yard and CRIU
makes its own.

Restores use a host yard (host_yard): one per set of hierarchies under the state root, made
once and shared by every process and snapshot, retained or loaded. A dump's yard is made before
the freeze from the source init's hierarchies (prepare_dump). Snapshots taken before host yards
existed have their own (YARD), which of() still finds.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import threading
from pathlib import Path

YARD = "cgyard"  # a snapshot's own, in its directory (made by earlier versions)
DUMP_YARD = "cgyard-dump"  # the dump's, beside it (prepare_dump)


def _dir_name(cnames: list[str]) -> str:
    """CRIU's name for a hierarchy's entry in a yard (cgroup.c, ctrl_dir_and_opt)."""
    return ",".join("unified" if not n else n.removeprefix("name=") for n in cnames)


def _image_hierarchies(images: Path) -> list[list[str]]:
    raw = (images / "cgroup.img").read_bytes()
    with _parsed_lock:
        found = _parsed.get(raw)
    if found is None:
        found = _parse_hierarchies(raw)
        with _parsed_lock:
            if len(_parsed) >= PARSED_KEPT:
                _parsed.pop(next(iter(_parsed)))
            _parsed[raw] = found
    return [list(c) for c in found]


# pycriu's pure-Python decode of a cgroup image takes 2 ms, on every fork's path after the
# thaw; the successive snapshots of one source write the same bytes. Keyed by the bytes
# themselves, so a hit is exactly what decoding would give.
PARSED_KEPT = 32
_parsed: dict[bytes, tuple[tuple[str, ...], ...]] = {}
_parsed_lock = threading.Lock()


def _parse_hierarchies(raw: bytes) -> tuple[tuple[str, ...], ...]:
    from pycriu import images as pb  # type: ignore[import-not-found]

    entries = pb.load(io.BytesIO(raw))["entries"]
    return tuple(tuple(c["cnames"]) for c in entries[0].get("controllers", [])) if entries else ()


def _host_mounts() -> list[tuple[frozenset[str], str]]:
    """(super options, mount point) of each hierarchy root this mount namespace has mounted;
    cgroup2's options are the empty set. CRIU's own yards (mid-restore) are not candidates."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2") or fields[3] != "/" or ".criu.cgyard" in fields[4]:
            continue
        opts = frozenset() if tail[0] == "cgroup2" else frozenset(tail[2].split(","))
        out.append((opts, fields[4].replace("\\040", " ")))
    return out


def prepare_dump(snap_dir: Path, init_pid: int) -> Path | None:
    """A yard for the dump of the workspace whose init is `init_pid`, made before the freeze:
    the hierarchies its init belongs to (/proc/PID/cgroup), each named as CRIU's dump looks
    for it (cgroup.c, collect_cgroups: the controllers as the kernel lists them, `name=`
    dropped, cgroup2 "unified"), which is _dir_name's naming. Given none, the frozen dump
    mounts every hierarchy afresh (15 ms here). None where one is not mounted on this host."""
    try:
        lines = Path(f"/proc/{init_pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    wanted = [ln.split(":", 2)[1].split(",") for ln in lines if ln.count(":") >= 2]
    return _make(snap_dir, DUMP_YARD, wanted)


def _controllers() -> set[str]:
    """The kernel's cgroup controllers (/proc/cgroups)."""
    try:
        rows = Path("/proc/cgroups").read_text().splitlines()
    except OSError:
        return set()
    return {r.split()[0] for r in rows if r and not r.startswith("#")}


def _links(wanted: list[list[str]]) -> dict[str, str]:
    """Each hierarchy's yard entry and where this host mounts it; empty where one is not mounted,
    or where a name is none a hierarchy can have (a loaded snapshot's images are not ours: a
    mount option such as `rw` must not pass for a controller)."""
    known = _controllers()
    if any(n and n not in known and not (n.startswith("name=") and "/" not in n) for c in wanted for n in c):
        return {}
    mounts = _host_mounts()
    links: dict[str, str] = {}
    for cnames in wanted:
        # A v1 controller (or name=) belongs to one hierarchy only; cgroup2 is named by "".
        found = [point for opts, point in mounts
                 if (not opts if cnames == [""] else opts and opts >= set(cnames))]
        if not found:
            return {}
        links[_dir_name(cnames)] = found[0]
    return links


def _make(snap_dir: Path, name: str, wanted: list[list[str]]) -> Path | None:
    links = _links(wanted)
    if not links:
        return None
    tmp = f".{name}.tmp"
    shutil.rmtree(snap_dir / tmp, ignore_errors=True)
    _write(snap_dir, tmp, links, name)
    return snap_dir / name


def _write(parent: Path, tmp: str, links: dict[str, str], name: str) -> None:
    """The yard `parent/name`, made as `tmp` and renamed into place."""
    (parent / tmp).mkdir()
    try:
        for entry, point in links.items():
            # Relative: CRIU reaches the yard through a descriptor also from inside the clone's
            # new root, where an absolute link would resolve among the clone's own files.
            os.symlink(os.path.relpath(point, os.path.realpath(parent) + "/" + name), parent / tmp / entry)
        os.replace(parent / tmp, parent / name)
    except BaseException:
        shutil.rmtree(parent / tmp, ignore_errors=True)
        raise


def of(snap_dir: Path, images: Path | None = None) -> Path | None:
    """The yard a restore of the snapshot uses: its own where an earlier version made one, else,
    given its images, this host's yard for their hierarchies (host_yard)."""
    yard = snap_dir / YARD
    if yard.is_dir():
        return yard
    return host_yard(images) if images is not None else None


# Without a yard CRIU mounts every hierarchy itself, and a cgroup2 mount without options resets
# that hierarchy's root options host-wide (kernel/cgroup/cgroup.c, apply_cgroup_root_flags):
# favordynmods went off at every restore of a loaded snapshot (serve's sandboxes, resumes), and
# the next move into a cgroup waited a grace period again (dynmods.py).
HOST_YARDS = "cgyards"  # under the state root: one yard per set of hierarchies, symlinks only
_host_yards: dict[tuple[tuple[str, ...], ...], Path | None] = {}
_host_yards_lock = threading.Lock()


def host_yard(images: Path) -> Path | None:
    """A yard for `images`' hierarchies under this host's state root, made once and shared by
    every process and snapshot (its name is its content's digest); None where a hierarchy of the
    images is not mounted here, or they name none."""
    try:
        wanted = tuple(tuple(c) for c in _image_hierarchies(images))
    except (OSError, KeyError, IndexError, ValueError, ImportError):
        return None
    with _host_yards_lock:
        if wanted in _host_yards and (_host_yards[wanted] is None or _host_yards[wanted].is_dir()):
            return _host_yards[wanted]
        links = _links([list(c) for c in wanted])
        yard = None
        if links:
            from .. import state

            root = state.RUN_ROOT / HOST_YARDS
            root.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256(repr(sorted(links.items())).encode()).hexdigest()[:16]
            yard = root / digest
            if not yard.is_dir():
                with contextlib.suppress(FileExistsError, OSError):  # another process made it
                    _write(root, f"{digest}.{os.getpid()}.{threading.get_ident()}", links, digest)
            yard = yard if yard.is_dir() else None
        _host_yards[wanted] = yard
        return yard
