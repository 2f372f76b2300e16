"""Sandbox: E2B's Sandbox over a bunshin workspace, for code written against E2B.

A Sandbox has a Workspace (`.workspace`) and reaches it through Workspace's public API
only. The differences are E2B's: a sandbox ends after 300 s unless told otherwise
(set_timeout, connect(timeout=...)); commands run in a login bash as the non-root user
"user" (who exists in every sandbox, home /home/user) and raise CommandExitException when
they exit non-zero; fork(timeout=None, count=None) takes E2B's parameters; pause() saves the
sandbox to disk and frees its memory, connect() restores it, and lifecycle={"on_timeout":
"pause"} pauses it at its deadline; kill(), get_info(), set_timeout(), connect() and pause()
work on an instance or, given a sandbox id, on the class. Those rules are e2b/lifecycle.py's,
which `bunshin serve` runs too. What E2B does in its cloud and cannot apply to one host (API keys, domains,
regions, egress proxies, MCP gateways, volumes) is accepted and ignored where it only
configures the transport, and refused where ignoring it would change what the sandbox is.
As in E2B, a sandbox is online by default (a bridged workspace with NAT, which forks), and
its egress rules (network={"allow_out": [...], "deny_out": [...]}, update_network) are
enforced by the host (bunshinfork.network.egress).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import logging
import os
import time
from typing import Any, Literal, TypeVar

from .. import users
from ..commands import E2B, Commands, Conventions, Pty
from ..errors import (
    BunshinError,
    InvalidArgumentException,
    NetworkError,
    WorkspaceFileNotFound,
    WorkspaceNotFound,
    WorkspaceStateError,
)
from ..files import Files
from ..workspace import Workspace
from . import lifecycle as rules
from . import network as e2b_network
from . import sidecar, templates
from .dispatch import variant
from .lifecycle import PAUSED_TO_DISK, Lifecycle
from .types import (
    SandboxInfo,
    SandboxMetrics,
    SandboxPaginator,
    SandboxQuery,
    SandboxState,
    SnapshotInfo,
    SnapshotPaginator,
    utc,
)

MAX_FORKS = rules.MAX_FORKS
S = TypeVar("S", bound="Sandbox")


def _kill_by_id(cls: type[Sandbox], sandbox_id: str, **opts: Any) -> bool:
    try:
        return cls.from_id(sandbox_id).kill()
    except (WorkspaceNotFound, WorkspaceStateError):
        return False


def _connect_by_id(cls: type[S], sandbox_id: str, timeout: int | None = None, logger: logging.Logger | None = None,
                   *, on_resume: Literal["restore", "reboot"] = "restore", **opts: Any) -> S:
    return cls.from_id(sandbox_id, logger).connect(timeout, on_resume=on_resume)


def _fork_by_id(cls: type[S], sandbox_id: str, timeout: int | None = None, count: int | None = None,
                logger: logging.Logger | None = None, **opts: Any) -> list[S | Exception]:
    return cls.from_id(sandbox_id, logger).fork(timeout, count)


def _list_snapshots_all(cls: type[Sandbox], sandbox_id: str | None = None, limit: int | None = None,
                        next_token: str | None = None, name: str | None = None, **opts: Any) -> SnapshotPaginator:
    return SnapshotPaginator(templates.saved(sandbox_id, name), limit, next_token)


def check_create_options(mcp: dict[str, Any] | None, network: dict[str, Any] | None, iam: dict[str, Any] | None,
                         lifecycle: dict[str, Any] | None, volume_mounts: dict[str, Any] | None) -> Lifecycle:
    """Refuse the options that configure an E2B cloud service a local sandbox does not have
    (network's rules are checked by network.create_policy); the lifecycle asked for."""
    for name, value in (("mcp", mcp), ("iam", iam), ("volume_mounts", volume_mounts)):
        if value:
            raise InvalidArgumentException(f"{name}= configures an E2B cloud service that a local sandbox "
                                           "does not have")
    life = rules.lifecycle_from_sdk(lifecycle)
    if life.auto_resume:
        raise InvalidArgumentException("lifecycle auto_resume resumes a paused sandbox on traffic through E2B's "
                                       "proxy; an in-process sandbox resumes on connect() (`bunshin serve` "
                                       "serves auto_resume)")
    return life


def _cycle(meta: sidecar.Meta) -> Lifecycle:
    return Lifecycle("pause" if meta.on_timeout == "pause" else "kill", meta.auto_resume)


SUDO = ("/usr/bin/sudo", "/bin/sudo")


def ensure_default_user(ws: Workspace, name: str) -> users.User:
    """E2B's sandboxes have a user "user" (home /home/user): add it where the rootfs (an image,
    say) lacks it, as E2B's template build does, with password-less sudo where the rootfs has
    sudo. A user the rootfs has is left as it is."""
    files = ws.files
    passwd, group = (_read_as_root(files, p) for p in users.Accounts.PATHS)
    new_passwd, new_group, user = users.add_user(passwd, group, name)
    if new_passwd != passwd:
        files.write("/etc/passwd", new_passwd, user="root")
        files.write("/etc/group", new_group, user="root")
        _add_shadow(files, name)
        _grant_sudo(files, name)
    if not files.exists(user.home, user="root"):
        files.make_dir(user.home, user="root")
        # Resolved in the sandbox's root: an image's /home may be a symlink, and must not
        # lead a host path to the host's own directory.
        files.chown(user.home, user.name)
    return user


def _add_shadow(files: Files, name: str) -> None:
    """A shadow entry for the new user where the rootfs keeps /etc/shadow: PAM's account check
    (sudo's, su's) refuses a user it lacks. '*': no password logs in, the sudo entry needs none."""
    shadow = _read_as_root(files, "/etc/shadow")
    if not shadow or any(line.split(":", 1)[0] == name for line in shadow.splitlines()):
        return
    days = int(time.time() // 86400)
    files.write("/etc/shadow", shadow + ("" if shadow.endswith("\n") else "\n") + f"{name}:*:{days}:0:99999:7:::\n",
                user="root")


def _grant_sudo(files: Files, name: str) -> None:
    """E2B's template build appends NOPASSWD: ALL for its user to /etc/sudoers; so do we, where
    sudo and its sudoers are there (the file keeps its 0440 root: sudo refuses anything else)."""
    if not any(files.exists(p, user="root") for p in SUDO):
        return
    sudoers = _read_as_root(files, "/etc/sudoers")
    if not sudoers:
        return
    entry = f"{name} ALL=(ALL:ALL) NOPASSWD: ALL\n"
    if entry not in sudoers:
        files.write("/etc/sudoers", sudoers + ("" if sudoers.endswith("\n") else "\n") + entry, user="root")


def _read_as_root(files: Files, path: str) -> str:
    try:
        return str(files.read(path, user="root"))
    except WorkspaceFileNotFound:
        return ""


class Sandbox:
    """A workspace behind E2B's Sandbox interface (see the module's docstring)."""

    conventions: Conventions = E2B
    default_sandbox_timeout = 300
    default_template = templates.DEFAULT

    def __init__(self, ws: Workspace, logger: logging.Logger | None = None) -> None:
        """Serve `ws` as a sandbox: its commands and files follow E2B's conventions from now on."""
        ws.set_conventions(self.conventions)
        self._ws = ws
        self._logger = logger

    @classmethod
    def from_id(cls: type[S], sandbox_id: str, logger: logging.Logger | None = None) -> S:
        """Attach to the sandbox `sandbox_id` as it is (connect() also resumes it). One whose
        lifecycle pauses it and whose deadline passed while no process watched it is paused now."""
        sbx = cls(Workspace.connect(sandbox_id), logger)
        if sbx.workspace.is_running() and sidecar.load(sbx.workspace).deadline <= time.time():
            cls._on_deadline(sbx)
        return sbx

    @property
    def workspace(self) -> Workspace:
        """The workspace behind the sandbox (snapshots, memory, bunshin's fork(count, memory))."""
        return self._ws

    @property
    def commands(self) -> Commands:
        return self._ws.commands

    @property
    def files(self) -> Files:
        return self._ws.files

    @property
    def pty(self) -> Pty:
        return self._ws.pty

    # ---- construction ----

    @classmethod
    def create(
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
        spec: dict[str, Any] | None = None,
        **opts: Any,
    ) -> S:
        """Create a sandbox and start it.

        template: "base" (the default: the host's /usr under a generated /etc), "debian", an
        image ("docker:IMAGE", "oci:DIR[:TAG]", "registry:REF"), an absolute directory, or the
        id or name of a snapshot saved by create_snapshot() or of a warm template (bunshin
        template create). Commands run as "user" whatever the image's User (added, with
        password-less sudo where the image has sudo, if the image lacks it). timeout: its
        lifetime in seconds (default 300; 0: none).
        Every sandbox has a bridge network with NAT (E2B's default allow_internet_access=True);
        allow_internet_access=False denies all egress (deny_out 0.0.0.0/0, as in E2B), and
        network={"allow_out": [...], "deny_out": [...]} takes E2B's egress rules (CIDRs,
        addresses or domain names matched on Host and SNI, or callables given
        ctx.all_traffic); the host enforces them, forks inherit them, a denied connection is
        refused at once. network's rules, egress_proxy, dns_servers and mask_request_host
        cannot apply here: InvalidArgumentException. A sandbox from a saved snapshot has the
        snapshot's network, under these rules. secure, idempotency_key and the API options
        (api_key, domain, request_timeout, ...) configure E2B's cloud transport and are
        ignored. mcp, iam and volume_mounts are E2B cloud services: refused.
        lifecycle={"on_timeout": "pause"} pauses it to disk at its deadline (this process keeps
        that deadline; any later call on it by id from another does too, if overdue).
        spec (bunshin's, not E2B's): WorkspaceSpec fields on top of the sandbox's own, what
        `bunshin serve` sets for its sandboxes (port_isolation, block_private, memory_limit,
        pids_limit); a sandbox from a saved snapshot keeps the snapshot's.
        """
        cycle = check_create_options(mcp, network, iam, lifecycle, volume_mounts)
        policy = e2b_network.create_policy(network, allow_internet_access)  # refused before anything is built
        life = cls.default_sandbox_timeout if timeout is None else timeout
        net = {"network": "bridge", "nat": True, "egress": policy.to_dict() if policy is not None else None}
        net.update({k: v for k, v in (spec or {}).items() if k not in net})  # the rules above are E2B's
        sbx = cls(templates.start(template, life if cycle.on_timeout == "kill" else 0, dict(envs or {}), net), logger)
        try:
            deadline = rules.deadline_after(life) if cycle.on_timeout == "pause" else float("inf")
            sidecar.save(sbx.workspace, sidecar.Meta(dict(metadata or {}), template or cls.default_template,
                                                     cycle.on_timeout, cycle.auto_resume, deadline,
                                                     allow_internet_access is not False))
            ensure_default_user(sbx.workspace, str(cls.conventions.default_user))
        except BaseException:
            sbx.workspace.destroy()
            raise
        cls._watch(sbx)
        if logger is not None:
            logger.info("created sandbox %s from %s", sbx.sandbox_id, template or cls.default_template)
        return sbx

    def _log(self, msg: str, *args: object) -> None:
        if self._logger is not None:
            self._logger.info(msg, *args)

    # ---- the sandbox as it is now ----

    def _current(self) -> Workspace:
        """The workspace as its record says now: another process (or this one's deadline
        watcher, through another object) may have paused or resumed it since."""
        ws = self._ws
        if ws.is_running() or ws.is_destroyed():
            return ws
        try:
            now = Workspace.connect(ws.id)
        except BunshinError:
            return ws
        now.set_conventions(self.conventions)
        self._ws = now
        return now

    def _watch(self) -> None:
        """Arm (or disarm) this process's watch of the deadline, where the lifecycle pauses."""
        meta = sidecar.load(self._ws)
        if meta.on_timeout == "pause" and meta.deadline != float("inf"):
            rules.WATCHER.arm(self.sandbox_id, meta.deadline, self._on_deadline)
        else:
            rules.WATCHER.disarm(self.sandbox_id)

    def _on_deadline(self) -> None:
        ws = self._current()
        meta = sidecar.load(ws)
        if meta.on_timeout != "pause" or not ws.is_running():
            return
        if meta.deadline > time.time():  # moved by another process meanwhile
            self._watch()
            return
        rules.pause(ws)
        self._log("paused sandbox %s at its deadline", self.sandbox_id)

    # ---- identity and state ----

    @property
    def sandbox_id(self) -> str:
        return self._ws.id

    def is_running(self, request_timeout: float | None = None) -> bool:
        return self._current().is_running()

    @variant()
    def get_info(self, **opts: Any) -> SandboxInfo:
        ws = self._current()
        meta = sidecar.load(ws)
        info = ws.info()
        ends = meta.deadline if meta.on_timeout == "pause" else (ws.ends_at() or float("inf"))
        mem = info.memory_limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SandboxInfo(
            sandbox_id=ws.id, sandbox_domain=None, template_id=meta.template or info.rootfs, name=None,
            metadata=dict(meta.metadata), started_at=utc(info.created_at), end_at=rules.utc(ends),
            state=SandboxState.PAUSED if rules.is_paused(ws) else SandboxState.RUNNING,
            cpu_count=os.cpu_count() or 1, memory_mb=mem >> 20, envd_version=importlib.metadata.version("bunshin"),
            allow_internet_access=meta.allow_internet_access and info.network.get("mode") == "bridge",
            network=e2b_network.info(info.egress), lifecycle=_cycle(meta).to_sdk(), volume_mounts=[],
        )

    @variant()
    def get_metrics(self, start: datetime.datetime | None = None, end: datetime.datetime | None = None,
                    **opts: Any) -> list[SandboxMetrics]:
        """One sample, now (none while paused): see lifecycle.metrics."""
        ws = self._current()
        if rules.is_paused(ws):
            return []
        sample = rules.metrics(ws)
        in_range = (start is None or sample.timestamp >= start) and (end is None or sample.timestamp <= end)
        return [sample] if in_range else []


    @classmethod
    def list(cls, query: SandboxQuery | None = None, limit: int | None = None,
             next_token: str | None = None, order: Literal["asc", "desc"] | None = None,
             **opts: Any) -> SandboxPaginator:
        """Every running or paused workspace on this host, filtered by `query`."""
        if order not in (None, "asc", "desc"):
            raise InvalidArgumentException(f"Invalid order {order!r}, expected 'asc' or 'desc'")
        infos = []
        for w in Workspace.list():
            try:
                infos.append(cls.from_id(w.id).get_info())
            except BunshinError:
                continue  # ended between listing and attaching
        if query is not None:
            infos = [i for i in infos if i.matches(query)]
        infos.sort(key=lambda i: i.started_at, reverse=order == "desc")
        return SandboxPaginator(infos, limit, next_token)

    # ---- lifetime ----

    @variant()
    def set_timeout(self, timeout: int, **opts: Any) -> None:
        """End (or pause, as its lifecycle says) the sandbox `timeout` seconds from now (extends
        or shortens it). A paused sandbox takes its lifetime when it resumes (connect)."""
        self._set_deadline(self._current(), timeout)

    def _set_deadline(self, ws: Workspace, timeout: int) -> None:
        meta = sidecar.load(ws)
        if meta.on_timeout == "pause":
            sidecar.save(ws, dataclasses.replace(meta, deadline=rules.deadline_after(timeout)))
            self._watch()
        elif ws.info().state != PAUSED_TO_DISK:
            ws.set_timeout(timeout)

    @variant(_connect_by_id)
    def connect(self, timeout: int | None = None, *, on_resume: Literal["restore", "reboot"] = "restore",
                **opts: Any) -> Sandbox:
        """Resume a paused sandbox; `timeout` extends (never shortens) a running one's lifetime."""
        if on_resume not in ("restore", "reboot"):
            raise InvalidArgumentException(f"on_resume must be 'restore' or 'reboot', not {on_resume!r}")
        if on_resume == "reboot":
            raise InvalidArgumentException("on_resume='reboot' cold-boots from a disk snapshot; a local sandbox "
                                           "is paused with its memory and resumes as it was")
        ws = self._current()
        meta = sidecar.load(ws)
        if ws.info().state == PAUSED_TO_DISK:
            deadline = rules.resumed_deadline(timeout)
            rules.resume(ws, _cycle(meta), deadline)
            if meta.on_timeout == "pause":
                sidecar.save(ws, dataclasses.replace(meta, deadline=deadline))
            self._watch()
            self._log("resumed sandbox %s", self.sandbox_id)
            return self
        if timeout is not None:
            ends = meta.deadline if meta.on_timeout == "pause" else (ws.ends_at() or float("inf"))
            if rules.extended(ends, timeout) != ends:
                self._set_deadline(ws, timeout)
        if ws.info().state == "paused":  # frozen by Workspace.pause(): thawed
            ws.resume()
        return self

    @variant()
    def pause(self, keep_memory: bool | None = None, *, mode: Literal["full", "filesystem"] | None = None,
              strict: bool = False, **opts: Any) -> bool:
        """Save the sandbox's whole state to disk and give its processes and memory back to the
        host (Workspace.pause_to_disk); connect() restores it, processes running and files as
        they were. False if paused already."""
        if keep_memory is False or mode == "filesystem":
            raise InvalidArgumentException("a filesystem-only pause drops the sandbox's memory; a local sandbox "
                                           "pauses with its memory (mode='full')")
        rules.WATCHER.disarm(self.sandbox_id)
        try:
            paused = rules.pause(self._current())
        except BaseException:
            self._watch()  # still running: its deadline still pauses it
            raise
        if paused:
            self._log("paused sandbox %s", self.sandbox_id)
        return paused

    @variant()
    def beta_pause(self, keep_memory: bool | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                   **opts: Any) -> bool:
        """Deprecated by E2B: pause()."""
        return self.pause(keep_memory, mode=mode)

    @variant(_kill_by_id)
    def kill(self, **opts: Any) -> bool:
        """Kill the sandbox and remove everything it holds (a paused one's saved state too);
        False if it was gone already."""
        ws = self._current()
        if ws.is_destroyed():
            return False
        rules.WATCHER.disarm(self.sandbox_id)
        ws.destroy()
        self._log("killed sandbox %s", self.sandbox_id)
        return True


    def __enter__(self: S) -> S:
        return self

    def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> None:
        self.kill()

    # ---- forking and snapshots ----

    @variant()
    def update_network(self, network: dict[str, Any], **opts: Any) -> None:
        """Replace the sandbox's egress rules (E2B's SandboxNetworkUpdate: allow_out, deny_out,
        allow_internet_access; what it leaves out is cleared). Open connections carry on; new
        ones meet the new rules. Forks made afterwards inherit them."""
        policy, internet = e2b_network.update_policy(network)
        self._ws.set_egress(policy.to_dict() if policy is not None else None)
        meta = sidecar.load(self._ws)
        if meta.allow_internet_access != internet:
            sidecar.save(self._ws, dataclasses.replace(meta, allow_internet_access=internet))

    @variant(_fork_by_id)
    def fork(self: S, timeout: int | None = None, count: int | None = None,
             **opts: Any) -> list[S | Exception]:
        """Live-fork into `count` (default 1, at most 20) running sandboxes, each living
        `timeout` seconds (default 300); a failed fork is an Exception in the list."""
        n = rules.check_fork_count(count)
        life = self.default_sandbox_timeout if timeout is None else timeout
        ws = self._current()
        meta = sidecar.load(ws)
        # A child's lifecycle is its own (the default); its network is its source's.
        meta = sidecar.Meta(meta.metadata, meta.template, allow_internet_access=meta.allow_internet_access)
        out: list[S | Exception] = []
        for r in ws.fork(n, timeout=life):
            if isinstance(r, Exception):
                out.append(r)
                continue
            sidecar.save(r, meta)
            out.append(type(self)(r, self._logger))
        return out

    @variant()
    def create_snapshot(self, name: str | None = None, *, mode: Literal["full", "filesystem"] | None = None,
                        **opts: Any) -> SnapshotInfo:
        """Save the sandbox's whole running state (memory, processes, files) under
        BUNSHIN_SNAPSHOT_ROOT; Sandbox.create(snapshot_id or name) starts a sandbox from it."""
        if mode == "filesystem":
            raise InvalidArgumentException("a filesystem-only snapshot is not offered: a snapshot keeps memory "
                                           "and processes (mode='full')")
        return templates.save(self._ws, name)

    @variant(_list_snapshots_all)
    def list_snapshots(self, limit: int | None = None, next_token: str | None = None, name: str | None = None,
                       **opts: Any) -> SnapshotPaginator:
        return SnapshotPaginator(templates.saved(self.sandbox_id, name), limit, next_token)


    @classmethod
    def delete_snapshot(cls, snapshot_id: str, **opts: Any) -> bool:
        return templates.delete(snapshot_id)

    # ---- reaching it ----

    def get_host(self, port: int) -> str:
        """host:port at which the host reaches `port` inside the sandbox: its own address on the
        bridge, or for a fork (which shares its source's address) and a loopback-only sandbox, a
        port this process forwards into the sandbox's own network namespace (ws.ports), kept
        until the sandbox is killed."""
        net = self._ws.info().network
        if net.get("ip") and net.get("zone") is None:
            return f"{str(net['ip']).split('/')[0]}:{port}"
        published = self._ws.ports.list().get(port)
        if published is None:
            try:
                published = self._ws.ports.publish(port)
            except NetworkError:  # published meanwhile by another thread of this process
                published = self._ws.ports.list().get(port)
                if published is None:
                    raise
        return f"{published[0]}:{published[1]}"

    def __repr__(self) -> str:
        return f"<Sandbox {self.sandbox_id} init={self._ws.init_pid}>"
