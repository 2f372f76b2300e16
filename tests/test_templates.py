"""Workspace templates (bunshinfork.templates) and the task environments on them (bunshinrl.envs).

The two unmarked fork tests are the ones CI must always run: one per template, each driving
the source and two clones differently and checking that they diverge only where driven.
"""

from __future__ import annotations

import base64
import contextlib
import io
import shutil
import time
from collections.abc import Iterator

import pytest
from PIL import Image, ImageChops

from bunshinfork import BunshinError, Workspace
from bunshinfork.templates import (
    CATALOGUE,
    GuiWorkspace,
    TemplateError,
    WebShopWorkspace,
    Window,
    gui_workspace,
    webshop_workspace,
)
from bunshinrl.envs import gui as gui_env
from bunshinrl.envs import webshop as shop_env

NEEDED = ("Xvfb", "openbox", "xterm", "mousepad", "xdotool", "xclip", "wmctrl", "import", "chromium",
          "x11vnc", "websockify")
missing = [b for b in NEEDED if shutil.which(b) is None]
if not shutil.which("initdb") and not any(
        shutil.which("initdb", path=f"/usr/lib/postgresql/{v}/bin") for v in (15, 16, 17)):
    missing.append("postgresql")
pytestmark = pytest.mark.skipif(bool(missing), reason=f"scripts/setup.sh installs {missing}")


def _destroy_all(*objs: object) -> None:
    for o in objs:
        if isinstance(o, (GuiWorkspace, WebShopWorkspace, Workspace)):
            with contextlib.suppress(BunshinError):
                o.destroy()


@contextlib.contextmanager
def family(source: GuiWorkspace | WebShopWorkspace, count: int, memory: str = "copy") -> Iterator[list]:
    clones = source.fork(count, memory=memory)
    try:
        failed = [c for c in clones if isinstance(c, Exception)]
        assert not failed, f"fork failed: {failed[0]}"
        yield clones
    finally:
        _destroy_all(*clones)


def png(data: bytes) -> Image.Image:
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), "not a PNG"
    return Image.open(io.BytesIO(data)).convert("RGB")


def frame_box(w: Window, title_bar: int = 60) -> tuple[int, int, int, int]:
    """The window's client area plus its decoration above (left, top, right, bottom)."""
    return (max(w.x - 8, 0), max(w.y - title_bar, 0), w.x + w.width + 8, w.y + w.height + 8)


def masked(img: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
    out = img.copy()
    out.paste((255, 0, 255), box)
    return out


def inside(inner: tuple[int, int, int, int], outer: tuple[int, int, int, int]) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


# ---- GUI ----


def test_gui_fork_clones_have_their_own_display() -> None:
    t0 = time.monotonic()
    gui = gui_workspace(apps=("terminal", "editor"))
    try:
        names = {w.title for w in gui.windows()}
        assert any("Terminal" in n for n in names) and any("Mousepad" in n for n in names), names
        editor = gui.activate("Mousepad")
        gui.type("shared line")
        gui.clipboard_set("clipboard of the source")
        procs = gui.ws.memory().processes
        assert procs >= 5  # init, Xvfb, openbox, xterm (+ its shell), mousepad, xclip

        with family(gui, 2) as (a, b):
            members = {"source": gui, "a": a, "b": b}
            # The X server's state is forked with it: the same windows under the same ids.
            ids = {n: sorted(w.id for w in m.windows()) for n, m in members.items()}
            assert ids["a"] == ids["source"] == ids["b"], ids

            # Each display gets its own input: different text, pointer position and clipboard.
            for i, (n, m) in enumerate(members.items()):
                m.activate("Mousepad")
                m.type(f"\nwritten in {n}")
                m.move(100 + 50 * i, 700)
                if n != "source":
                    m.clipboard_set(f"clipboard of {n}")
                m.key("ctrl+s")
            for n, m in members.items():
                assert m.cursor() == (100 + 50 * list(members).index(n), 700)
                assert m.clipboard_get() == f"clipboard of {'the source' if n == 'source' else n}"

            def saved(m: GuiWorkspace, n: str) -> bool:
                return m.ws.files.read("/root/Desktop/notes.txt") == f"shared line\nwritten in {n}"

            deadline = time.monotonic() + 20
            while not all(saved(m, n) for n, m in members.items()):
                assert time.monotonic() < deadline, {n: m.ws.files.read("/root/Desktop/notes.txt")
                                                     for n, m in members.items()}
                time.sleep(0.1)

            shots = {n: png(m.screenshot()) for n, m in members.items()}
        box = frame_box(editor)
        assert {s.size for s in shots.values()} == {(1280, 800)}
        for x, y in (("source", "a"), ("source", "b"), ("a", "b")):
            diff = ImageChops.difference(shots[x], shots[y]).getbbox()
            # They differ, in the editor's text and only there ...
            assert diff is not None, f"{x} and {y} show the same screen"
            assert inside(diff, box), f"{x} vs {y} differ at {diff}, outside the editor {box}"
            # ... and everything else (desktop, terminal, window frames) is pixel-identical.
            assert ImageChops.difference(masked(shots[x], box), masked(shots[y], box)).getbbox() is None
        assert time.monotonic() - t0 < 120
    finally:
        gui.destroy()


@pytest.mark.slow
def test_gui_desktop_with_browser_and_live_view_forks_with_ksm() -> None:
    gui = gui_workspace(live_view=True)
    fwd_urls: list[str] = []
    try:
        titles = [w.title for w in gui.windows()]
        assert any("Chromium" in t for t in titles), titles
        with family(gui, 2, memory="ksm") as clones:
            for i, m in enumerate([gui, *clones]):
                m.activate("Chromium")
                m.key("ctrl+l")
                colour = ["red", "green", "blue"][i]
                m.type(f"data:text/html,<title>page {i}</title><body style='background:{colour}'><h1>page {i}</h1>")
                m.key("Return")
            for i, m in enumerate([gui, *clones]):
                deadline = time.monotonic() + 30
                while f"page {i}" not in (m.find_window("Chromium") or Window("", 0, 0, 0, 0, 0, 0, "")).title:
                    assert time.monotonic() < deadline, [w.title for w in m.windows()]
                    time.sleep(0.2)
            shots = [png(m.screenshot()) for m in (gui, *clones)]
            browser = gui.find_window("Chromium")
            assert browser is not None
            box = frame_box(browser, title_bar=0)
            for x, y in ((0, 1), (0, 2), (1, 2)):
                d = ImageChops.difference(shots[x], shots[y]).getbbox()
                assert d is not None and inside(d, box), (x, y, d, box)
            # The page's background colour is each clone's own.
            cx, cy = browser.x + browser.width // 2, browser.y + browser.height - 40
            colours = [s.getpixel((cx, cy)) for s in shots]
            assert len(set(colours)) == 3, colours

            # The live view was forked too: each clone serves its own desktop over noVNC.
            for m in clones:
                url = m.forward_live_view()
                fwd_urls.append(url)
                import urllib.request

                with urllib.request.urlopen(url, timeout=10) as r:
                    assert b"noVNC" in r.read()
                rfb = m.ws.commands.run(
                    "python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', 5900)); "
                    "print(s.recv(12).decode())\"", timeout=30)
                assert rfb.stdout.startswith("RFB 003."), rfb
                m.close()
    finally:
        gui.destroy()


# ---- web shop ----


def test_webshop_fork_isolates_cart_and_orders() -> None:
    shop = webshop_workspace()
    try:
        b = shop.browser
        assert "Catalogue" in b.text("h1")
        b.fill("#search", "mug")
        assert b.press("Enter").endswith("/search?q=mug")
        b.click("button[aria-label='Add Blue Ceramic Mug to cart']")
        assert shop.state() == {"cart": {"MUG-BLU": 1}, "orders": {}}
        tree = b.accessibility_tree()
        assert 'button "Place order"' in tree and 'textbox "Name"' in tree, tree
        before = _browser_connections(shop)
        assert before, "the browser holds no keep-alive connection to the shop"
        procs = shop.ws.memory().processes
        assert procs >= 10  # postgres and its workers, the shop, chromium's processes

        with family(shop, 2) as (a, c):
            # The browser's open connections to the server were carried into each clone.
            for m in (a, c):
                assert before <= _browser_connections(m), (before, _browser_connections(m))
            # Clone a checks out; clone c adds tea and does not; the source does nothing.
            a.browser.goto(a.url + "/cart")
            a.browser.fill("#ship-name", "Clone A")
            a.browser.fill("#ship-address", "1 Fork Lane")
            assert a.browser.click("#place-order").endswith("/orders/1")
            assert "Clone A" in a.browser.text("main")
            c.browser.goto(c.url + "/search?q=green tea")
            c.browser.click("button[aria-label='Add Green Tea (100 g) to cart']")

            # Through SQL ...
            assert a.state() == {"cart": {}, "orders": {"1": {"MUG-BLU": 1}}}
            assert c.state() == {"cart": {"MUG-BLU": 1, "TEA-GRN": 1}, "orders": {}}
            assert shop.state() == {"cart": {"MUG-BLU": 1}, "orders": {}}
            assert a.sql("SELECT stock FROM products WHERE sku = 'MUG-BLU'") == [["39"]]
            assert shop.sql("SELECT stock FROM products WHERE sku = 'MUG-BLU'") == [["40"]]
            # ... and through each one's own browser.
            for m, orders, cart in ((a, "Order #1", "empty"), (c, "not placed", "Green Tea"),
                                    (shop, "not placed", "Blue Ceramic Mug")):
                m.browser.goto(m.url + "/orders")
                assert orders in m.browser.text("main")
                m.browser.goto(m.url + "/cart")
                assert cart in m.browser.text("main")
            assert "Green Tea" not in shop.browser.text("main")
            shot = png(c.browser.screenshot())
            assert shot.size[0] >= 800
    finally:
        shop.destroy()


def _browser_connections(shop: WebShopWorkspace) -> set[str]:
    """chromium's established connections to the shop, as local ports."""
    r = shop.ws.commands.run("ss -tnpH state established '( dport = :8080 )'", timeout=30)
    return {line.split()[2] for line in r.stdout.splitlines() if "chromium" in line}


# ---- task environments ----


def test_env_factories_validate_and_describe_their_tools() -> None:
    env = shop_env.make_env(items={"TEA-BLK": 3})
    assert "3 \u00d7 Black Tea (100 g)" in env.prompt
    assert set(env.tools) >= {"goto", "click", "fill", "text", "accessibility_tree", "screenshot"}
    assert all(t.description for t in env.agent_tools.values())
    # One tool shape: an OpenAI function schema from the function's signature, plus the callable.
    fill = env.agent_tools["fill"].schema()["function"]
    assert fill["parameters"]["required"] == ["selector", "value"]
    assert env.agent_tools["text"].schema()["function"]["parameters"]["required"] == []
    assert not env.agent_tools["screenshot"].deterministic
    with pytest.raises(ValueError, match="unknown SKUs"):
        shop_env.make_env(items={"NOPE": 1})
    assert shop_env.make_env().fingerprint != env.fingerprint
    g = gui_env.make_env(target="x")
    assert set(g.tools) >= {"screenshot", "click", "type_text", "key", "scroll", "clipboard_get", "list_windows"}
    click = g.agent_tools["click"]
    assert click.schema()["function"]["parameters"]["properties"]["x"] == {"type": "integer"}
    assert "x must be an integer" in (click.check({"x": "1", "y": 2}) or "")
    with pytest.raises(ValueError, match="single line"):
        gui_env.make_env(target="a\nb")
    assert set(CATALOGUE) >= set(shop_env.DEFAULT_ITEMS)
    with pytest.raises(TemplateError, match="unknown app"):
        gui_workspace(apps=("spreadsheet",))


@pytest.mark.slow
def test_gui_env_reward_after_scripted_rollouts() -> None:
    env = gui_env.make_env(target="Ship it on Friday")
    ws = env.create()
    try:
        assert env.reward(ws) == 0.0
        clones = ws.fork(2, memory="copy")
        try:
            good, sloppy = clones
            assert isinstance(good, Workspace) and isinstance(sloppy, Workspace)
            shot = env.call(good, "screenshot")
            assert shot.startswith("data:image/png;base64,") and len(base64.b64decode(shot[22:])) > 1000
            assert "Mousepad" in env.call(good, "list_windows")
            assert env.call(good, "activate_window", title="Mousepad").startswith("activated")
            env.call(good, "key", combo="ctrl+a")
            env.call(good, "type_text", text="Ship it on Friday")
            env.call(good, "key", combo="ctrl+s")
            env.call(sloppy, "activate_window", title="Mousepad")
            env.call(sloppy, "key", combo="ctrl+End")
            env.call(sloppy, "type_text", text="\nShip it on Friday")
            env.call(sloppy, "key", combo="ctrl+s")
            assert env.call(good, "activate_window", title="no such window").startswith("ERROR")
            deadline = time.monotonic() + 20
            while (env.reward(good), env.reward(sloppy)) != (1.0, 0.5):
                assert time.monotonic() < deadline, (env.reward(good), env.reward(sloppy))
                time.sleep(0.2)
            assert env.reward(ws) == 0.0
        finally:
            _destroy_all(*clones)
    finally:
        ws.destroy()


@pytest.mark.slow
def test_webshop_env_reward_after_scripted_rollouts() -> None:
    env = shop_env.make_env(items={"MUG-BLU": 2, "TEA-GRN": 1}, name="Ada Lovelace", address="12 Analytical Row")
    ws = env.create()
    try:
        assert env.reward(ws) == 0.0
        clones = ws.fork(3, memory="copy")
        try:
            good, cart_only, wrong = clones
            assert all(isinstance(c, Workspace) for c in clones)
            for c in (good, cart_only, wrong):
                env.call(c, "goto", url="/search?q=mug")
                env.call(c, "click", selector="button[aria-label='Add Blue Ceramic Mug to cart']")
                env.call(c, "goto", url="/product/4")
                env.call(c, "click", selector="#add-to-cart")
            for c in (good, cart_only):
                page = env.call(c, "fill", selector="#qty-1", value="2")
                assert "'2'" in page
                env.call(c, "click", selector="#update-1")
            for c, who in ((good, "Ada Lovelace"), (wrong, "Charles Babbage")):
                env.call(c, "fill", selector="#ship-name", value=who)
                env.call(c, "fill", selector="#ship-address", value="12 Analytical Row")
                assert "Order #1" in env.call(c, "click", selector="#place-order")
            assert "ERROR" in env.call(good, "click", selector="#no-such-button")
            assert "Place order" in env.call(cart_only, "accessibility_tree")
            assert [env.reward(c) for c in (good, cart_only, wrong)] == [1.0, 0.25, 0.0]
            assert env.reward(ws) == 0.0
        finally:
            _destroy_all(*clones)
    finally:
        ws.destroy()
