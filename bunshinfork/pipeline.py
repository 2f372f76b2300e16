"""create and fork as one assembly over the subsystem parts; destroy, gc and doctor as loops over them.

A workspace is assembled part by part in PARTS order, each building on what the ones before
it recorded: its file system (the overlay's layers), its cgroup, its memory engine's share,
its processes (the init started, or the tree restored by CRIU) and its network. create runs
every part's prepare(), fork every part's restore() from a snapshot; a failure anywhere
releases every part in reverse order and leaves nothing behind. A snapshot is taken in
CAPTURE order while the source is frozen (snapshot.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import state
from .cgroups import Cgroup, CgroupsPart
from .contract import Build, Captured, Held, Part, Probe
from .errors import BunshinError, DeadlineExceeded, ForkError, ForkTimeout, WorkspaceStateError
from .fs import FsPart
from .memory import MemoryPart
from .network import NetworkPart
from .process import ProcessPart, chain, lifetime
from .spec import WorkspaceSpec
from .state import Lifetime, Record, SnapshotMeta, Status

PARTS: tuple[Part, ...] = (FsPart(), CgroupsPart(), MemoryPart(), ProcessPart(), NetworkPart())
# Capture: refuse what cannot be forked first; the memory engine's share before the dump it
# shapes; the file system last, still frozen.
CAPTURE = ("network", "cgroups", "memory", "process", "fs")
# Restore: a clone's network (its host rules, the veth CRIU is to create) before its processes.
RESTORE = ("fs", "cgroups", "memory", "network", "process")
MAX_PARALLEL_RESTORES = 8


def part(name: str) -> Part:
    return next(p for p in PARTS if p.name == name)


def _ordered(names: tuple[str, ...]) -> list[Part]:
    """The parts named in `names`, in that order, then every other part (a part that a test or
    an extension adds) in assembly order."""
    return [part(n) for n in names] + [p for p in PARTS if p.name not in names]


def capture_order() -> list[Part]:
    return _ordered(CAPTURE)


def restore_order() -> list[Part]:
    return _ordered(RESTORE)


def probes() -> tuple[Probe, ...]:
    return tuple(probe for p in PARTS for probe in p.probes)


# ---- assembly ----


def create(spec: WorkspaceSpec, life: Lifetime | None = None) -> Build:
    """A new workspace from a validated spec, running when this returns."""
    state.require_root()
    collect()  # what ended workspaces left: no daemon removes it
    ws_id = state.new_id()
    rec = Record(id=ws_id, status=Status.CREATING, creator_pid=os.getpid(), created_at=time.time(),
                 hostname=spec.hostname or ws_id, spec=spec, lifetime=life or Lifetime())
    return _assemble(Build(rec))


def fork(snap: Captured, count: int, memory: str, life: Lifetime | None = None) -> list[Build | Exception]:
    """`count` clones of a snapshot, restored with the engine `memory`, each with the lifetime
    `life` (never its source's). Each succeeds or fails on its own: a failed clone is a
    ForkError in the list and leaves nothing behind."""

    def one(_: int) -> Build | Exception:
        ws_id = state.new_id()
        meta = snap.meta
        # The identity rule: a clone restores its source's memory, so it keeps its source's
        # hostname (and boot id, in its layer): a tool whose output names the host says the same
        # in every clone. Only a cold boot (create) gets new ones.
        rec = Record(id=ws_id, status=Status.CREATING, creator_pid=os.getpid(), created_at=time.time(),
                     hostname=meta.hostname, spec=meta.spec, parent=meta.source, lifetime=life or Lifetime())
        # The fork profile starts with what the snapshot cost its source.
        if meta.timing is not None:
            rec.timings.update({f"snapshot.{k}": v for k, v in meta.timing.stages.items()})
        try:
            return _assemble(Build(rec, source=snap, memory=memory))
        except (KeyboardInterrupt, SystemExit):
            raise
        except ForkError as e:
            return e
        except BaseException as e:
            kind = ForkTimeout if isinstance(e, DeadlineExceeded) else ForkError
            err = kind(f"fork of {meta.source} into {ws_id} failed: {e}")
            err.__cause__ = e
            return err

    if count == 1:
        return [one(0)]
    workers = min(count, MAX_PARALLEL_RESTORES)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bunshin-restore") as pool:
        return list(pool.map(one, range(count)))


def _assemble(b: Build, undo: Callable[[Build], None] | None = None) -> Build:
    """Build every part; a failure undoes them (release(): nothing is left; a resume's
    _unbuild(): the paused record stays) and raises."""
    rec = b.rec
    state.run_root()
    if undo is None:
        rec.dir.mkdir(mode=0o700)
    rec.save()
    try:
        for p in PARTS if b.source is None else restore_order():
            t0 = time.monotonic()
            if b.source is None:
                p.prepare(b)
            else:
                p.restore(b)
            rec.timings[p.name] = time.monotonic() - t0
            rec.save()
        rec.transition(Status.RUNNING)
        rec.save()
        return b
    except BaseException:
        with contextlib.suppress(BunshinError):
            (undo or release)(b)
        raise
    finally:
        for step in b.deferred:
            with contextlib.suppress(Exception):
                step()
        b.deferred.clear()


# ---- pause to disk and resume ----


def park(b: Build, saved: Path) -> None:
    """Release every part of a running workspace whose whole state was saved at `saved` (a
    snapshot's saved copy), keeping its record, PAUSED: wake() restores it under the same id."""
    with lifetime.cleanup_lock(b.rec) as present:
        if not present:
            raise WorkspaceStateError(f"workspace {b.rec.id} was destroyed while it was being paused")
        # PAUSED before any part goes: gc and lifetime collection leave a PAUSED record alone,
        # where a RUNNING one whose init is gone would be theirs to remove.
        b.rec.saved = str(saved)
        b.rec.transition(Status.PAUSED)
        b.rec.save()
        _unbuild(b)


def _unbuild(b: Build) -> None:
    """Release every part and keep the record, PAUSED, with what the parts recorded forgotten
    (a paused workspace, or a resume that failed)."""
    errors = _release_parts(b)
    rec = b.rec
    # The parts' mount points and work directories go (a restore makes them anew); the record
    # and the files the entrances keep beside it stay.
    for entry in os.scandir(rec.dir):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
    # The marker the file system's release leaves to say it uses no frozen layer any more: a
    # resumed workspace stacks one again, which a marked owner would not keep alive.
    with contextlib.suppress(FileNotFoundError):
        (rec.dir / state.RELEASED).unlink()
    rec.fs = rec.cgroups = rec.process = rec.network = rec.lineage = None
    rec.restore_window = None
    if rec.status is not Status.PAUSED:
        rec.transition(Status.PAUSED)
    rec.save()
    if errors:
        raise WorkspaceStateError(f"workspace {rec.id} pause incomplete: {'; '.join(errors)}")


@contextlib.contextmanager
def resuming(ws_id: str) -> Iterator[Record]:
    """The PAUSED record of `ws_id`, held against a concurrent resume, destroy or gc until the
    block ends. WorkspaceStateError where it is not paused (any more)."""
    try:
        rec = Record.load(ws_id)
    except FileNotFoundError:
        raise WorkspaceStateError(f"workspace {ws_id} is gone") from None
    with lifetime.cleanup_lock(rec) as present:
        rec = Record.load(ws_id) if present else rec  # what the previous holder left
        if not present or rec.status is not Status.PAUSED or not rec.saved:
            raise WorkspaceStateError(f"workspace {ws_id} is {rec.status if present else 'gone'}, not paused")
        yield rec


def wake(rec: Record, snap: Captured, memory: str, life: Lifetime | None = None) -> Build:
    """Restore the PAUSED workspace `rec` (held by resuming()) from its saved snapshot `snap`,
    under its own id, with the lifetime `life`. A failure releases what was restored and
    leaves it PAUSED, its saved state untouched."""
    rec.transition(Status.CREATING)
    rec.creator_pid = os.getpid()
    rec.lifetime = life or Lifetime()
    return _assemble(Build(rec, source=snap, memory=memory), undo=_unbuild)


# ---- release and gc ----


def release(held: Held) -> None:
    """Give back everything a workspace (or a snapshot) holds, part by part in reverse order.
    Idempotent; every part is tried even when one fails, and the failures are reported together.
    A workspace's owner and another process's gc or lifetime collection take turns at it."""
    if isinstance(held, Build):
        if held.rec.status is Status.DESTROYED:
            return
        with lifetime.cleanup_lock(held.rec) as present:
            if not present:
                # Taken apart by another process already: only this process's pidfd is left.
                if held.pidfd is not None:
                    pidfd, held.pidfd = held.pidfd, None
                    os.close(pidfd)
                held.rec.transition(Status.DESTROYED)
                return
            current = _as_recorded(held)
            _release(current)
            if current is not held:
                held.rec.transition(Status.DESTROYED)
        return
    _release(held)


def _as_recorded(held: Build) -> Build:
    """What to release: the record as saved now where another object paused or resumed the
    workspace since `held` was read (its parts are those the saved record names)."""
    if held.rec.status is Status.CREATING:
        return held
    try:
        now = Record.load(held.rec.id)
    except (FileNotFoundError, ValueError):
        return held
    if now.status is held.rec.status:
        return held
    if held.pidfd is not None:  # an init that is gone since (paused), not the one running now
        pidfd, held.pidfd = held.pidfd, None
        os.close(pidfd)
    return Build(now)


def _release_parts(held: Held) -> list[str]:
    errors = []
    for p in reversed(PARTS):
        try:
            p.release(held)
        except Exception as e:
            errors.append(f"{p.name}: {e}")
    return errors


def _release(held: Held) -> None:
    errors = _release_parts(held)
    try:
        if isinstance(held, Build):
            state.remove_dir(held.rec.dir)
            if held.rec.saved:  # a paused workspace's saved state goes with it
                shutil.rmtree(held.rec.saved, ignore_errors=True)
        elif held.owned:
            # Its pages stay (and only they) while images of a retained snapshot read them.
            chain.retire(held.dir)
    except OSError as e:
        errors.append(f"state: {e}")
    if isinstance(held, Build):
        held.rec.transition(Status.DESTROYED)
        if errors:
            raise WorkspaceStateError(f"workspace {held.rec.id} cleanup incomplete: {'; '.join(errors)}")


def gc() -> dict[str, list[str]]:
    """Remove what crashed creators left behind: workspaces whose init is gone, snapshots whose
    owner is gone, then each part's own leftovers. Returns what was removed, by kind."""
    # Past their deadline but still running (an init that did not end them), then the
    # records whose init is gone.
    # A CRIU whose caller died goes first: it may still be restoring into what follows removes.
    removed = {"process": part("process").gc()}
    removed |= {"workspaces": collect() + _gc_records(), "snapshots": _gc_snapshots(), "paused": _gc_paused()}
    removed["state"] = state.empty_trash()  # state directories a crash left half-removed
    for p in PARTS:
        if p.name != "process":
            removed[p.name] = p.gc()
    return removed


def collect() -> list[str]:
    """Remove the workspaces whose lifetime has ended (process/lifetime.py): what their init
    left on the host, and a workspace whose init outlived its deadline (frozen ones wait until
    they are resumed). Every create, connect, list and gc runs it: there is no daemon."""
    removed = []
    for rec in state.records():
        if rec.status is not Status.RUNNING or not lifetime.ended(rec):
            continue
        if rec.init_alive() and rec.cgroups is not None:
            with contextlib.suppress(BunshinError, OSError):
                if Cgroup(rec.cgroups).frozen():
                    continue
        with contextlib.suppress(BunshinError):
            release(Build(rec))
            removed.append(rec.id)
    return removed


def _gc_records() -> list[str]:
    removed = []
    for ws_id in state.all_ids():
        try:
            rec = Record.load(ws_id)
        except (FileNotFoundError, ValueError):
            rec = None
        if rec is None:
            # No readable record: a creator died before writing one. Nothing else can be known.
            shutil.rmtree(state.RUN_ROOT / ws_id, ignore_errors=True)
            removed.append(ws_id)
            continue
        stale = (rec.status is Status.CREATING and not rec.creator_alive()) or (
            rec.status is Status.RUNNING and not rec.init_alive()
        ) or (rec.status is Status.PAUSED and not (rec.saved and os.path.isdir(rec.saved)))
        if stale and rec.status is Status.CREATING and rec.saved and os.path.isdir(rec.saved):
            # A resume whose process died: back to paused, its saved state kept.
            with contextlib.suppress(BunshinError, OSError), lifetime.cleanup_lock(rec) as present:
                if present:
                    _unbuild(Build(rec))
            removed.append(ws_id)
            continue
        if stale:
            with contextlib.suppress(BunshinError):
                release(Build(rec))
            removed.append(ws_id)
    return removed


def _gc_paused() -> list[str]:
    """Saved states under state.PAUSED_ROOT whose workspace is gone (a crash between the
    save and the record, or a state root lost with its tmpfs)."""
    root = state.PAUSED_ROOT
    removed = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not (state.RUN_ROOT / d.name.removesuffix(".partial")).exists():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def _gc_snapshots() -> list[str]:
    removed = []
    root = state.RUN_ROOT / state.SNAPSHOTS
    ids = state.snapshot_ids()
    # Released snapshots kept for their readers' sake: they go with the last of those (sweep
    # below, or the release of a reader here), and are reported then.
    kept_levels = [n for n in ids if chain.released(root / n)]
    for name in ids:
        d = root / name
        if name in kept_levels or not d.exists():
            continue
        try:
            meta = SnapshotMeta.load(d)
        except (FileNotFoundError, ValueError):
            meta = None
        if meta is not None and state.proc_starttime(meta.owner_pid) is not None:
            continue
        if meta is None:
            shutil.rmtree(d, ignore_errors=True)
        else:
            release(Captured(meta, d))
        removed.append(name)
    swept = chain.sweep()
    return removed + swept + [n for n in kept_levels if n not in swept and not (root / n).exists()]
