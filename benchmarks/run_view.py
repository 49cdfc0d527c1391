"""The side panel's run view in a real JupyterLab: from the click on a finished run in the panel's list to its
loss chart drawn with data, for a run of 200,000 global steps (2 workers), whose goal is one second, and for a
run of 1,000 steps beside it, for scale. Each measurement is a fresh page of the lab (a new browser context:
nothing cached) in Debian's headless chromium, driven by playwright, as the browser tests drive it."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from pscluster.metrics.store import STORE_FILE, RunStore
from tests.browser.lab import CHROMIUM, LabServer, launch_chromium

from .common import Result, Target, alternate, compare, repetitions

WORKERS = 2
TAB = '.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="pscluster-panel"]'
PANEL = "#pscluster-panel"
VIEWPORT = {"width": 1400, "height": 900}  # the browser tests' page
# the click's time, taken in the page by the first click event; the resource timings of the page emptied
# before it, so that the series request after it finds room in their buffer (250 entries; the lab's own
# scripts fill it)
CLICKED = """() => { performance.clearResourceTimings();
    document.addEventListener('click', () => { window.psclusterClickedAt = performance.now(); },
        {capture: true, once: true}); }"""
# milliseconds from the click to the first trace of the chart drawn (false until then), polled every frame
DRAWN_MS = """(selector) => { const plot = document.querySelector(selector);
    return plot && plot.querySelector('.main-svg .scatterlayer .trace')
        && performance.now() - window.psclusterClickedAt; }"""
# the view's figures request: milliseconds from the click to its answer's last byte, and its body's bytes
SERIES = """() => { const e = performance.getEntriesByType('resource').find(e => e.name.includes('/figures?'));
    return e ? [e.responseEnd - window.psclusterClickedAt, e.encodedBodySize] : [NaN, 0]; }"""


def synthetic_run(store: RunStore, name: str, steps: int) -> int:
    """A finished async run of ``steps`` global steps by ``WORKERS`` workers in turn at 1,000 steps/s from now,
    its loss falling as 0.1/step, written through ``RunStore.add_batch`` (raw rows, rollups, raw window)."""
    t0 = time.time()
    run = store.create_run(name=name, cluster="gone", mode="async", spec={}, config={
        "mode": "async", "steps": steps, "batch_size": 32, "optimizer": "SGD", "optimizer_kwargs": {"lr": 0.1},
        "num_workers": WORKERS})
    for first in range(1, steps + 1, 50_000):
        store.add_batch(run, [{"kind": "step", "task": f"worker:{g % WORKERS}", "time": t0 + g / 1000,
                               "local_step": (g + 1) // WORKERS, "global_step": g, "loss": 0.1 / g}
                              for g in range(first, min(first + 50_000, steps + 1))])
    store.set_status(run, "finished")
    return run


class RunViews:
    """Opens run views in fresh pages of ``lab``: ``click_to_drawn(run)`` is one measurement; the series
    request's time and size of each are kept in ``series``, by run."""

    def __init__(self, browser, lab: LabServer):
        self.browser, self.lab = browser, lab
        self.series: dict[int, list[tuple[float, int]]] = {}

    def click_to_drawn(self, run: int) -> float:
        """Seconds from the click on ``run``'s name in the side panel to its view's loss chart drawn. Before the
        click: the lab loaded, the panel shown, the run listed as finished and plotly.js loaded (which the
        panel asks for when it is shown, so that a view opens drawn)."""
        context = self.browser.new_context(viewport=VIEWPORT)
        try:
            page = context.new_page()
            page.goto(f"{self.lab.url}/lab?reset&token={self.lab.token}")
            page.locator(".jp-LauncherCard").first.wait_for(timeout=60_000)
            page.locator(TAB).click()
            row = page.locator(f'{PANEL} .jp-pscluster-run[data-run-id="{run}"]')
            row.get_by_text("finished").wait_for(timeout=60_000)
            page.wait_for_function("() => !!window.Plotly", timeout=60_000)
            page.evaluate(CLICKED)
            row.locator(".jp-pscluster-run-name").click()
            loss = f'.jp-pscluster-runview[data-run-id="{run}"] .jp-pscluster-plot[data-chart="convergence"]'
            drawn_ms = page.wait_for_function(DRAWN_MS, arg=loss, polling="raf", timeout=30_000).json_value()
            answered_ms, nbytes = page.evaluate(SERIES)
            self.series.setdefault(run, []).append((answered_ms, nbytes))
            return drawn_ms / 1000
        finally:
            context.close()


def run(tiny: bool, out_dir: Path) -> Result:
    result = Result("run_view", "Side panel run view: click to loss chart drawn, a long finished run", tiny)
    if not os.path.exists(CHROMIUM):
        result.skipped = f"no {CHROMIUM} on this machine (`make chromium` installs it)"
        return result
    from playwright.sync_api import sync_playwright

    rounds = repetitions(tiny)
    # the short run is for scale: left out at the tiny size, where a page load costs more than the rest together
    sizes = {"long": 10_000} if tiny else {"long": 200_000, "short": 1_000}
    with tempfile.TemporaryDirectory(prefix="pscluster-bench-") as folder:
        home, root = Path(folder) / "home", Path(folder) / "lab"
        began = time.perf_counter()
        with RunStore(home / STORE_FILE) as store:  # the lab's default store: $PSCLUSTER_HOME/runs.sqlite
            runs = {key: synthetic_run(store, f"{key}-{steps // 1000}k", steps) for key, steps in sizes.items()}
        written_s = time.perf_counter() - began
        lab = LabServer(root, env={"PSCLUSTER_HOME": str(home)})
        (lab.root / "files").mkdir()
        lab.start()
        try:
            with sync_playwright() as p:
                browser = launch_chromium(p)
                try:
                    views = RunViews(browser, lab)
                    times = alternate({key: lambda run=run: views.click_to_drawn(run)
                                       for key, run in runs.items()}, rounds)
                finally:
                    browser.close()
        finally:
            lab.stop()

    for key, steps in sizes.items():
        answers = views.series[runs[key]]
        answered_ms = statistics.median(ms for ms, _ in answers)
        kib = statistics.median(n for _, n in answers) / 1024
        result.rows.append(compare(
            f"side panel run view, click to loss chart drawn: finished run of {steps:,} global steps "
            f"({WORKERS} workers)", "click to loss chart drawn", times[key], "one second", [1.0] * rounds, "s",
            Target(1.0, higher=False), note=f"series answered {answered_ms:.0f} ms after the click, {kib:,.0f} KiB"))
    result.extra = {"steps": sizes, "written_s": round(written_s, 2),
                    "series": {key: views.series[run] for key, run in runs.items()}}
    result.notes += [
        f"Runs: finished async runs of {' and '.join(f'{steps:,}' for steps in sizes.values())} global steps "
        f"({WORKERS} workers in turn, loss 0.1/step), written through RunStore.add_batch into the store of the lab's "
        f"PSCLUSTER_HOME ({written_s:.1f} s in all). The lab: `jupyter lab` with the pscluster extensions "
        "(tests/browser/lab.py, as the browser tests start it), Debian's headless chromium through playwright.",
        "Each measurement is a fresh page (a new browser context: no cache): the lab loaded, the side panel "
        "shown, the run's row listed as finished and plotly.js loaded (the panel loads it when shown); then the "
        "click on the run's name, to the first trace of the view's loss chart drawn (performance.now() in the "
        "page, polled every animation frame). The two runs alternate, one page each per round. Against one "
        "second: the ratio is the seconds. \"Series answered\": the view's one series request (the run's "
        "loss, 1,500 points per worker at most), from the click to its last byte, median.",
    ]
    return result
