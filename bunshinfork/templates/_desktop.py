"""What the two desktop templates (X11 and Wayland) share: the window record, the apps'
settings, and the noVNC live view with its relay from the host."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Self

from .. import native
from ..workspace import Workspace
from ._common import fork_hint, run, start_daemon, wait_until

CHROMIUM = "/usr/lib/chromium/chromium"
# --no-sandbox: Chromium refuses to run as root with its sandbox ("Running as root without
# --no-sandbox is not supported"), and its sandbox would need user namespaces inside the
# workspace. The rest keep it from phoning out (the workspace has no network) and from putting
# first-run UI over the page. Crashpad stays on: --disable-crashpad-for-testing makes the
# network service crash in a loop ("FD ownership violation").
CHROMIUM_FLAGS = (
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--no-default-browser-check",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-breakpad", "--password-store=basic", "--use-mock-keychain",
    "--test-type",  # no "unsupported command-line flag: --no-sandbox" bar over every page
)
# Read by GLib's keyfile settings backend (GSETTINGS_BACKEND=keyfile), under XDG_CONFIG_HOME.
GSETTINGS_FILE = "glib-2.0/settings/keyfile"
# monitor-changes=false: mousepad would put an inotify watch on the file it edits. CRIU dumps
# a watch by file handle, overlayfs (mounted without nfs_export) cannot decode handles, and
# CRIU's fallback, a path search by device and inode, never matches a regular file on
# overlayfs (stat shows the layer's device, the watch the overlay's), so the dump would fail
# with "fsnotify: Can't dump that handle". Directory watches resolve fine.
GSETTINGS = """[org/xfce/mousepad/preferences/file]
monitor-changes=false
session-restore='never'
autosave-timer=uint32 0
"""
LIVE_VIEW_VNC_PORT = 5900
LIVE_VIEW_WEB_PORT = 6080


@dataclass(frozen=True)
class Window:
    """A top-level window. x, y, width, height: its client area on the screen."""

    id: str
    desktop: int
    pid: int
    x: int
    y: int
    width: int
    height: int
    title: str
    app_id: str = ""  # the Wayland app id, or the X window's WM_CLASS instance
    focused: bool = False


class Desktop:
    """What both desktop wrappers share: the workspace, the live view's host relays, the lifecycle."""

    def __init__(self, ws: Workspace, config: Any) -> None:
        self.ws = ws
        self.config = config
        self._forwarders: list[Forwarder] = []

    @property
    def id(self) -> str:
        return self.ws.id

    def forward_live_view(self, host_port: int = 0) -> str:
        """Serve the live view on the host's 127.0.0.1 (each connection is relayed into this
        workspace's network namespace); returns the host URL. Closed by close()/destroy()."""
        fwd = Forwarder(self.ws, host_port=host_port)
        self._forwarders.append(fwd)
        return fwd.live_view_url

    def fork(self, count: int = 1, memory: str = "auto") -> list[Self | Exception]:
        return [fork_hint(c) if isinstance(c, Exception) else type(self)(c, self.config)
                for c in self.ws.fork(count, memory)]

    def close(self) -> None:
        for f in self._forwarders:
            f.close()
        self._forwarders.clear()

    def destroy(self) -> None:
        self.close()
        self.ws.destroy()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def start_websockify(ws: Workspace) -> str:
    """noVNC's websockify on the workspace's 127.0.0.1, in front of the VNC server the desktop
    runs on LIVE_VIEW_VNC_PORT; returns the live view's URL as seen inside the workspace."""
    start_daemon(ws, f"websockify --web /usr/share/novnc 127.0.0.1:{LIVE_VIEW_WEB_PORT} "
                     f"127.0.0.1:{LIVE_VIEW_VNC_PORT}", "/tmp/websockify.log")

    # Look at the listening sockets rather than connecting: a probe's connection that the
    # server has not accepted yet would sit in the accept queue, and CRIU refuses to dump
    # such an in-flight connection ("In-flight connection (l)").
    def listening() -> bool:
        out = run(ws, "ss -Hltn", check=False).stdout
        return all(f":{p} " in out for p in (LIVE_VIEW_VNC_PORT, LIVE_VIEW_WEB_PORT))

    wait_until(listening, "the VNC server and websockify to listen", 30)
    return f"http://127.0.0.1:{LIVE_VIEW_WEB_PORT}/vnc.html?autoconnect=1"


class Forwarder:
    """Relay TCP from the host's 127.0.0.1 to a port on a workspace's own loopback."""

    def __init__(self, ws: Workspace, inner_port: int = LIVE_VIEW_WEB_PORT, host_port: int = 0) -> None:
        self._netns = f"/proc/{ws.init_pid}/ns/net"
        self._inner = inner_port
        self._listener = socket.create_server(("127.0.0.1", host_port))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"bunshin-fwd-{self.port}").start()

    @property
    def live_view_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/vnc.html?autoconnect=1"

    def _inner_socket(self) -> socket.socket:
        box: list[Any] = []

        def enter() -> None:
            # setns(CLONE_NEWNET) changes only this thread, and a socket keeps the namespace
            # it was created in; the thread ends right after, so nothing else runs in there.
            try:
                fd = os.open(self._netns, os.O_RDONLY)
                try:
                    native.setns(fd, 0)
                finally:
                    os.close(fd)
                box.append(socket.create_connection(("127.0.0.1", self._inner), timeout=5))
            except BaseException as e:
                box.append(e)

        t = threading.Thread(target=enter)
        t.start()
        t.join()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _accept(self) -> None:
        while not self._closed:
            try:
                outer, _ = self._listener.accept()
            except OSError:
                return
            try:
                inner = self._inner_socket()
            except OSError:
                outer.close()
                continue
            inner.settimeout(None)
            for a, b in ((outer, inner), (inner, outer)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
