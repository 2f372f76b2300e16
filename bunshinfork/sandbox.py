"""Sandbox: E2B's Sandbox over a bunshin workspace, for code written against E2B.

The differences from Workspace are E2B's: a sandbox ends after 300 s unless told otherwise
(set_timeout, connect(timeout=...)); commands run in a login bash as the non-root user
"user" (who exists in every sandbox, home /home/user) and raise CommandExitException when
they exit non-zero; fork(timeout=None, count=None) takes E2B's parameters; kill(),
get_info(), set_timeout(), connect() and pause() work on an instance or, given a sandbox id,
on the class. What E2B does in its cloud and cannot apply to one host (API keys, domains,
regions, egress proxies, MCP gateways, volumes) is accepted and ignored where it only
configures the transport, and refused where ignoring it would change what the sandbox is.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

from . import state, users
from .commands import E2B, Conventions
from .errors import (
    BunshinError,
    InvalidArgumentException,
    NotFoundException,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from .workspace import Snapshot, Workspace

SNAPSHOT_ROOT = Path(os.environ.get("BUNSHIN_SNAPSHOT_ROOT", "/var/lib/bunshin/snapshots"))
MAX_FORKS = 20  # E2B's limit per fork call
S = TypeVar("S", bound="Sandbox")


class SandboxState(StrEnum):
    PAUSED = "paused"
    RUNNING = "running"


@dataclass
class SandboxQuery:
    metadata: dict[str, str] | None = None
    state: list[SandboxState] | None = None
    started_after: datetime.datetime | None = None
    template: str | None = None


@dataclass
class SandboxInfo:
    """E2B's SandboxInfo for a local workspace."""

    sandbox_id: str
    sandbox_domain: str | None
    template_id: str
    name: str | None
    metadata: dict[str, str]
    started_at: datetime.datetime
    end_at: datetime.datetime
    state: SandboxState
    cpu_count: int
    memory_mb: int
    envd_version: str
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    lifecycle: dict[str, Any] | None = None
    volume_mounts: list[dict[str, str]] = field(default_factory=list)
    envd_unresponsive_at_pause: bool | None = None


@dataclass
class SandboxMetrics:
    cpu_count: int
    cpu_used_pct: float
    disk_total: int
    disk_used: int
    mem_total: int
    mem_used: int
    mem_cache: int
    timestamp: datetime.datetime


@dataclass
class SnapshotInfo:
    snapshot_id: str
    names: list[str] = field(default_factory=list)


class _Paginator:
    """E2B's paginator protocol (has_next, next_token, next_items) over a list known up front."""

    def __init__(self, items: list[Any], limit: int | None, next_token: str | None) -> None:
        self._items = items
        self.limit = limit
        self._offset = int(next_token) if next_token else 0
        self._has_next = True

    @property
    def has_next(self) -> bool:
        return self._has_next

    @property
    def next_token(self) -> str | None:
        return str(self._offset) if self._has_next and self._offset else None

    def _page(self) -> list[Any]:
        if not self._has_next:
            raise Exception("No more items to fetch")
        end = len(self._items) if not self.limit else self._offset + self.limit
        page = self._items[self._offset:end]
        self._offset = min(end, len(self._items))
        self._has_next = self._offset < len(self._items)
        return page


class SandboxPaginator(_Paginator):
    def next_items(self, **opts: Any) -> list[SandboxInfo]:
        return self._page()


class SnapshotPaginator(_Paginator):
    def next_items(self, **opts: Any) -> list[SnapshotInfo]:
        return self._page()


def _utc(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC)


# ---- instance methods that also take a sandbox id when called on the class ----


class instance_or_class:
    """E2B's class_method_variant: `sandbox.kill()` or `Sandbox.kill(sandbox_id)`. On the class,
    the first argument is a sandbox id, attached to first; `on_class` handles what differs
    (a missing id, extra class-only parameters)."""

    def __init__(self, method: Callable[..., Any], on_class: Callable[..., Any] | None = None) -> None:
        self.method = method
        self.on_class = on_class
        functools.update_wrapper(self, method)  # type: ignore[arg-type]

    def __get__(self, obj: Any, objtype: type | None = None) -> Callable[..., Any]:
        method, on_class = self.method, self.on_class

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if obj is not None:
                return method(obj, *args, **kwargs)
            assert objtype is not None
            if args and isinstance(args[0], objtype):
                return method(*args, **kwargs)
            if on_class is not None:
                return on_class(objtype, *args, **kwargs)
            sandbox_id, *rest = args
            return method(objtype._attach(sandbox_id), *rest, **kwargs)

        return call


def _kill_by_id(cls: type[Sandbox], sandbox_id: str, **opts: Any) -> bool:
    try:
        return cls._attach(sandbox_id).kill()
    except (WorkspaceNotFound, WorkspaceStateError):
        return False


def _connect_by_id(cls: type[S], sandbox_id: str, timeout: int | None = None, logger: logging.Logger | None = None,
                   *, on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> S:
    sbx = cls._attach(sandbox_id)
    sbx._logger = logger
    return sbx.connect(timeout, on_resume=on_resume)


def _fork_by_id(cls: type[S], sandbox_id: str, timeout: int | None = None, count: int | None = None,
                logger: logging.Logger | None = None, **opts: Any) -> list[S | Exception]:
    return cls._attach(sandbox_id).fork(timeout, count)


def _list_snapshots_all(cls: type[Sandbox], sandbox_id: str | None = None, limit: int | None = None,
                        next_token: str | None = None, name: str | None = None, **opts: Any) -> SnapshotPaginator:
    return SnapshotPaginator(_saved_snapshots(sandbox_id, name), limit, next_token)


# ---- saved snapshots (E2B's persistent snapshot templates) ----


def _snapshot_dirs() -> list[Path]:
    if not SNAPSHOT_ROOT.is_dir():
        return []
    return sorted(p for p in SNAPSHOT_ROOT.iterdir() if (p / "snapshot.json").exists())


def _snapshot_info(d: Path) -> tuple[SnapshotInfo, dict[str, Any]]:
    meta = json.loads((d / "snapshot.json").read_text())
    names = json.loads((d / "names.json").read_text()) if (d / "names.json").exists() else []
    return SnapshotInfo(d.name, names), meta


def _saved_snapshots(source: str | None = None, name: str | None = None) -> list[SnapshotInfo]:
    out = []
    for d in _snapshot_dirs():
        info, meta = _snapshot_info(d)
        if (source is None or meta.get("source") == source) and (name is None or name in (d.name, *info.names)):
            out.append(info)
    return out


def _find_snapshot(template: str) -> Path | None:
    for d in _snapshot_dirs():
        if template == d.name or template in _snapshot_info(d)[0].names:
            return d
    return None


class Sandbox(Workspace):
    """A workspace with E2B's Sandbox interface (see the module's docstring)."""

    conventions: Conventions = E2B
    default_sandbox_timeout = 300
    default_template = "base"

    _logger: logging.Logger | None = None

    # ---- construction ----

    @classmethod
    def _adopt(cls: type[S], ws: Workspace) -> S:
        """The same workspace behind this front door; `ws` hands over its pidfd."""
        out = cls(ws._rec, ws._pidfd)
        ws._pidfd = None
        return out

    @classmethod
    def _attach(cls: type[S], sandbox_id: str) -> S:
        return cls._adopt(Workspace.connect(sandbox_id))

    @classmethod
    def create(  # type: ignore[override]
        cls: type[S],
        template: str | None = None,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        secure: bool | None = None,
        allow_internet_access: bool | None = None,
        mcp: dict[str, Any] | None = None,
        network: dict[str, Any] | None = None,
        iam: dict[str, Any] | None = None,
        lifecycle: dict[str, Any] | None = None,
        volume_mounts: dict[str, Any] | None = None,
        logger: logging.Logger | None = None,
        idempotency_key: str | None = None,
        **opts: Any,
    ) -> S:
        """Create a sandbox and start it.

        template: "base" (the default: the host's /usr under a generated /etc), "debian",
        "docker:IMAGE", an absolute directory, or the id or name of a snapshot saved by
        create_snapshot(). timeout: its lifetime in seconds (default 300; 0: none).
        allow_internet_access=True gives it a bridge network with NAT (a sandbox with a network
        cannot be forked); otherwise it has loopback only. secure, idempotency_key and the API
        options (api_key, domain, request_timeout, ...) configure E2B's cloud transport and are
        ignored. mcp, network rules, iam and volume_mounts are E2B cloud services: refused.
        """
        for name, value in (("mcp", mcp), ("network", network), ("iam", iam), ("volume_mounts", volume_mounts)):
            if value:
                raise InvalidArgumentException(f"{name}= configures an E2B cloud service that a local sandbox "
                                               "does not have")
        _check_lifecycle(lifecycle)
        life = cls.default_sandbox_timeout if timeout is None else timeout
        saved = _find_snapshot(template) if template and template != cls.default_template else None
        if saved is not None:
            snap = Snapshot.load(saved)
            try:
                (clone,) = snap.fork(1, timeout=life)
            finally:
                snap.release()
            if isinstance(clone, Exception):
                raise clone
            sbx = cls._adopt(clone)
        else:
            rootfs = "host" if template in (None, cls.default_template) else str(template)
            if not (rootfs in ("host", "debian") or rootfs.startswith(("docker:", "/"))):
                raise NotFoundException(f"no template {template!r}: use 'base', 'debian', 'docker:IMAGE', a "
                                        "directory, or a snapshot saved by create_snapshot()")
            net = {"network": "bridge", "nat": True} if allow_internet_access else {}
            sbx = Workspace.create.__func__(cls, timeout=life, rootfs=rootfs, env=dict(envs or {}), **net)  # type: ignore[attr-defined]
        try:
            sbx._logger = logger
            if saved is not None and envs:
                sbx._rec.spec = {**sbx._rec.spec, "env": {**sbx._rec.spec.get("env", {}), **envs}}
            sbx._rec.metadata = dict(metadata or {})
            sbx._rec.template = template or cls.default_template
            sbx._rec.save()
            sbx._ensure_default_user()
        except BaseException:
            sbx.destroy()
            raise
        sbx._log("created sandbox %s from %s", sbx.id, sbx._rec.template)
        return sbx

    def _ensure_default_user(self) -> users.User:
        """E2B's sandboxes have a user "user" (home /home/user): add it where the rootfs lacks it."""
        passwd, group = self.files._read_as_root(users.Accounts.PATHS)
        new_passwd, new_group, user = users.add_user(passwd, group, str(self.conventions.default_user))
        if new_passwd != passwd:
            self.files.write("/etc/passwd", new_passwd, user="root")
            self.files.write("/etc/group", new_group, user="root")
        if not self.files.exists(user.home, user="root"):
            self.files.make_dir(user.home, user="root")
            os.chown(f"/proc/{self._live_init_pid()}/root{user.home}", user.uid, user.gid, follow_symlinks=False)
        return user

    def _log(self, msg: str, *args: object) -> None:
        if self._logger is not None:
            self._logger.info(msg, *args)

    # ---- identity and state ----

    @property
    def sandbox_id(self) -> str:
        return self.id

    def is_running(self, request_timeout: float | None = None) -> bool:
        return super().is_running()

    def _refresh(self) -> state.Record:
        """What another object or process changed in the record since (lifetime, metadata)."""
        with contextlib.suppress(FileNotFoundError, ValueError, TypeError):
            disk = state.Record.load(self.id)
            rec = self._rec
            rec.lifetime, rec.metadata, rec.template = disk.lifetime, disk.metadata, disk.template
        return self._rec

    def get_info(self, **opts: Any) -> SandboxInfo:
        rec = self._refresh()
        info = self.info()
        mem = info.memory_limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SandboxInfo(
            sandbox_id=self.id, sandbox_domain=None, template_id=rec.template or info.rootfs, name=None,
            metadata=dict(rec.metadata), started_at=_utc(rec.created_at),
            end_at=_utc(rec.lifetime.deadline) if rec.lifetime.deadline else
            datetime.datetime.max.replace(tzinfo=datetime.UTC),
            state=SandboxState.PAUSED if info.state == "paused" else SandboxState.RUNNING,
            cpu_count=os.cpu_count() or 1, memory_mb=mem >> 20, envd_version=importlib.metadata.version("bunshin"),
            allow_internet_access=info.network.get("mode") == "bridge" and bool(info.network.get("nat")),
            lifecycle={"on_timeout": "kill", "auto_resume": False}, volume_mounts=[],
        )

    get_info = instance_or_class(get_info)  # type: ignore[assignment]

    def get_metrics(self, start: datetime.datetime | None = None, end: datetime.datetime | None = None,
                    **opts: Any) -> list[SandboxMetrics]:
        """One sample, now: no daemon records a history. CPU is the average since creation."""
        mem = self.memory()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu_s = 0.0
        for pid in self._cgroup().pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu_s += (int(fields[11]) + int(fields[12])) / ticks
            except OSError:
                continue
        cpus = os.cpu_count() or 1
        elapsed = max(time.time() - self._rec.created_at, 1e-3)
        fs = self._rec.fs
        layer = Path(fs.layer.path if fs and fs.layer else state.RUN_ROOT)
        disk = shutil.disk_usage(layer)
        used = sum(f.lstat().st_size for f in (layer / "upper").rglob("*") if f.is_file())
        total_mem = self.info().memory_limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        sample = SandboxMetrics(
            cpu_count=cpus, cpu_used_pct=round(100.0 * cpu_s / elapsed / cpus, 2), disk_total=disk.total,
            disk_used=used, mem_total=total_mem, mem_used=mem.cgroup_usage,
            mem_cache=max(mem.cgroup_usage - mem.rss, 0),
            timestamp=datetime.datetime.now(datetime.UTC),
        )
        in_range = (start is None or sample.timestamp >= start) and (end is None or sample.timestamp <= end)
        return [sample] if in_range else []

    get_metrics = instance_or_class(get_metrics)  # type: ignore[assignment]

    @classmethod
    def list(cls, query: SandboxQuery | None = None, limit: int | None = None,  # type: ignore[override]
             next_token: str | None = None, order: Literal["asc", "desc"] | None = None,
             **opts: Any) -> SandboxPaginator:
        """Every running or paused workspace on this host, filtered by `query`."""
        if order not in (None, "asc", "desc"):
            raise InvalidArgumentException(f"Invalid order {order!r}, expected 'asc' or 'desc'")
        infos = []
        for w in Workspace.list():
            try:
                infos.append(cls._attach(w.id).get_info())
            except BunshinError:
                continue  # ended between listing and attaching
        if query is not None:
            infos = [i for i in infos if _matches(i, query)]
        infos.sort(key=lambda i: i.started_at, reverse=order == "desc")
        return SandboxPaginator(infos, limit, next_token)

    # ---- lifetime ----

    def set_timeout(self, timeout: int, **opts: Any) -> None:  # type: ignore[override]
        """End the sandbox `timeout` seconds from now (extends or shortens it)."""
        Workspace.set_timeout(self, timeout)

    set_timeout = instance_or_class(set_timeout)  # type: ignore[assignment]

    def connect(self, timeout: int | None = None, *,  # type: ignore[override]
                on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> Sandbox:
        """Resume a paused sandbox; `timeout` extends (never shortens) a running one's lifetime."""
        if on_resume not in ("restore", "reboot"):
            raise InvalidArgumentException(f"on_resume must be 'restore' or 'reboot', not {on_resume!r}")
        if on_resume == "reboot":
            raise InvalidArgumentException("on_resume='reboot' cold-boots from a disk snapshot; a local sandbox "
                                           "is paused with its memory and resumes as it was")
        if timeout is not None:
            rec = self._refresh()
            left = rec.lifetime.deadline - time.time() if rec.lifetime.deadline else float("inf")
            if timeout > left:
                Workspace.set_timeout(self, timeout)
        if self.info().state == "paused":
            self.resume()
        return self

    connect = instance_or_class(connect, _connect_by_id)  # type: ignore[assignment]

    def pause(self, keep_memory: bool | None = None, *, mode: Literal["full", "filesystem"] | None = None,  # type: ignore[override]
              strict: bool = False, **opts: Any) -> bool:
        """Freeze every process (its memory stays); connect() resumes it. False if paused already."""
        if keep_memory is False or mode == "filesystem":
            raise InvalidArgumentException("a filesystem-only pause drops the sandbox's memory; a local sandbox "
                                           "pauses with its memory (mode='full')")
        if self.info().state == "paused":
            return False
        Workspace.pause(self)
        return True

    pause = instance_or_class(pause)  # type: ignore[assignment]

    def beta_pause(self, keep_memory: bool | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                   **opts: Any) -> bool:
        """Deprecated by E2B: pause()."""
        return self.pause(keep_memory, mode=mode)

    beta_pause = instance_or_class(beta_pause)  # type: ignore[assignment]

    def kill(self, **opts: Any) -> bool:
        """Kill the sandbox and remove everything it holds; False if it was gone already."""
        if self._rec.status == "destroyed" or not (state.RUN_ROOT / self.id).exists():
            return False
        self.destroy()
        self._log("killed sandbox %s", self.id)
        return True

    kill = instance_or_class(kill, _kill_by_id)  # type: ignore[assignment]

    def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        self.kill()

    # ---- forking and snapshots ----

    def fork(self, timeout: int | None = None, count: int | None = None,  # type: ignore[override]
             **opts: Any) -> list[Sandbox | Exception]:
        """Live-fork into `count` (default 1, at most 20) running sandboxes, each living
        `timeout` seconds (default 300); a failed fork is an Exception in the list."""
        n = 1 if count is None else count
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORKS:
            raise InvalidArgumentException(f"count must be an integer between 1 and {MAX_FORKS}, got {count!r}")
        life = self.default_sandbox_timeout if timeout is None else timeout
        out: list[Sandbox | Exception] = []
        for r in Workspace.fork(self, n, timeout=life):
            if isinstance(r, Exception):
                out.append(r)
                continue
            clone = type(self)._adopt(r)
            clone._rec.metadata, clone._rec.template = dict(self._rec.metadata), self._rec.template
            clone._rec.save()
            clone._logger = self._logger
            out.append(clone)
        return out

    fork = instance_or_class(fork, _fork_by_id)  # type: ignore[assignment]

    def create_snapshot(self, name: str | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                        **opts: Any) -> SnapshotInfo:
        """Save the sandbox's whole running state (memory, processes, files) under
        BUNSHIN_SNAPSHOT_ROOT; Sandbox.create(snapshot_id or name) starts a sandbox from it."""
        if mode == "filesystem":
            raise InvalidArgumentException("a filesystem-only snapshot is not offered: a snapshot keeps memory "
                                           "and processes (mode='full')")
        with self.snapshot() as snap:
            dest = SNAPSHOT_ROOT / snap.id
            SNAPSHOT_ROOT.mkdir(parents=True, exist_ok=True)
            snap.save(dest).result()
        if name:
            for d in _snapshot_dirs():  # a name names the newest snapshot given it, as E2B's do
                info, _ = _snapshot_info(d)
                if name in info.names:
                    (d / "names.json").write_text(json.dumps([n for n in info.names if n != name]))
            (dest / "names.json").write_text(json.dumps([name]))
        return SnapshotInfo(dest.name, [name] if name else [])

    create_snapshot = instance_or_class(create_snapshot)  # type: ignore[assignment]

    def list_snapshots(self, limit: int | None = None, next_token: str | None = None, name: str | None = None,
                       **opts: Any) -> SnapshotPaginator:
        return SnapshotPaginator(_saved_snapshots(self.id, name), limit, next_token)

    list_snapshots = instance_or_class(list_snapshots, _list_snapshots_all)  # type: ignore[assignment]

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, **opts: Any) -> bool:
        d = _find_snapshot(snapshot_id)
        if d is None or d.name != snapshot_id:
            return False
        shutil.rmtree(d)
        return True

    # ---- reaching it ----

    def get_host(self, port: int) -> str:
        """host:port at which the host reaches `port` inside the sandbox (a bridge network's
        address; a loopback-only sandbox has none)."""
        addr = self._rec.network.ip if self._rec.network else None
        if not addr:
            raise InvalidArgumentException("the sandbox has no network the host can reach (create it with "
                                           "allow_internet_access=True for a bridge network)")
        return f"{str(addr).split('/')[0]}:{port}"

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} init={self.init_pid} {self._rec.status}>"


def _check_lifecycle(lifecycle: dict[str, Any] | None) -> None:
    if not lifecycle:
        return
    on_timeout = lifecycle.get("on_timeout", "kill")
    action = on_timeout.get("action") if isinstance(on_timeout, dict) else on_timeout
    if action != "kill" or lifecycle.get("auto_resume"):
        raise InvalidArgumentException("a local sandbox is killed when its timeout ends (lifecycle on_timeout "
                                       "'kill'); pausing on timeout needs E2B's persistence service")


def _matches(info: SandboxInfo, q: SandboxQuery) -> bool:
    if q.metadata and any(info.metadata.get(k) != v for k, v in q.metadata.items()):
        return False
    if q.state and info.state not in q.state:
        return False
    if q.started_after and info.started_at <= q.started_after:
        return False
    return not (q.template and info.template_id != q.template)
