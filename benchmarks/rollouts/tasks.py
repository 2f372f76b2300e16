"""The task families of the benchmark, each with a verifier that reads the final workspace, and
check_family on a task before it meets the cache."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from agent_policy import coding_candidates, gui_candidates, office_candidates, shop_candidates, swe_candidates

from bunshinrl import Task, ToolCall, check_family_async
from bunshinrl.envs import coding, gui, office, swe, webshop

SHOP_ORDERS = ({"MUG-BLU": 2, "TEA-GRN": 1}, {"TEA-GRN": 1}, {"MUG-BLU": 1})
GUI_TARGETS = ("Meeting moved to Friday 10:00", "Ship it on Friday", "Lunch at noon in room 4")
FAMILIES = ("code", "shop", "gui", "swe", "office")
GUI_HELP = "/root/Desktop/help.html"
GUI_HELP_PAGE = ("<html><head><title>Editor help</title></head><body><h1>Editing notes</h1>"
                 "<p>Start the editor, select all (ctrl+a), type the new text and save with ctrl+s.</p>"
                 + "<p>" + "Notes are plain text files. " * 400 + "</p></body></html>")



# ---- tasks ----

def build_tasks(families: list[str], seed: int, code_tasks: int,
                settle: float = 0.0) -> tuple[list[Task], dict[str, Any]]:
    """The tasks of `families` at `seed` and their agents' candidates; settle: the desktop
    families' (gui, office) pause after each action, OSWorld's protocol (--settle; gui.make_env,
    office.make_env)."""
    tasks: list[Task] = []
    cands: dict[str, Any] = {}
    if "code" in families:
        for i in range(code_tasks):
            t = coding.make_env(seed * 100 + i)
            tasks.append(t)
            cands[t.id] = coding_candidates
    if "shop" in families:
        items = SHOP_ORDERS[seed % len(SHOP_ORDERS)]
        t = dataclasses.replace(webshop.make_env(items=items), id=f"shop-{seed}")
        tasks.append(t)
        cands[t.id] = shop_candidates(items, webshop.DEFAULT_NAME, webshop.DEFAULT_ADDRESS)
    if "gui" in families:
        # The agent starts the editor itself (an application start) or first reads the help page
        # in Chromium (a page load): tools that take real time, as OSWorld's do.
        target = GUI_TARGETS[seed % len(GUI_TARGETS)]
        t = dataclasses.replace(gui.make_env(target=target, apps=(), files={GUI_HELP: GUI_HELP_PAGE},
                                             settle=settle),
                                id=f"gui-{seed}")
        tasks.append(t)
        cands[t.id] = gui_candidates(target, launch=True, help_page=GUI_HELP)
    if "swe" in families:
        # A real project's own tests (mpmath 1.3.0 from its sdist): run_tests takes seconds of real work.
        t = swe.make_env(seed)
        tasks.append(t)
        cands[t.id] = swe_candidates
    if "office" in families:
        # LibreOffice Calc on a large spreadsheet (the OSWorld stand-in): the agent cold-starts
        # soffice on it, edits two far-apart cells, saves and exports a PDF, real work each.
        t = dataclasses.replace(office.make_env(seed, settle=settle), id=f"office-{seed}")
        tasks.append(t)
        cands[t.id] = office_candidates(office.task_cells(seed))
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"unknown task families {sorted(unknown)}; use {', '.join(FAMILIES)}")
    return tasks, cands



async def check_tools(task: Task, candidates: Any) -> dict[str, Any]:
    """check_family on the agent's first candidate calls (each in two forks of the initial state),
    before the family meets the cache."""
    calls = [c for c in candidates(task.id, []) if isinstance(c, ToolCall)]
    t0 = time.monotonic()
    report = await check_family_async(task, calls)
    print(f"  check_family {task.id}: {len(report.checked)} calls in {time.monotonic() - t0:.1f} s, differing "
          f"{report.differing_tools or 'none'}", flush=True)
    return {**report.summary(), "seconds": round(time.monotonic() - t0, 3)}

