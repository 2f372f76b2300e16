"""Fork cost of the real agent workspaces (bunshinfork.templates), per template and memory engine.

python benchmarks/workspace_templates.py --out DIR [--templates gui,wayland,webshop] [--engines copy,ksm] [--clones 8]

For each template and engine a fresh source is brought up and driven a little (text typed
into the editor; an item put into the cart), then forked into --clones clones at once.
gui is the X11 desktop (Xvfb, openbox, xterm, mousepad, Chromium), wayland the Wayland one
(sway, swaybg, wayvnc, foot, mousepad, Chromium on Ozone/Wayland).
Written to DIR/workspace_templates.json, one row per template and engine:
  processes             processes in the source workspace
  fork_ok               clones that came up AND answer a template tool (window list / page text;
                        on a desktop, a keystroke typed into the clone's editor shows in its title)
  source_bytes          the source's summed PSS before the fork
  total_bytes_8_clones  PSS summed over the source and all its clones after the fork (for ksm,
                        once merging has settled or --settle-timeout passed)
  clones_bytes          the same sum over the clones only
  fork_seconds          snapshot + parallel restores, wall clock; with snapshot/restore/frozen parts
PSS splits each shared page among its sharers, so the sums add up to the memory really used by
the family (shared file pages of /usr included, once).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bunshinfork import BunshinError, Workspace
from bunshinfork.memory import ksm
from bunshinfork.templates import (
    GuiWorkspace,
    WaylandWorkspace,
    WebShopWorkspace,
    gui_workspace,
    wayland_workspace,
    webshop_workspace,
)

Template = GuiWorkspace | WaylandWorkspace | WebShopWorkspace


def used_bytes() -> int:
    m = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        m[k] = int(v.split()[0]) * 1024
    return m["MemTotal"] - m["MemAvailable"]


def make(template: str) -> Template:
    if template in ("gui", "wayland"):
        g = gui_workspace() if template == "gui" else wayland_workspace()
        g.activate("Mousepad")
        g.type("benchmark source text")
        g.key("ctrl+s")
        return g
    if template == "webshop":
        s = webshop_workspace()
        s.browser.goto(s.url + "/search?q=tea")
        s.browser.click("button[aria-label='Add Green Tea (100 g) to cart']")
        return s
    raise SystemExit(f"unknown template {template!r}; use gui, wayland or webshop")


def works(t: Template) -> bool:
    """The clone's environment answers, not just its init: a desktop takes a keystroke into
    its editor (the unsaved-changes mark appears in the title), the shop shows the cart."""
    try:
        if isinstance(t, (GuiWorkspace, WaylandWorkspace)):
            t.activate("Mousepad")
            t.type("!")
            for _ in range(50):
                w = t.find_window("Mousepad")
                if w is not None and w.title.startswith("*"):
                    return True
                time.sleep(0.1)
            return False
        return "Green Tea" in t.browser.text("main") or "Cart (1)" in t.browser.text("header")
    except BunshinError:
        return False


def wrap(src: Template, ws: Workspace) -> Template:
    if isinstance(src, WebShopWorkspace):
        return WebShopWorkspace(ws)
    return type(src)(ws, src.config)  # type: ignore[arg-type]


def run(template: str, engine: str, clones: int, settle_timeout: float) -> dict[str, Any]:
    t_up = time.monotonic()
    src = make(template)
    up_seconds = time.monotonic() - t_up
    try:
        time.sleep(1.0)  # let start-up page faults and caches settle before measuring
        mem = src.ws.memory()
        before_used = used_bytes()
        t0 = time.monotonic()
        snap = src.ws.snapshot(engine)
        t_snap = time.monotonic()
        out = snap.fork(clones)
        t_fork = time.monotonic()
        timing = snap.timing
        image_bytes = snap.image_bytes()
        snap.release()
        ok = [c for c in out if isinstance(c, Workspace)]
        errors = [str(e)[:400] for e in out if isinstance(e, Exception)]
        wrapped = [wrap(src, c) for c in ok]
        settle = None
        if engine == "ksm" and ksm.available():
            ts = time.monotonic()
            ksm.tuner.wait_settled(timeout=settle_timeout)
            settle = time.monotonic() - ts
        clones_pss = sum(c.memory().pss for c in ok)
        src_after = src.ws.memory().pss
        used_delta = used_bytes() - before_used
        working = sum(works(w) for w in wrapped)  # after measuring: typing un-merges pages
        row = {
            "template": template, "engine": engine, "clones": clones,
            "processes": mem.processes, "fork_ok": working, "clones_restored": len(ok), "errors": errors,
            "source_bytes": mem.pss, "source_rss_bytes": mem.rss,
            "total_bytes_8_clones": src_after + clones_pss, "clones_bytes": clones_pss,
            "system_used_delta_bytes": used_delta,
            "fork_seconds": t_fork - t0, "snapshot_seconds": t_snap - t0, "restore_seconds": t_fork - t_snap,
            "frozen_seconds": timing.frozen_seconds, "image_bytes": image_bytes,
            "ksm_settle_seconds": settle, "setup_seconds": up_seconds,
        }
        for c in ok:
            c.destroy()
        return row
    finally:
        src.destroy()
        gc.collect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--templates", default="gui,wayland,webshop")
    ap.add_argument("--engines", default="copy,ksm")
    ap.add_argument("--clones", type=int, default=8)
    ap.add_argument("--settle-timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for template in [t for t in args.templates.split(",") if t]:
        for engine in [e for e in args.engines.split(",") if e]:
            row = run(template, engine, args.clones, args.settle_timeout)
            rows.append(row)
            mib = row["source_bytes"] / 2**20
            print(f"[{template:>7} {engine:>4}] {row['processes']:>3} processes, source {mib:6.0f} MiB, "
                  f"{row['fork_ok']}/{args.clones} clones ok in {row['fork_seconds']:5.2f} s (frozen "
                  f"{row['frozen_seconds']:.2f} s), source+clones {row['total_bytes_8_clones'] / 2**20:6.0f} MiB"
                  + (f", ksm settled in {row['ksm_settle_seconds']:.0f} s" if row["ksm_settle_seconds"] else ""),
                  flush=True)
    result = {
        "clones": args.clones,
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "rows": rows,
    }
    (out / "workspace_templates.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'workspace_templates.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
