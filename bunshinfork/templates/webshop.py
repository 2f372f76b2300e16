"""Web-shop workspace template (WebArena-like), everything in ONE workspace:

- PostgreSQL (Debian's) in /var/lib/postgresql/data, run as a `postgres` user of the workspace,
  listening on /run/postgresql and 127.0.0.1:5432 inside it;
- a small shop application (catalogue, search, cart, orders; stdlib + python3-psycopg2) on
  127.0.0.1:8080 inside the workspace;
- headless Chromium with its DevTools port on 127.0.0.1:9222 inside the workspace, driven by a
  stdlib CDP client that runs in the workspace too (the host cannot reach the workspace's
  loopback: network="none").

    with webshop_workspace() as shop:
        shop.browser.goto(shop.url + "/search?q=mug")
        shop.browser.click("button[aria-label='Add Blue Ceramic Mug to cart']")
        a, b = shop.fork(2)          # database, server, browser and their connections cloned
        a.sql("SELECT * FROM cart_items")
"""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path
from typing import Any

from ..errors import BunshinError
from ..workspace import Workspace
from ._common import TemplateError, add_user, fork_hint, run, start_daemon, wait_until
from ._shop_app import PRODUCTS

# sku -> (name, category, price in cents, initial stock), as the shop is seeded
CATALOGUE: dict[str, tuple[str, str, int, int]] = {p[0]: (p[1], p[2], p[3], p[4]) for p in PRODUCTS}

HERE = Path(__file__).resolve().parent


def _pg_bin() -> str:
    """Debian installs the server per major version; the workspace sees the host's /usr."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]))
    return str(found[-1].parent) if found else "/usr/lib/postgresql/15/bin"


PG_BIN = _pg_bin()
PG_DATA = "/var/lib/postgresql/data"
PG_SOCKET_DIR = "/run/postgresql"
PG_UID = 101
SHOP_DIR = "/opt/bunshin/shop"
SHOP_PORT = 8080
SHOP_URL = f"http://127.0.0.1:{SHOP_PORT}"
CDP_PORT = 9222
AGENT = f"{SHOP_DIR}/cdp_agent.py"
DSN = f"host={PG_SOCKET_DIR} dbname=shop user=postgres"
CHROMIUM = "/usr/lib/chromium/chromium"
# --no-sandbox: Chromium refuses to run as root with its sandbox ("Running as root without
# --no-sandbox is not supported"), and workspace commands run as root. The rest keep it from
# phoning out (the workspace has no network) and from putting first-run UI over the page.
# Crashpad stays on: --disable-crashpad-for-testing makes the network service crash in a loop
# ("FD ownership violation").
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-breakpad", "--password-store=basic", "--use-mock-keychain",
    "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={CDP_PORT}",
    "--user-data-dir=/root/.config/chromium-shop", "--window-size=1280,900",
)
# fsync/full_page_writes off: the database lives and dies with the workspace, and commits
# that wait for the disk would make every agent step slower. Small shared_buffers keep each
# clone cheap. huge_pages=off: a clone must not depend on the host's hugetlb pool.
PG_CONF = """
listen_addresses = '127.0.0.1'
unix_socket_directories = '/run/postgresql'
max_connections = 20
shared_buffers = 16MB
fsync = off
synchronous_commit = off
full_page_writes = off
huge_pages = off
dynamic_shared_memory_type = posix
logging_collector = off
log_min_messages = warning
"""


class BrowserError(TemplateError):
    """A browser tool call failed (no such element, navigation error, DevTools unreachable)."""


class Browser:
    """Tools over the workspace's headless Chromium. Each call runs the in-workspace CDP client."""

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws

    def _call(self, op: str, timeout: float = 60, **args: Any) -> Any:
        r = run(self.ws, ["python3", AGENT, json.dumps({"op": op, **args})], timeout=timeout, check=False)
        try:
            out = json.loads(r.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise BrowserError(f"browser {op} gave no answer (exit {r.exit_code}): {r.stderr[-1000:]}") from None
        if not out.get("ok"):
            raise BrowserError(f"browser {op} {args}: {out.get('error')}")
        return out["result"]

    def ready(self) -> str:
        return str(self._call("ready", timeout=10))

    def goto(self, url: str) -> str:
        """Navigate and wait for the load to finish; returns the final URL."""
        return str(self._call("goto", url=url))

    def click(self, selector: str) -> str:
        """Click the centre of the first element matching a CSS selector; returns the URL after."""
        return str(self._call("click", selector=selector))

    def fill(self, selector: str, value: str) -> str:
        """Replace an input's value by typing it; returns the value now in the field."""
        return str(self._call("fill", selector=selector, value=value))

    def press(self, key: str) -> str:
        """Press a key (Enter, Tab, Escape, Backspace or one character) in the focused element."""
        return str(self._call("press", key=key))

    def text(self, selector: str = "body") -> str:
        return str(self._call("text", selector=selector))

    def url(self) -> str:
        return str(self._call("url"))

    def screenshot(self) -> bytes:
        path = "/tmp/.bunshin-page.png"
        self._call("screenshot", path=path)
        data = self.ws.files.read(path, format="bytes")
        assert isinstance(data, bytearray)
        return bytes(data)

    def accessibility_tree(self) -> str:
        """The page's accessibility tree, one node a line: role "name" [value=...]."""
        return str(self._call("accessibility_tree"))


class WebShopWorkspace:
    """A Workspace running PostgreSQL, the shop and headless Chromium. attach() re-wraps a clone."""

    url = SHOP_URL

    def __init__(self, ws: Workspace) -> None:
        self.ws = ws
        self.browser = Browser(ws)

    @classmethod
    def attach(cls, ws: Workspace) -> WebShopWorkspace:
        if not ws.files.exists(AGENT):
            raise TemplateError(f"workspace {ws.id} was not made by webshop_workspace()")
        return cls(ws)

    @property
    def id(self) -> str:
        return self.ws.id

    def sql(self, query: str, timeout: float = 30) -> list[list[str]]:
        """Run SQL with psql in the workspace; rows as lists of strings (tab-separated, unaligned)."""
        r = run(self.ws, [f"{PG_BIN}/psql", "-h", PG_SOCKET_DIR, "-U", "postgres", "-d", "shop", "-X", "-q",
                          "-At", "-F", "\t", "-v", "ON_ERROR_STOP=1", "-c", query], timeout=timeout)
        return [line.split("\t") for line in r.stdout.splitlines()]

    def state(self) -> dict[str, Any]:
        """The cart and the orders as {'cart': {sku: qty}, 'orders': {id: {sku: qty}}}, from SQL."""
        cart = {sku: int(q) for sku, q in self.sql(
            "SELECT p.sku, c.qty FROM cart_items c JOIN products p ON p.id = c.product_id ORDER BY p.sku")}
        orders: dict[str, dict[str, int]] = {}
        for oid, sku, q in self.sql("SELECT o.id, p.sku, i.qty FROM orders o JOIN order_items i ON "
                                    "i.order_id = o.id JOIN products p ON p.id = i.product_id ORDER BY 1, 2"):
            orders.setdefault(oid, {})[sku] = int(q)
        return {"cart": cart, "orders": orders}

    # ---- bring-up ----

    def start(self) -> None:
        """Bring it up inside its workspace, once (the module's start function calls it)."""
        ws = self.ws
        ws.files.write(AGENT, (HERE / "_cdp_agent.py").read_text())
        start_shop(ws)
        start_daemon(ws, f"{CHROMIUM} {' '.join(CHROMIUM_FLAGS)} about:blank", "/tmp/chromium.log")
        try:
            wait_until(lambda: _quiet(self.browser.ready), "Chromium's DevTools port", 60)
        except TemplateError as e:
            tail = run(ws, "tail -c 2000 /tmp/chromium.log", check=False).stdout
            raise TemplateError(f"{e}; chromium logged:\n{tail}") from None
        self.browser.goto(self.url + "/")

    # ---- lifecycle ----

    def fork(self, count: int = 1, memory: str = "auto") -> list[WebShopWorkspace | Exception]:
        return [fork_hint(c) if isinstance(c, Exception) else WebShopWorkspace(c)
                for c in self.ws.fork(count, memory)]

    def destroy(self) -> None:
        self.ws.destroy()

    def __enter__(self) -> WebShopWorkspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"<WebShopWorkspace {self.ws.id} {self.url}>"



def start_shop(ws: Workspace) -> str:
    """PostgreSQL and the shop application, up and answering /health (which reads the database)
    inside `ws`; the shop's URL there. WebShopWorkspace.start() adds the browser on top."""
    ws.files.write(f"{SHOP_DIR}/shop_app.py", (HERE / "_shop_app.py").read_text())
    # PostgreSQL refuses to run as root; the generated /etc has no account for it.
    add_user(ws, "postgres", PG_UID, "/var/lib/postgresql")
    run(ws, f"mkdir -p {PG_DATA} {PG_SOCKET_DIR} && chown -R {PG_UID}:{PG_UID} /var/lib/postgresql "
            f"{PG_SOCKET_DIR} && chmod 700 {PG_DATA}")
    as_pg = f"setpriv --reuid={PG_UID} --regid={PG_UID} --clear-groups"
    run(ws, f"{as_pg} {PG_BIN}/initdb -D {PG_DATA} -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 "
            "--no-instructions > /tmp/initdb.log 2>&1 || { cat /tmp/initdb.log; exit 1; }",
        cwd="/var/lib/postgresql", timeout=120)
    conf = str(ws.files.read(f"{PG_DATA}/postgresql.conf"))
    ws.files.write(f"{PG_DATA}/postgresql.conf", conf + PG_CONF)
    run(ws, f"{as_pg} {PG_BIN}/pg_ctl -D {PG_DATA} -l /tmp/postgresql.log -w -t 60 start "
            "> /dev/null || { cat /tmp/postgresql.log; exit 1; }", cwd="/var/lib/postgresql", timeout=90)
    run(ws, f"{PG_BIN}/createdb -h {PG_SOCKET_DIR} -U postgres shop")
    run(ws, ["python3", f"{SHOP_DIR}/shop_app.py", "--dsn", DSN, "--setup"])
    start_daemon(ws, f"python3 {SHOP_DIR}/shop_app.py --port {SHOP_PORT} --dsn {shlex.quote(DSN)}",
                 "/tmp/shop.log", cwd=SHOP_DIR)
    probe = f"python3 -c \"import urllib.request; urllib.request.urlopen('{SHOP_URL}/health', timeout=2)\""
    wait_until(lambda: run(ws, probe, check=False).ok, "the shop to answer", 30)
    return SHOP_URL


def _quiet(fn: Any) -> Any:
    with contextlib.suppress(TemplateError):
        return fn()
    return None


def start_webshop(ws: Workspace) -> WebShopWorkspace:
    """Bring the shop, its database and the browser up inside an existing workspace."""
    shop = WebShopWorkspace(ws)
    shop.start()
    return shop


def webshop_workspace(**spec: Any) -> WebShopWorkspace:
    """Create a workspace (WorkspaceSpec fields in `spec`) running the shop, its database and a
    headless browser that has the catalogue open."""
    ws = Workspace.create(**spec)
    try:
        return start_webshop(ws)
    except BaseException:
        with contextlib.suppress(BunshinError):
            ws.destroy()
        raise
