"""What a sandbox starts from: E2B's template names mapped onto a rootfs, and the snapshots
create_snapshot() saves. Those live in bunshin's one template store (images/templates.py), so
E2B's snapshot ids and names, `bunshin template` names and warm templates share one namespace."""

from __future__ import annotations

import shutil
from typing import Any

from ..errors import InvalidArgumentException, NotFoundException
from ..images import templates, warm
from ..workspace import Workspace
from .kept import Kept
from .types import SnapshotInfo

DEFAULT = "base"
# The names a template is given by what it is, not by the store: a snapshot never takes one.
BUILTIN = (DEFAULT, "debian", "host")
PREFIXES = ("docker:", "oci:", "registry:", "/")


def is_builtin(template: str | None) -> bool:
    """A template named by what it is (base, debian, an image, a directory), not a stored one."""
    return template is None or template in BUILTIN or template.startswith(PREFIXES)


def check_snapshot_name(name: str) -> str:
    """A snapshot's name: a store name (templates.NAME), none a template has by what it is."""
    if not isinstance(name, str) or not templates.NAME.fullmatch(name) or is_builtin(name):
        raise InvalidArgumentException(
            f"invalid snapshot name {name!r}: letters, digits, '_', '.', '-', at most 128, and not a "
            f"template's ({', '.join(BUILTIN)}, {', '.join(p.rstrip('/') + '...' for p in PREFIXES)})")
    return name


def saved(source: str | None = None, name: str | None = None) -> list[SnapshotInfo]:
    """The saved snapshots, of the sandbox `source` and named `name` where given."""
    out = []
    for d in templates.saved():
        names = templates.names(d)
        if (source is None or templates.info(d).source == source) and (name is None or name in (d.name, *names)):
            out.append(SnapshotInfo(d.name, names))
    return out


def save(ws: Workspace, name: str | None) -> SnapshotInfo:
    """Snapshot `ws` into the store; a name names the newest snapshot given it, as E2B's do."""
    if name is not None:
        check_snapshot_name(name)
    dest = warm.save(ws, name)
    return SnapshotInfo(dest.name, [name] if name else [])


def delete(snapshot_id: str) -> bool:
    d = templates.find(snapshot_id)
    if d is None or d.name != snapshot_id:
        return False
    if KEPT is not None:
        KEPT.forget(d)
    shutil.rmtree(d)
    return True


# Saved snapshots this process keeps loaded between starts (kept.py): None unless a long-lived
# process asks for it (keep_loaded); a library's Sandbox.create loads at each start.
KEPT: Kept | None = None


def keep_loaded() -> Kept:
    """Keep each saved snapshot started from loaded until release_loaded() (bunshin serve)."""
    global KEPT
    if KEPT is None:
        KEPT = Kept()
    return KEPT


def release_loaded() -> None:
    global KEPT
    kept, KEPT = KEPT, None
    if kept is not None:
        kept.close()


def start(template: str | None, lifetime: float, env: dict[str, str], network: dict[str, Any]) -> Workspace:
    """A running workspace from `template`: a saved snapshot's clone (given `env` on top of
    its own, and the egress policy of `network`: its network is the snapshot's), or a new
    workspace on the rootfs the template names, with `network` (WorkspaceSpec fields)."""
    # What a template is by its name comes first: no snapshot (whatever names it has) shadows it.
    if not is_builtin(template) and (saved_dir := templates.find(str(template))) is not None:
        clone = (KEPT.fork_one(saved_dir, str(template), lifetime) if KEPT is not None
                 else Workspace.from_template(str(template), timeout=lifetime))
        try:
            if env:
                clone.update_env(env)
            if "egress" in network:
                clone.set_egress(network["egress"])
        except BaseException:
            clone.destroy()
            raise
        return clone
    rootfs = "host" if template in (None, DEFAULT) else str(template)
    if not (rootfs in ("host", "debian") or rootfs.startswith(("docker:", "oci:", "registry:", "/"))):
        raise NotFoundException(f"no template {template!r}: use 'base', 'debian', 'docker:IMAGE', "
                                "'oci:DIR[:TAG]', 'registry:REF', a directory, a warm template or a "
                                "snapshot saved by create_snapshot()")
    return Workspace.create(timeout=lifetime, rootfs=rootfs, env=env, **network)
