"""Web-shop task (WebArena-like): buy the right items; the reward reads the orders in PostgreSQL.

    env = make_env(items={"MUG-BLU": 2, "TEA-GRN": 1})
    ws = env.create()                       # PostgreSQL + shop + headless Chromium, catalogue open
    env.call(ws, "goto", url="/search?q=mug")
    env.call(ws, "click", selector="button[aria-label='Add Blue Ceramic Mug to cart']")
    env.reward(ws)                          # 1.0 once one order holds exactly the items
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from typing import Any

from bunshinfork import BunshinError, Workspace
from bunshinfork.templates import CATALOGUE, Browser, WebShopWorkspace, start_webshop

from ..calls.task import Task
from ..calls.tools import Tool
from ._common import agent_tool, tools_of

DEFAULT_ITEMS = {"MUG-BLU": 2, "TEA-GRN": 1}
DEFAULT_NAME = "Ada Lovelace"
DEFAULT_ADDRESS = "12 Analytical Row, London"


def _shop(ws: Workspace) -> WebShopWorkspace:
    return WebShopWorkspace(ws)


def _page(browser: Browser, url: str) -> str:
    """What a navigation returns to the agent: where the browser landed and the page's main text."""
    return f"{url}\n\n{browser.text('main')}"


@agent_tool
def goto(ws: Workspace, url: str) -> str:
    """Open a URL; a path such as "/cart" is on the shop. Returns the page's text."""
    s = _shop(ws)
    if url.startswith("/"):
        url = s.url + url
    return _page(s.browser, s.browser.goto(url))


@agent_tool
def click(ws: Workspace, selector: str) -> str:
    """Click the first element matching a CSS selector. Returns the resulting page's text."""
    b = _shop(ws).browser
    return _page(b, b.click(str(selector)))


@agent_tool
def fill(ws: Workspace, selector: str, value: str) -> str:
    """Type a value into the input matching a CSS selector (its old value is replaced)."""
    return f"{selector} = {_shop(ws).browser.fill(str(selector), str(value))!r}"


@agent_tool
def press(ws: Workspace, key: str) -> str:
    """Press a key (Enter, Tab, Escape, Backspace) in the focused element."""
    b = _shop(ws).browser
    return _page(b, b.press(str(key)))


@agent_tool
def text(ws: Workspace, selector: str = "body") -> str:
    """The visible text of the element matching a CSS selector (default: the whole page)."""
    return _shop(ws).browser.text(str(selector))


@agent_tool
def accessibility_tree(ws: Workspace) -> str:
    """The page's accessibility tree: role "name" [value=...], indented by nesting."""
    b = _shop(ws).browser
    return f"{b.url()}\n{b.accessibility_tree()}"


@agent_tool
def screenshot(ws: Workspace) -> str:
    """The page as a PNG data URL."""
    return "data:image/png;base64," + base64.b64encode(_shop(ws).browser.screenshot()).decode()


@agent_tool
def current_url(ws: Workspace) -> str:
    """The address of the page the browser shows."""
    return _shop(ws).browser.url()


TOOLS: list[Tool] = tools_of((goto, click, fill, press, text, accessibility_tree, screenshot, current_url),
                             nondeterministic=("screenshot",))


def _orders(ws: Workspace) -> list[tuple[str, str, str, dict[str, int]]]:
    """(id, ship name, ship address, {sku: qty}) of every order, from the database."""
    s = _shop(ws)
    heads = s.sql("SELECT id, ship_name, ship_address FROM orders ORDER BY id")
    items: dict[str, dict[str, int]] = {}
    for oid, sku, q in s.sql("SELECT i.order_id, p.sku, i.qty FROM order_items i JOIN products p "
                             "ON p.id = i.product_id"):
        items.setdefault(oid, {})[sku] = int(q)
    return [(oid, name, addr, items.get(oid, {})) for oid, name, addr in heads]


def reward_for(items: dict[str, int], name: str, address: str) -> Callable[[Workspace], float]:
    """1.0: exactly one order, holding exactly `items`, shipped to `name`; 0.5: an order holds
    exactly `items` but the shipping name is wrong or other orders were placed too; 0.25: no
    such order, but the cart holds exactly `items`; 0.0 otherwise."""
    want = {k: int(v) for k, v in items.items()}

    def reward(ws: Workspace) -> float:
        try:
            orders = _orders(ws)
            matching = [o for o in orders if o[3] == want]
            if len(orders) == 1 and matching and matching[0][1].strip().lower() == name.strip().lower():
                return 1.0
            if matching:
                return 0.5
            return 0.25 if _shop(ws).state()["cart"] == want else 0.0
        except BunshinError:
            return 0.0

    return reward


def reward(ws: Workspace) -> float:
    """The reward of the default task (make_env() with no arguments)."""
    return reward_for(DEFAULT_ITEMS, DEFAULT_NAME, DEFAULT_ADDRESS)(ws)


def make_env(items: dict[str, int] | None = None, name: str = DEFAULT_NAME, address: str = DEFAULT_ADDRESS,
             **spec: Any) -> Task:
    """The shopping task: order `items` ({sku: quantity}) shipped to name/address."""
    items = dict(items or DEFAULT_ITEMS)
    unknown = sorted(set(items) - set(CATALOGUE))
    if unknown:
        raise ValueError(f"unknown SKUs {unknown}; the shop sells {sorted(CATALOGUE)}")
    wanted = ", ".join(f"{q} \u00d7 {CATALOGUE[sku][0]}" for sku, q in sorted(items.items()))

    def setup(ws: Workspace) -> None:
        start_webshop(ws)

    prompt = (f"You are logged in to the Bunshin Shop at {WebShopWorkspace.url}. Buy exactly: {wanted}. "
              f"Ship the order to {name}, {address}. Use the browser tools (CSS selectors) to search, add to "
              "the cart, set quantities and place the order.")
    fp = hashlib.sha256(repr(("webshop-v1", sorted(items.items()), name, address)).encode()).hexdigest()[:16]
    return Task("webshop-buy", prompt, TOOLS, setup, reward_for(items, name, address), spec=dict(spec),
                fingerprint=fp, family="webshop")
