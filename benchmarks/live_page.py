"""The page during a long live run: how busy a notebook's live dashboard keeps the browser's main thread, whose goal
is at most 30 % of the wall time on 2 cores. A real JupyterLab (as the browser tests start it) runs a notebook that
starts 1 ps + 2 workers and trains a 1,000,000-step async run with its dashboard (``tests/browser/lab.LIVE_CELLS``);
Debian's headless chromium, driven by playwright, shows it. The share is chromium's own count of the main thread's
task time (DevTools' ``Performance.getMetrics`` TaskDuration) over each window, with the figures redrawn live (the
default), and paused for scale."""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

from tests.browser.lab import (CHROMIUM, FIGURES_DRAWN, LIVE_CELLS, LIVE_STEPS, NOTEBOOK, SHOW_UNDRAWN_FIGURE,
                               LabServer, MainThread, launch_chromium, open_notebook)

from .common import Result, Target, alternate, compare, repetitions

VIEWPORT = {"width": 1400, "height": 900}  # the browser tests' page
FIGURES = 6



def start_live_run(page, lab: LabServer) -> None:
    """Open the live notebook, run all its cells, wait until every figure is drawn with data (scrolled into view in
    turn), then scroll back to the dashboard's header."""
    page.goto(f"{lab.url}/lab?reset&token={lab.token}")
    open_notebook(page, "live.ipynb")
    deadline = time.monotonic() + 90
    while not any(k["execution_state"] == "idle" and k["connections"] for k in lab.kernels()):
        if time.monotonic() > deadline:
            raise RuntimeError("the notebook's kernel did not start")
        time.sleep(0.3)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
    deadline = time.monotonic() + 180
    while (counts := page.evaluate(FIGURES_DRAWN)).count(0) or len(counts) < FIGURES:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the live dashboard did not draw: figures with data {counts}")
        page.evaluate(SHOW_UNDRAWN_FIGURE)
        page.wait_for_timeout(500)
    page.locator(f"{NOTEBOOK} .widget-toggle-button").first.scroll_into_view_if_needed()


def busy_share(page, redraw: str, seconds: float) -> float:
    """The main thread's busy share over ``seconds`` with the dashboard's figures redrawn as ``redraw`` says (its
    "figures" buttons: "live", "paused")."""
    page.locator(f"{NOTEBOOK} .widget-toggle-button", has_text=redraw).first.click()
    page.wait_for_timeout(1000)  # what the previous choice had started
    busy = MainThread(page)
    page.wait_for_timeout(seconds * 1000)
    return busy.share()


def run(tiny: bool, out_dir: Path) -> Result:
    result = Result("live_page", "The page's main thread during a long live run", tiny)
    if not os.path.exists(CHROMIUM):
        result.skipped = f"no {CHROMIUM} on this machine (`make chromium` installs it)"
        return result
    import nbformat
    from playwright.sync_api import sync_playwright

    rounds, seconds = repetitions(tiny), 3 if tiny else 15
    with tempfile.TemporaryDirectory(prefix="pscluster-bench-") as folder:
        lab = LabServer(Path(folder) / "lab", env={"PSCLUSTER_HOME": str(Path(folder) / "home")})
        (lab.root / "files").mkdir()
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in LIVE_CELLS], metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}),
            lab.root / "files" / "live.ipynb")
        lab.start()
        try:
            with sync_playwright() as p:
                browser = launch_chromium(p)
                try:
                    page = browser.new_context(viewport=VIEWPORT).new_page()
                    start_live_run(page, lab)
                    shares = alternate({redraw: lambda redraw=redraw: busy_share(page, redraw, seconds)
                                        for redraw in ("live", "paused")}, rounds)
                finally:
                    browser.close()
        finally:
            lab.stop()  # its kernel, and with it the cluster and the run

    result.rows.append(compare(
        f"main thread busy during a {LIVE_STEPS:,}-step async run's live dashboard (1 ps + 2 workers), "
        f"figures redrawn live", "share of wall time", shares["live"], "all of it", [1.0] * rounds, "share",
        Target(0.30, higher=False),
        note=f"paused: {sorted(shares['paused'])[len(shares['paused']) // 2]:.0%} (median)"))
    result.extra = {"seconds": seconds, "shares": shares}
    result.notes += [
        f"Each round: {seconds} s with the dashboard's figures redrawn live (the default), then {seconds} s paused "
        "(its \"figures\" buttons), order alternating; the share is the main thread's task time over the wall time "
        "(chromium's TaskDuration). The page: JupyterLab in Debian's headless chromium at 1400x900, the notebook "
        "scrolled to the dashboard's redraw buttons (they and the first figures in view, the others out of view), "
        "the kernel, its cluster and the lab server on the same 2 cores.",
    ]
    return result
