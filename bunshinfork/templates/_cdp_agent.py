"""Chrome DevTools Protocol driver that runs INSIDE a workspace with the host's python3 stdlib.

Copied into the workspace by the web-shop template and invoked once per browser tool call:

    python3 cdp_agent.py '{"op": "goto", "url": "http://127.0.0.1:8080/"}'

It prints one JSON object, {"ok": true, "result": ...} or {"ok": false, "error": "..."}.
The browser's debugging port listens on the workspace's own 127.0.0.1, which the host cannot
reach (network="none"), so the client must run in here. Each call opens a fresh DevTools
connection and closes it, so no connection to the DevTools port is open while the workspace
is forked and every clone drives its own browser without sharing a session.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import struct
import sys
import time
import urllib.request
from typing import Any

PORT = int(os.environ.get("CDP_PORT", "9222"))
TIMEOUT = float(os.environ.get("CDP_TIMEOUT", "20"))


class CdpError(Exception):
    pass


class WebSocket:
    """The client half of RFC 6455, just enough for DevTools (text frames, no extensions)."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self.sock = socket.create_connection((host, port), timeout=TIMEOUT)
        key = base64.b64encode(os.urandom(16)).decode()
        # No Origin header: Chromium only checks --remote-allow-origins when one is sent.
        req = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(req.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise CdpError("DevTools closed the connection during the websocket handshake")
            head += chunk
        status, _, rest = head.partition(b"\r\n\r\n")
        if b" 101 " not in status.split(b"\r\n", 1)[0]:
            raise CdpError(f"websocket handshake refused: {status.decode(errors='replace')[:200]}")
        self.buf = rest

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise CdpError("DevTools closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text: str) -> None:
        data = text.encode()
        head = bytearray([0x81])
        n = len(data)
        if n < 126:
            head.append(0x80 | n)
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        # Clients must mask every frame (RFC 6455 5.3).
        masked = bytes(b ^ mask[i & 3] for i, b in enumerate(data))
        self.sock.sendall(bytes(head) + mask + masked)

    def recv(self) -> str:
        parts: list[bytes] = []
        while True:
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else b""
            payload = self._read(n)
            if mask:
                payload = bytes(b ^ mask[i & 3] for i, b in enumerate(payload))
            if opcode == 0x8:
                raise CdpError("DevTools sent a close frame")
            if opcode == 0x9:  # ping: answer so a long wait is not dropped
                self.sock.sendall(bytes([0x8A, 0x80 | len(payload)]) + b"\0\0\0\0" + payload)
                continue
            if opcode in (0x1, 0x2, 0x0):
                parts.append(payload)
                if b0 & 0x80:
                    return b"".join(parts).decode()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(b"\x88\x80\0\0\0\0")
        self.sock.close()


class Page:
    """One page target: send commands, collect the events that arrive meanwhile."""

    def __init__(self, ws_url: str) -> None:
        rest = ws_url.split("://", 1)[1]
        hostport, _, path = rest.partition("/")
        host, _, port = hostport.rpartition(":")
        self.ws = WebSocket(host, int(port), "/" + path)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        my_id = self.next_id
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise CdpError(f"{method}: {msg['error'].get('message')}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def wait_event(self, method: str, timeout: float = TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev["method"] == method:
                    return self.events.pop(i)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CdpError(f"no {method} within {timeout}s")
            self.ws.sock.settimeout(left)
            try:
                msg = json.loads(self.ws.recv())
            except TimeoutError:
                raise CdpError(f"no {method} within {timeout}s") from None
            finally:
                self.ws.sock.settimeout(TIMEOUT)
            if "method" in msg:
                self.events.append(msg)

    def evaluate(self, expr: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise CdpError(d.get("exception", {}).get("description") or d.get("text", "script error"))
        return r.get("result", {}).get("value")

    def wait_ready(self, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise CdpError("page did not finish loading")
            time.sleep(0.02)

    def close(self) -> None:
        self.ws.close()


def first_page() -> Page:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/json/list", timeout=TIMEOUT) as r:
        targets = json.load(r)
    pages = [t for t in targets if t.get("type") == "page"]
    if not pages:
        # The only tab was closed: open a fresh one rather than fail every later call.
        req = urllib.request.Request(f"http://127.0.0.1:{PORT}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            pages = [json.load(r)]
    return Page(pages[0]["webSocketDebuggerUrl"])


def _js(s: str) -> str:
    return json.dumps(s)


def _center(page: Page, selector: str) -> tuple[float, float]:
    box = page.evaluate(
        f"(() => {{ const el = document.querySelector({_js(selector)});"
        " if (!el) return null; el.scrollIntoView({block: 'center', inline: 'center'});"
        " const r = el.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()"
    )
    if not box:
        raise CdpError(f"no element matches {selector!r}")
    return float(box[0]), float(box[1])


def op_goto(page: Page, url: str) -> str:
    page.call("Page.enable")
    r = page.call("Page.navigate", url=url)
    if r.get("errorText"):
        raise CdpError(f"navigation to {url} failed: {r['errorText']}")
    page.wait_ready()
    return str(page.evaluate("location.href"))


def op_click(page: Page, selector: str) -> str:
    x, y = _center(page, selector)
    # Real pointer events, as a person's click: the page sees mousedown/up/click in order.
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        page.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    time.sleep(0.05)
    page.wait_ready()
    return str(page.evaluate("location.href"))


def op_fill(page: Page, selector: str, value: str) -> str:
    ok = page.evaluate(
        f"(() => {{ const el = document.querySelector({_js(selector)}); if (!el) return false;"
        " el.focus(); if (el.select) el.select(); return true; })()"
    )
    if not ok:
        raise CdpError(f"no element matches {selector!r}")
    # Delete the selection first so an empty value clears the field too.
    page.call("Input.dispatchKeyEvent", type="keyDown", key="Delete", code="Delete", windowsVirtualKeyCode=46)
    page.call("Input.dispatchKeyEvent", type="keyUp", key="Delete", code="Delete", windowsVirtualKeyCode=46)
    if value:
        page.call("Input.insertText", text=value)
    return str(page.evaluate(f"document.querySelector({_js(selector)}).value"))


_KEYS = {"Enter": ("\r", 13), "Tab": ("\t", 9), "Escape": ("", 27), "Backspace": ("", 8)}


def op_press(page: Page, key: str) -> str:
    text, code = _KEYS.get(key, (key if len(key) == 1 else "", 0))
    page.call("Input.dispatchKeyEvent", type="keyDown", key=key, text=text, windowsVirtualKeyCode=code)
    page.call("Input.dispatchKeyEvent", type="keyUp", key=key, windowsVirtualKeyCode=code)
    time.sleep(0.05)
    page.wait_ready()
    return str(page.evaluate("location.href"))


def op_text(page: Page, selector: str = "body") -> str:
    t = page.evaluate(f"(() => {{ const el = document.querySelector({_js(selector)});"
                      " return el ? el.innerText : null; })()")
    if t is None:
        raise CdpError(f"no element matches {selector!r}")
    return str(t)


def op_url(page: Page) -> str:
    return str(page.evaluate("location.href"))


def op_screenshot(page: Page, path: str) -> str:
    r = page.call("Page.captureScreenshot", format="png")
    with open(path, "wb") as f:
        f.write(base64.b64decode(r["data"]))
    return path


def op_accessibility_tree(page: Page) -> str:
    nodes = page.call("Accessibility.getFullAXTree")["nodes"]
    by_id = {n["nodeId"]: n for n in nodes}
    lines: list[str] = []

    def walk(node_id: str, depth: int, parent_name: str = "") -> None:
        n = by_id.get(node_id)
        if n is None:
            return
        role = n.get("role", {}).get("value", "")
        name = str(n.get("name", {}).get("value", ""))
        shown = not n.get("ignored") and role not in ("none", "generic", "InlineTextBox", "LineBreak")
        # Text that only repeats its parent's name (a button's label) or nothing, and unnamed
        # wrappers, add lines without adding information for an agent.
        if role == "StaticText" and (not name.strip() or name == parent_name):
            shown = False
        if role in ("LabelText", "paragraph", "form", "row", "cell") and not name:
            shown = False
        if shown:
            props = {p["name"]: p.get("value", {}).get("value") for p in n.get("properties", [])}
            extra = "".join(f" {k}={props[k]}" for k in ("focused", "checked", "disabled") if props.get(k))
            value = n.get("value", {}).get("value")
            val = f" value={json.dumps(value)}" if value not in (None, "") else ""
            lines.append(f"{'  ' * depth}{role} {json.dumps(name)}{val}{extra}")
        for child in n.get("childIds", []):
            walk(child, depth + 1 if shown else depth, name if shown else parent_name)

    roots = [n["nodeId"] for n in nodes if "parentId" not in n]
    for r in roots:
        walk(r, 0)
    return "\n".join(lines)


OPS = {
    "goto": op_goto, "click": op_click, "fill": op_fill, "press": op_press, "text": op_text,
    "url": op_url, "screenshot": op_screenshot, "accessibility_tree": op_accessibility_tree,
}


def main() -> int:
    req = json.loads(sys.argv[1])
    op = req.pop("op")
    page = None
    try:
        if op == "ready":
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/json/version", timeout=TIMEOUT) as r:
                out: Any = json.load(r).get("Browser")
        else:
            page = first_page()
            out = OPS[op](page, **req)
        print(json.dumps({"ok": True, "result": out}))
        return 0
    except Exception as e:
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return 1
    finally:
        if page is not None:
            page.close()


if __name__ == "__main__":
    sys.exit(main())
