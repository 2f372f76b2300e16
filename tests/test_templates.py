"""Workspace templates (bunshinfork.templates) and the task environments on them (bunshinrl.envs).

The unmarked fork tests are the ones CI must always run: one per template, each driving the
source and two clones differently and checking that they diverge only where driven.

BUNSHIN_TEST_SCREENSHOTS=DIR makes the desktop tests write their screenshots there (README's
docs/x11-desktop.png and docs/wayland-desktop.png come from the slow ones).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image, ImageChops

from bunshinfork import BunshinError, Workspace
from bunshinfork.templates import (
    CATALOGUE,
    GuiWorkspace,
    TemplateError,
    WaylandWorkspace,
    WebShopWorkspace,
    Window,
    _wtype,
    attach_desktop,
    gui_workspace,
    wayland_workspace,
    webshop_workspace,
)
from bunshinrl.envs import gui as gui_env
from bunshinrl.envs import wayland as wayland_env
from bunshinrl.envs import webshop as shop_env

NEEDED = ("Xvfb", "openbox", "xterm", "mousepad", "xdotool", "xclip", "wmctrl", "import", "chromium",
          "x11vnc", "websockify", "sway", "swaymsg", "foot", "grim", "wtype", "wl-copy", "wl-paste", "wayvnc",
          "Xwayland")
missing = [b for b in NEEDED if shutil.which(b) is None]
if not shutil.which("initdb") and not any(
        shutil.which("initdb", path=f"/usr/lib/postgresql/{v}/bin") for v in (15, 16, 17)):
    missing.append("postgresql")
pytestmark = pytest.mark.skipif(bool(missing), reason=f"scripts/setup.sh installs {missing}")


def _destroy_all(*objs: object) -> None:
    for o in objs:
        if isinstance(o, (GuiWorkspace, WaylandWorkspace, WebShopWorkspace, Workspace)):
            with contextlib.suppress(BunshinError):
                o.destroy()


@contextlib.contextmanager
def family(source: GuiWorkspace | WaylandWorkspace | WebShopWorkspace, count: int,
           memory: str = "copy") -> Iterator[list]:
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


def keep_screenshot(name: str, img: Image.Image) -> None:
    if out := os.environ.get("BUNSHIN_TEST_SCREENSHOTS"):
        Path(out).mkdir(parents=True, exist_ok=True)
        img.save(Path(out) / f"{name}.png")


def wait_for(probe, what: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.1)


def assert_live_view(m: GuiWorkspace | WaylandWorkspace) -> None:
    """noVNC's page through the host relay, and the VNC server's banner inside the workspace."""
    import urllib.request

    with urllib.request.urlopen(m.forward_live_view(), timeout=10) as r:
        assert b"noVNC" in r.read()
    rfb = m.ws.commands.run(
        "python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', 5900)); "
        "print(s.recv(12).decode())\"", timeout=30)
    assert rfb.stdout.startswith("RFB 003."), rfb
    m.close()


def host_pids(ws: Workspace) -> set[int]:
    """The host pids of every process in the workspace's pid namespace."""
    ns = os.readlink(f"/proc/{ws.init_pid}/ns/pid")
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(d / "ns/pid") == ns:
                    pids.add(int(d.name))
    return pids


# ---- GUI ----


def editor_watches(m: GuiWorkspace) -> list[str]:
    """The inotify watches mousepad holds (fdinfo's "inotify wd:" lines, the inode and mask)."""
    out = []
    for pid in m.ws._cgroup().pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "mousepad":
                continue
            for fd in os.listdir(f"/proc/{pid}/fdinfo"):
                for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                    if line.startswith("inotify wd:"):
                        out.append(" ".join(f for f in line.split() if f.startswith(("ino:", "mask:"))))
        except OSError:
            continue
    return sorted(out)


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
        # Mousepad watches the file it edits (its default): the watches fork with it.
        watched = editor_watches(gui)
        assert watched, "mousepad holds no inotify watch"

        with family(gui, 2) as (a, b):
            members = {"source": gui, "a": a, "b": b}
            # Each clone holds at least the watches the source held before the fork. Not equality
            # with any member's count now: mousepad adds watches of its own accord, before the
            # freeze and after it, in the source and in each clone (a CI run saw the source at 4
            # and the clones at 2, the source's 2 new ones made after the fork).
            now = {n: editor_watches(m) for n, m in members.items()}
            assert all(len(w) >= len(watched) for w in now.values()), (watched, now)
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
            keep_screenshot("x11-desktop", shots[1])

            # The live view was forked too: each clone serves its own desktop over noVNC.
            for m in clones:
                assert_live_view(m)
    finally:
        gui.destroy()


# ---- Wayland desktop ----


def test_wayland_fork_clones_have_their_own_compositor() -> None:
    t0 = time.monotonic()
    desk = wayland_workspace(apps=("terminal", "editor"))
    try:
        # The desktop is up, and the screenshot shows its windows: sway tiles the terminal
        # (dark) and the editor (white page) side by side.
        wins = {w.app_id: w for w in desk.windows()}
        assert set(wins) == {"foot", "mousepad"}, wins
        assert "Mousepad" in wins["mousepad"].title and wins["foot"].title == "Terminal"
        term, editor = wins["foot"], desk.activate("Mousepad")
        shot = png(desk.screenshot())
        assert shot.size == (1280, 800)
        assert max(shot.getpixel((term.x + term.width // 2, term.y + term.height // 2))) < 60
        assert min(shot.getpixel((editor.x + editor.width // 2, editor.y + editor.height // 2))) > 200
        assert not inside(frame_box(term), frame_box(editor)) and term.x + term.width <= editor.x

        # Typing into the editor and saving writes the file.
        notes = WaylandWorkspace.editor_file
        desk.type("shared line")
        desk.key("ctrl+s")
        wait_for(lambda: desk.ws.files.read(notes) == "shared line", lambda: desk.ws.files.read(notes))
        desk.clipboard_set("clipboard of the source")
        source_spot = (editor.x + 60, editor.y + 500)
        desk.move(*source_spot)
        procs = desk.ws.memory().processes
        assert procs >= 7  # init, sway, swaybg, wayvnc, foot (+ its shell), mousepad, wl-copy
        before = png(desk.screenshot())

        with family(desk, 2) as (a, b):
            clones = {"a": a, "b": b}
            members = {"source": desk, **clones}
            # The compositor's state is forked with it: the same windows under the same ids,
            # the same focus, the source's clipboard.
            trees = {n: sorted((w.id, w.app_id, w.focused) for w in m.windows()) for n, m in members.items()}
            assert trees["a"] == trees["source"] == trees["b"], trees
            assert a.clipboard_get() == b.clipboard_get() == "clipboard of the source"

            # Each clone gets its own input: different text, pointer position and clipboard.
            spots = {"a": (editor.x + 200, editor.y + 500), "b": (editor.x + 400, editor.y + 560)}
            for n, m in clones.items():
                m.type(f"\nwritten in {n}")
                m.move(*spots[n])
                m.clipboard_set(f"clipboard of {n}")
                m.key("ctrl+s")
            for n, m in clones.items():
                assert m.cursor() == spots[n]
                assert m.clipboard_get() == f"clipboard of {n}"
                assert m.active_window() == editor.title
            assert desk.clipboard_get() == "clipboard of the source"

            def saved() -> bool:
                return all(m.ws.files.read(notes) == f"shared line\nwritten in {n}" for n, m in clones.items())

            wait_for(saved, lambda: {n: m.ws.files.read(notes) for n, m in members.items()})
            shots = {n: png(m.screenshot()) for n, m in members.items()}
            for n, img in shots.items():
                keep_screenshot(f"wayland-fork-{n}", img)
        # The source was not touched: its file, and its whole screen to the pixel.
        assert desk.ws.files.read(notes) == "shared line"
        assert ImageChops.difference(before, shots["source"]).getbbox() is None
        box = frame_box(editor)
        for x, y in (("source", "a"), ("source", "b"), ("a", "b")):
            diff = ImageChops.difference(shots[x], shots[y]).getbbox()
            # They differ, in the editor (its text and the pointer over it) and only there ...
            assert diff is not None, f"{x} and {y} show the same screen"
            assert inside(diff, box), f"{x} vs {y} differ at {diff}, outside the editor {box}"
            # ... and everything else (terminal, title bars, borders) is pixel-identical.
            assert ImageChops.difference(masked(shots[x], box), masked(shots[y], box)).getbbox() is None
        # Apart from the pointers, what differs is the text: the typed line under the shared one
        # (and the caret, which moved down with it).
        pointers = [(x - 20, y - 20, x + 20, y + 20) for x, y in (source_spot, *spots.values())]
        for x, y in (("source", "a"), ("source", "b"), ("a", "b")):
            one, other = shots[x], shots[y]
            for p in pointers:
                one, other = masked(one, p), masked(other, p)
            text = ImageChops.difference(one, other).getbbox()
            assert text is not None and text[1] >= editor.y + 25 and text[3] <= editor.y + 70, (x, y, text)
        # Each clone draws its own pointer, where that clone put it.
        for n in clones:
            x, y = spots[n]
            near = (x - 16, y - 16, x + 16, y + 16)
            assert ImageChops.difference(shots[n].crop(near), shots["source"].crop(near)).getbbox() is not None, n
        assert time.monotonic() - t0 < 120
    finally:
        pids = host_pids(desk.ws)
        desk.destroy()
    # destroy leaves nothing behind: no process of the desktop survives (the leak check
    # covers mounts, cgroups, state and init processes).
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), "desktop processes outlived destroy()", 10)


def test_wtype_keycodes_look_like_a_us_keyboard() -> None:
    """Pure planning, no workspace: which keycode each keysym of a wtype call gets."""

    def codes(argv: list[str]) -> dict[str, int]:
        # wtype numbers keysyms from 1 in order of first use; the plan puts them first.
        keys = [argv[i + 1] for i in range(1, len(argv), 2) if argv[i] == "-p"]
        return {k: i + 1 for i, k in enumerate(keys)}

    (call,) = _wtype.argv(_wtype.text_steps("<title>a\tb\n"), 8)
    plan = codes(call)
    assert plan["Return"] == 28 and plan["Tab"] == 15
    chars = [plan[_wtype.char_keysym(c)] for c in "<title>ab"]
    assert set(chars) <= set(_wtype.CHARACTER_CODES) and 14 not in chars
    assert max(plan.values()) > max(plan[k] for k in ("Return", "Tab", *map(_wtype.char_keysym, "<title>ab")))
    (combo,) = _wtype.argv(_wtype.combo_steps("ctrl+s ctrl+End BackSpace"))
    # After the plan, the steps themselves, in order.
    assert combo[combo.index("-M"):] == ["-M", "ctrl", "-k", "U0073", "-m", "ctrl", "-M", "ctrl", "-k", "End",
                                         "-m", "ctrl", "-k", "BackSpace"]
    plan = codes(combo)
    assert plan["End"] == 107 and plan["BackSpace"] == 14 and plan["U0073"] == 2 and max(plan.values()) == 108
    # More distinct characters than character keys: more than one call, none over the limit.
    calls = _wtype.argv(_wtype.text_steps("".join(chr(0x100 + i) for i in range(100))))
    assert len(calls) == 3 and all(len(codes(c)) <= 54 for c in calls)
    with pytest.raises(TemplateError, match="modifier"):
        _wtype.combo_steps("hyper+x")
    with pytest.raises(TemplateError, match="control character"):
        _wtype.text_steps("\x07")


@pytest.mark.slow
def test_wayland_desktop_with_browser_xwayland_and_live_view_forks_with_ksm() -> None:
    desk = wayland_workspace(live_view=True)
    try:
        assert {w.app_id for w in desk.windows()} == {"foot", "mousepad", "chromium-browser"}
        # An X-only client runs through Xwayland, managed by sway beside the Wayland ones.
        desk.activate("Mousepad")
        desk.type("Typed before the fork:\neach clone has its own\ncompositor and clients.")
        xterm = desk.launch(command="xterm -fa 'DejaVu Sans Mono' -title XTerm", wait_title="XTerm")
        assert xterm is not None and xterm.app_id == "xterm" and xterm.focused and xterm.y > 0
        with family(desk, 2, memory="ksm") as clones:
            members = [desk, *clones]
            for i, m in enumerate(members):
                # Xwayland's state was forked too: each clone's xterm takes its own keystrokes.
                m.activate("XTerm")
                m.type(f"echo xterm of {i} > /tmp/xterm.txt\n")
                m.activate("Chromium")
                m.key("ctrl+l")
                colour = ["red", "green", "blue"][i]
                m.type(f"data:text/html,<title>page {i}</title><body style='background:{colour}'><h1>page {i}</h1>")
                m.key("Return")
            for i, m in enumerate(members):
                wait_for(lambda m=m, i=i: f"page {i}" in (m.find_window("Chromium") or xterm).title,
                         lambda m=m: [w.title for w in m.windows()], 30)
                wait_for(lambda m=m, i=i: m.ws.files.exists("/tmp/xterm.txt") and
                         m.ws.files.read("/tmp/xterm.txt") == f"xterm of {i}\n", f"xterm of {i}", 10)
            shots = [png(m.screenshot()) for m in members]
            browser = desk.find_window("Chromium")
            assert browser is not None
            # The page's background colour is each clone's own.
            cx, cy = browser.x + browser.width // 2, browser.y + browser.height - 40
            colours = [s.getpixel((cx, cy)) for s in shots]
            assert len(set(colours)) == 3, colours
            keep_screenshot("wayland-desktop", shots[1])

            # The live view was forked too: each clone serves its own desktop over noVNC.
            for m in clones:
                assert_live_view(m)
    finally:
        desk.destroy()


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
    assert "argument x of click must be an integer" in (click.check({"x": "1", "y": 2}) or "")
    with pytest.raises(ValueError, match="single line"):
        gui_env.make_env(target="a\nb")
    assert set(CATALOGUE) >= set(shop_env.DEFAULT_ITEMS)
    with pytest.raises(TemplateError, match="unknown app"):
        gui_workspace(apps=("spreadsheet",))
    # The same task and tools on the Wayland desktop, told apart by name and cache key.
    w = wayland_env.make_env(target="x")
    assert set(w.agent_tools) == set(g.agent_tools) and w.id == "wayland-edit-notes" and g.id == "gui-edit-notes"
    assert w.fingerprint != g.fingerprint and WaylandWorkspace.editor_file in w.prompt
    assert gui_env.make_env(target="x", desktop="wayland").fingerprint == w.fingerprint
    with pytest.raises(ValueError, match="unknown desktop"):
        gui_env.make_env(desktop="mir")
    with pytest.raises(TemplateError, match="unknown app"):
        wayland_workspace(apps=("spreadsheet",))


@pytest.mark.slow
@pytest.mark.parametrize("desktop", gui_env.DESKTOPS)
def test_gui_env_reward_after_scripted_rollouts(desktop: str) -> None:
    env = gui_env.make_env(target="Ship it on Friday", desktop=desktop)
    ws = env.create()
    try:
        assert isinstance(attach_desktop(ws), GuiWorkspace if desktop == "x11" else WaylandWorkspace)
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
