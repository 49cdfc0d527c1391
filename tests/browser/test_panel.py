"""The side panel in a real JupyterLab. A notebook in the page starts a cluster and a run with the
magics and shows the run's live dashboard; the panel lists the cluster's roles and the run, shows its
global step advancing, stops the run, then the cluster (each after a confirmation); hidden, it asks the
server nothing. A restarted server lists again a cluster that kept running in another process, with
the runs of that cluster's own store. The view of a 200k-step run draws the notebook's figures (how soon
after the click: benchmarks/run_view.py) with the notebook's controls (hover, log axis, smoothing, x modes),
two runs compare, and the view of a training run follows it. At the side bar's default width the panel fits with no
sideways scroll, a run's details open by mouse and keyboard, and axe-core finds no serious or critical accessibility
issue in it. Screenshots go to ``reports/``."""

import json
import os
import re
import time
from pathlib import Path

import nbformat
import psutil
import pytest
import torch
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from benchmarks.run_view import DRAWN_MS  # the same measure as the benchmark of the run view
import pscluster
from pscluster.cluster import forkserver, registry
from pscluster.metrics.store import RunStore
from pscluster.widgets import run_figures

from .lab import open_notebook

pytestmark = pytest.mark.browser

TAB = '.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="pscluster-panel"]'
PANEL = "#pscluster-panel"
ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"
SCREENSHOT = REPORTS / "side_panel.png"
MODEL = ("model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n"
         "loss_fn = torch.nn.CrossEntropyLoss()\n"
         "dataset = pscluster.datasets.digits('train')")
CELLS = [
    "%load_ext pscluster\nimport torch\nimport pscluster",
    "%pscluster start --ps 1 --workers 2 --name lab-demo",
    # a run that diverges (a squared error at lr 50: its loss NaN within a few dozen steps), then one that trains
    # until the panel stops it
    "%%pscluster train --mode sync --steps 3000 --batch-size 64 --lr 50 --name diverging\n" + MODEL +
    "\ndef loss_fn(out, y):\n    return torch.nn.functional.mse_loss(out, torch.nn.functional.one_hot(y, 10).float())",
    "try:\n    _.wait(verbose=False)\nexcept pscluster.PSClusterError as e:\n    print(e)",
    "%%pscluster train --mode sync --steps 1000000 --batch-size 64 --lr 0.1 --log-every 100000 --name digits-mlp\n"
    + MODEL,
]
CAUSE = re.compile(r"failed on worker:\d at global step \d+: worker \d failed: NonFiniteError: worker \d computed a "
                   r"non-finite loss")


# the time from the click on a run to its loss chart drawn with data, measured in the page
CLICKED = """() => document.addEventListener('click', () => { window.psclusterClickedAt = performance.now(); },
    {capture: true, once: true})"""
# what a plotly chart draws: its y axis type and the names of its traces in the legend
CHART = """(div) => ({yaxis: div._fullLayout.yaxis.type, xtype: div._fullLayout.xaxis.type,
    xrange: div._fullLayout.xaxis.range, legend: div._fullData.filter(t => t.showlegend).map(t => t.name)})"""
# WCAG's contrast ratio of an element's text colour against the first opaque background behind it
CONTRAST = """(node) => {
    const rgb = (c) => c.match(/[\\d.]+/g).map(Number);
    const luminance = ([r, g, b]) => [r, g, b].map(v => v / 255)
        .map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4)
        .reduce((sum, v, i) => sum + [0.2126, 0.7152, 0.0722][i] * v, 0);
    let back = node;
    while (back && (rgb(getComputedStyle(back).backgroundColor)[3] ?? 1) === 0) { back = back.parentElement; }
    const [a, b] = [rgb(getComputedStyle(node).color), rgb(getComputedStyle(back || document.body).backgroundColor)]
        .map(luminance).sort((x, y) => y - x);
    return (a + 0.05) / (b + 0.05);
}"""
# worker 0's loss and its smoothed loss as drawn
SMOOTHED = """(div) => [div.data.find(t => t.name === 'worker 0').y,
    div.data.find(t => t.name === 'worker 0 (smoothed)').y]"""


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def widen_side_bar(page, pixels: int) -> None:
    """Drag the handle between the left side bar and the main area ``pixels`` to the right."""
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle").first.bounding_box()
    page.mouse.move(handle["x"] + 1, handle["y"] + 200)
    page.mouse.down()
    page.mouse.move(handle["x"] + 1 + pixels, handle["y"] + 200, steps=5)
    page.mouse.up()


def open_panel(page):
    """Open the side panel, widened for the screenshot; returns its locator."""
    page.locator(TAB).click()
    widen_side_bar(page, 159)
    return page.locator(PANEL)


def confirm(page, title: str) -> None:
    page.locator(".jp-Dialog").get_by_text(title).wait_for()
    page.locator(".jp-Dialog .jp-mod-accept").click()


def dismiss_connection_error(page) -> None:
    """JupyterLab's own notice that its server did not answer: it stays over the page until dismissed."""
    notice = page.locator(".jp-Dialog", has_text="Server Connection Error")
    try:
        notice.wait_for(timeout=5_000)
    except PlaywrightTimeout:
        return  # the lab did not poll while the server was down
    notice.locator(".jp-Dialog-button").first.click()
    notice.wait_for(state="detached")


def role_rows(panel, cluster: str) -> list[str]:
    tasks = panel.locator(f'.jp-pscluster-cluster[data-name="{cluster}"] .jp-pscluster-task')
    tasks.first.wait_for(timeout=60_000)
    return [tasks.nth(i).locator("td").nth(0).inner_text().split()[0] for i in range(tasks.count())]  # "worker 1"


def global_step(row) -> int:
    return int(re.match(r"\d+", row.locator(".jp-pscluster-run-step").inner_text()).group())


def header_step(header) -> int | None:
    """The global step a dashboard's header shows; None while it shows none (a cell JupyterLab has not drawn yet,
    out of view in its windowed notebook, reads empty)."""
    found = re.search(r"global step (\d+) /", header.inner_text())
    return int(found.group(1)) if found else None


def api_requests(page, seconds: float) -> list[str]:
    seen = []

    def listener(request):
        seen.append(request)

    page.on("request", listener)
    page.wait_for_timeout(seconds * 1000)
    page.remove_listener("request", listener)
    return [r.url for r in seen if "/pscluster/api/" in r.url]


def eventually(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"still false after {timeout:.0f}s"
        time.sleep(0.2)
    return result


def test_a_notebook_trains_with_its_dashboard_and_the_panel_follows_and_stops_it(page, lab, home):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}),
        lab.root / "files" / "train_digits.ipynb")
    notebook = open_notebook(page, "train_digits.ipynb")
    eventually(lambda: any(k["execution_state"] == "idle" and k["connections"] for k in lab.kernels()), 90)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
    panel = open_panel(page)

    assert role_rows(panel, "lab-demo") == ["ps", "chief", "worker"]
    cluster = panel.locator('.jp-pscluster-cluster[data-name="lab-demo"]')
    assert cluster.locator(".jp-pscluster-restart").count() == 3  # one per role row
    assert set(cluster.locator(".jp-pscluster-task").first.locator("td").all_inner_texts()) >= {
        "127.0.0.1", "cpu", "running"}
    # the diverging run: its cause under its row, in its dashboard (the traceback folded) and its run's value
    failed = panel.locator(".jp-pscluster-run", has_text="diverging")
    failed.get_by_text("failed").wait_for(timeout=90_000)
    failed_id = failed.get_attribute("data-run-id")
    cause = panel.locator(f'.jp-pscluster-run-failure[data-run-id="{failed_id}"]')
    assert CAUSE.search(cause.inner_text()) and CAUSE.search(cause.get_attribute("title"))
    assert cause.bounding_box()["width"] <= failed.bounding_box()["width"]  # the cause never widens the table
    failed_dashboard = notebook.locator(".pscluster-dashboard", has_text="diverging")
    failed_dashboard.locator(".pscluster-failure").wait_for(timeout=30_000)
    assert CAUSE.search(failed_dashboard.locator(".pscluster-failure").inner_text())
    failed_dashboard.locator(".pscluster-failure summary").click()
    assert "Traceback" in failed_dashboard.locator(".pscluster-failure pre").inner_text()
    notebook.locator("th", has_text=re.compile("^cause$")).wait_for(timeout=30_000)  # the Run's table, at its end
    failed.locator(".jp-pscluster-run-name").click()
    failed_view = page.locator(f'.jp-pscluster-runview[data-run-id="{failed_id}"]')
    failed_view.locator('[data-status="failed"]').wait_for()
    assert CAUSE.search(failed_view.locator(".jp-pscluster-failure").inner_text())
    REPORTS.mkdir(exist_ok=True)
    page.screenshot(path=str(REPORTS / "run_failed.png"))
    failed_view.locator(".jp-pscluster-failure summary").click()
    assert "Traceback" in failed_view.locator(".jp-pscluster-failure pre").inner_text()
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="train_digits.ipynb").click()  # back to it

    row = panel.locator(".jp-pscluster-run", has_text="digits-mlp")
    row.get_by_text("training").wait_for(timeout=60_000)
    first = global_step(row)
    eventually(lambda: global_step(row) > first)
    row.locator(".jp-pscluster-sparkline path").wait_for()

    dashboard = notebook.locator(".jp-OutputArea-output", has=page.locator(".js-plotly-plot")).filter(
        has_text="digits-mlp")
    dashboard.locator(".js-plotly-plot").nth(2).wait_for(timeout=120_000)  # ipywidgets + plotly render
    header = dashboard.locator(".widget-html").first  # run name, mode, status, global step...
    header.get_by_text("training", exact=True).wait_for()
    dashboard.scroll_into_view_if_needed()
    shown = eventually(lambda: header_step(header))
    eventually(lambda: (header_step(header) or 0) > shown)  # a live update of the dashboard
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))

    row.locator(".jp-pscluster-stop-run").click()
    confirm(page, "Stop run digits-mlp?")
    row.get_by_text("stopped").wait_for(timeout=60_000)
    # the notebook's dashboard saw it too, and became its static copy: the final figures, drawn
    static = notebook.locator(".pscluster-dashboard", has_text="digits-mlp")
    static.get_by_text("stopped", exact=True).first.wait_for(timeout=30_000)
    static.locator(".js-plotly-plot").nth(5).wait_for(timeout=30_000)

    row.locator(".jp-pscluster-run-name").click()  # the run's view in the main area
    view = page.locator(f'.jp-pscluster-runview[data-run-id="{row.get_attribute("data-run-id")}"]')
    view.locator('.jp-pscluster-plot[data-chart="speed"] .main-svg').first.wait_for()
    view.locator('[data-status="stopped"]').wait_for()

    page.locator(TAB).click()  # hidden: no polling
    page.wait_for_timeout(500)
    assert api_requests(page, 3) == []
    try:
        with page.expect_request(lambda r: "/pscluster/api/" in r.url, timeout=30_000):
            page.locator(TAB).click()
    except PlaywrightTimeout:
        raise AssertionError("the visible panel stopped refreshing") from None

    entry = json.loads((home / "clusters" / "lab-demo.json").read_text())
    kernel = psutil.Process(entry["owner_pid"])
    assert {t["pid"] for t in entry["tasks"]} <= {p.pid for p in kernel.children(recursive=True)}
    cluster.locator(".jp-pscluster-stop").click()
    confirm(page, "Stop cluster lab-demo?")
    panel.get_by_text("No cluster running").wait_for(timeout=60_000)
    # every engine, the controller, the reaper end; the forkserver stays for the kernel's next cluster
    eventually(lambda: not [p for p in kernel.children(recursive=True) if forkserver.__name__ not in p.cmdline()])


def test_a_restarted_server_lists_again_a_cluster_that_kept_running(page, lab, home, tmp_path):
    store = tmp_path / "own" / "runs.sqlite"
    with pscluster.Cluster(ps=1, workers=1, name="elsewhere", store=store) as cluster:
        cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), steps=20, lr=0.1,
                      log_every=1000, name="own-store-run").wait(verbose=False)
        panel = open_panel(page)
        assert role_rows(panel, "elsewhere") == ["ps", "chief"]
        row = panel.locator(f'.jp-pscluster-run[data-store="{store}"]')
        row.get_by_text("finished").wait_for(timeout=30_000)

        lab.stop()
        panel.get_by_text("does not answer").first.wait_for(timeout=30_000)
        lab.start()
        dismiss_connection_error(page)
        assert role_rows(panel, "elsewhere") == ["ps", "chief"]
        row.get_by_text("finished").wait_for(timeout=30_000)
        assert not panel.locator(".jp-pscluster-error").is_visible()
        row.locator(".jp-pscluster-run-name").click()  # its metrics come from the cluster's store
        page.locator(f'.jp-pscluster-runview[data-store="{store}"] [data-status="finished"]').wait_for()
        assert "own-store-run" in page.locator(".jp-pscluster-runview-header").last.inner_text()
    panel.get_by_text("No cluster running").wait_for(timeout=30_000)


def synthetic_run(store: RunStore, name: str, steps: int, lr: float) -> int:
    """A finished run of ``steps`` global steps by 2 workers in turn at 1000 steps/s from now, its loss falling as
    lr/step."""
    t0 = time.time()
    run = store.create_run(name=name, cluster="gone", mode="async", spec={}, config={
        "mode": "async", "steps": steps, "batch_size": 32, "optimizer": "SGD", "optimizer_kwargs": {"lr": lr},
        "num_workers": 2, "shown": ["num_workers", "mode", "steps", "batch_size"]})  # as run_records keeps it
    for first in range(1, steps + 1, 50_000):
        store.add_batch(run, [{"kind": "step", "task": f"worker:{g % 2}", "time": t0 + g / 1000,
                               "local_step": (g + 1) // 2, "global_step": g, "loss": lr / g}
                              for g in range(first, min(first + 50_000, steps + 1))])
    store.set_status(run, "finished")
    return run


def test_the_view_of_a_long_run_draws_and_runs_compare(page, lab, home):
    with RunStore() as store:
        long, short = synthetic_run(store, "long-200k", 200_000, 0.1), synthetic_run(store, "short-50k", 50_000, 1.0)
        path = store.path
        convergence = run_figures.read(store, long).spec("convergence")  # as the notebook's dashboard draws it
    notebook_s = next(t["y"] for t in convergence.traces if t["name"] == "worker 0 (smoothed)")
    panel = open_panel(page)
    rows = {run: panel.locator(f'.jp-pscluster-run[data-run-id="{run}"][data-store="{path}"]') for run in (long, short)}
    rows[long].get_by_text("finished").wait_for(timeout=30_000)
    assert rows[long].locator(".jp-pscluster-run-final").inner_text() == "5.000e-7"  # 0.1 / 200k, not 0.0000
    assert "lr=0.1" in rows[long].locator(".jp-pscluster-run-settings").inner_text()

    view = f'.jp-pscluster-runview[data-run-id="{long}"][data-store="{path}"]'
    loss = f'{view} .jp-pscluster-plot[data-chart="convergence"]'
    page.evaluate(CLICKED)
    rows[long].locator(".jp-pscluster-run-name").click()
    drawn_ms = page.wait_for_function(DRAWN_MS, arg=loss, polling="raf", timeout=30_000).json_value()
    print(f"run view of 200k steps x 2 workers: loss chart drawn {drawn_ms:.0f} ms after the click")  # goal: run_view
    header = page.locator(f"{view} .jp-pscluster-runview-header")
    assert "1000 steps/s" in header.inner_text() and "loss 5.000e-7" in header.inner_text()
    assert [a.inner_text() for a in header.locator(".jp-pscluster-download").all()] == ["CSV", "JSON", "PARQUET"]
    assert "/metrics.json" in header.get_by_text("JSON").get_attribute("href")
    page.locator(f'{view} .jp-pscluster-plot[data-chart="speed"] .scatterlayer .trace').first.wait_for(state="attached")
    plot = page.locator(loss)
    assert plot.evaluate(CHART)["legend"] == ["worker 0", "worker 0 (smoothed)", "worker 1", "worker 1 (smoothed)"]

    plot.scroll_into_view_if_needed()  # under the placement and speed figures, as in the notebook
    box = plot.locator(".nsewdrag").first.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] - 2)  # on the lines, near 0 there
    hover = plot.locator(".hoverlayer")
    eventually(lambda: "worker 0" in hover.text_content(), 5)  # the values under the mouse

    page.locator(view).get_by_label("log scale (loss)").check()  # the notebook's controls
    eventually(lambda: plot.evaluate(CHART)["yaxis"] == "log", 5)
    REPORTS.mkdir(exist_ok=True)
    page.screenshot(path=str(REPORTS / "run_view_long.png"))

    # smoothed as the notebook smooths it (over every row, then thinned), then at the weight the viewer chooses, by
    # the notebook's controls.js: TensorBoard's debiased EMA of the points drawn, from the first one on; then none
    def second(raw, w):
        return (w * (1 - w) * raw[0] + (1 - w) * raw[1]) / (1 - w ** 2)

    raw, smoothed = plot.evaluate(SMOOTHED)
    assert smoothed == pytest.approx(notebook_s.tolist()) and smoothed[0] == pytest.approx(raw[0])
    page.locator(f"{view} .pscluster-controls input[type=range]").evaluate(
        "(s) => { s.value = '0.6'; s.dispatchEvent(new Event('input')); }")
    eventually(lambda: plot.evaluate(SMOOTHED)[1][1] == pytest.approx(second(raw, 0.6)), 5)
    page.locator(f"{view} .pscluster-controls input[type=range]").evaluate(
        "(s) => { s.value = '0'; s.dispatchEvent(new Event('input')); }")
    eventually(lambda: plot.evaluate(SMOOTHED)[1] == plot.evaluate(SMOOTHED)[0], 5)  # no smoothing: the values alone
    page.locator(view).get_by_label("x axis").select_option("relative")  # the control is labelled
    eventually(lambda: plot.evaluate(CHART)["xrange"][1] < 250, 5)  # seconds since the run started
    page.locator(view).get_by_label("x axis").select_option("wall")
    eventually(lambda: plot.evaluate(CHART)["xtype"] == "date", 5)

    for run in (long, short):
        rows[run].locator(".jp-pscluster-run-checkbox").check()
    panel.locator(".jp-pscluster-compare").click()
    compare = page.locator('.jp-pscluster-runview[data-compare="2"] .jp-pscluster-plot[data-chart="compare"]')
    compare.locator(".scatterlayer .trace").first.wait_for(timeout=10_000)
    assert {"long-200k", "short-50k"} <= set(compare.evaluate(CHART)["legend"])  # a curve per run
    page.screenshot(path=str(REPORTS / "run_compare.png"))


def steps_now(first: int, last: int) -> list[dict]:
    """Steps ``first`` to ``last`` of worker 0, reported now."""
    return [{"kind": "step", "task": "worker:0", "time": time.time(), "local_step": g, "global_step": g,
             "loss": 1 / g} for g in range(first, last + 1)]


def test_the_view_of_a_training_run_follows_it(page, lab, home):
    registry.write({"name": "live", "owner_pid": os.getpid(), "tasks": []})  # its kernel: this process
    try:
        with RunStore() as store:
            run = store.create_run(name="live-run", cluster="live", mode="async", spec={},
                                   config={"steps": 10_000_000, "shown": ["steps"]})
            store.set_status(run, "training")
            store.add_batch(run, steps_now(1, 100))
            store.add_event(run, "controller", "diverging", {"since_step": 90, "loss": 950.0, "reference": 2.3,
                                                             "threshold": 11.5})  # as the supervisor records it
            panel = open_panel(page)
            row = panel.locator(f'.jp-pscluster-run[data-run-id="{run}"]')
            status = row.locator(".jp-pscluster-run-status")
            status.get_by_text("training").wait_for(timeout=10_000)
            assert status.evaluate(CONTRAST) >= 4.5  # the status colour on the panel's background
            warning = status.locator(".jp-pscluster-diverging")  # at the default width, the sign alone
            assert warning.inner_text().strip() == "⚠" and warning.evaluate(CONTRAST) >= 4.5
            assert "diverging since step 90" in row.get_attribute("aria-label")
            row.focus()  # by keyboard: a run row takes the focus, and Enter opens its view
            page.keyboard.press("Enter")
            header = page.locator(f'.jp-pscluster-runview[data-run-id="{run}"] .jp-pscluster-runview-header')
            header.get_by_text("global step 100/10000000").wait_for(timeout=10_000)
            assert "steps=10000000" in header.inner_text()  # a whole number in full, never 1.000e+7
            assert "⚠ diverging since step 90: the loss (smoothed) is 950, over 11.5" in header.inner_text()
            store.add_batch(run, steps_now(101, 250))
            began = time.monotonic()
            header.get_by_text("global step 250/10000000").wait_for(timeout=10_000)  # the series asked again
            print(f"a training run's view showed its new steps {time.monotonic() - began:.1f} s after they were stored")
    finally:
        registry.remove("live")


def steps_until_now(first: int, last: int, per_s: float) -> list[dict]:
    """Steps ``first`` to ``last`` of worker 0 at ``per_s`` steps/s, the last one now."""
    return [{**step, "time": step["time"] - (last - step["global_step"]) / per_s} for step in steps_now(first, last)]


def three_runs(store: RunStore, cluster: str) -> dict[str, int]:
    """By status, a finished run with a long name, a training one, and a failed one with a long cause and many
    settings, on ``cluster``."""
    runs = {"finished": synthetic_run(store, "digits-mlp-baseline-with-a-long-name", 2_000, 0.1)}
    runs["training"] = store.create_run(name="digits-mlp-live", cluster=cluster, mode="sync", spec={},
                                        config={"steps": 1_000_000})
    store.set_status(runs["training"], "training")
    store.add_batch(runs["training"], steps_until_now(899_901, 900_000, 180))
    runs["failed"] = store.create_run(name="digits-adamw", cluster=cluster, mode="sync", spec={}, config={
        "optimizer": "AdamW", "optimizer_kwargs": {"lr": 0.003, "weight_decay": 0.01}, "batch_size": 256,
        "mode": "sync", "num_workers": 2, "steps": 1_000_000, "replicas_to_aggregate": 2, "scheduler": "cosine",
        "max_grad_norm": 1.0, "precision": "bf16", "seed": 1234, "shown": [
            "num_workers", "scheduler", "mode", "steps", "batch_size", "replicas_to_aggregate", "max_grad_norm",
            "precision", "seed"]})
    store.add_batch(runs["failed"], steps_until_now(1, 37, 60))
    store.set_status(runs["failed"], "failed", failure={
        "cause": "worker 1 failed: NonFiniteError: worker 1 computed a non-finite loss (nan) at local step 37: lower "
                 "the learning rate or clip the gradients (max_grad_norm)", "task": "worker:1", "step": 37,
        "traceback": "Traceback (most recent call last): ..."})
    return runs


AXE = ROOT / "labextension" / "node_modules" / "axe-core" / "axe.min.js"  # `make labextension` installs it
# axe-core's violations of impact serious or critical in the panel: impact, rule and where
AUDIT = """async () => (await axe.run('#pscluster-panel')).violations
    .filter(v => v.impact === 'serious' || v.impact === 'critical')
    .map(v => `${v.impact} ${v.id}: ${v.nodes.map(n => n.target.join(' ')).join(', ')}`)"""
# what does not fit the panel: a horizontal scroll, a control or a cell past its right edge, a clipped button
OVERFLOW = """(panel) => {
    const right = panel.getBoundingClientRect().left + panel.clientLeft + panel.clientWidth;
    const out = [...panel.querySelectorAll('button, input, a, th, td')]
        .filter(n => n.getClientRects().length && (n.getBoundingClientRect().right > right + 0.5
            || (n.tagName === 'BUTTON' && n.scrollWidth > n.clientWidth)))
        .map(n => `${n.tagName} ${n.textContent || n.getAttribute('aria-label')}`);
    return panel.scrollWidth > panel.clientWidth ? [`scrolls: ${panel.scrollWidth} > ${panel.clientWidth}`, ...out]
        : out;
}"""
CLIPPED = "(node) => node.scrollWidth > node.clientWidth"


def test_the_panel_fits_its_default_width_and_passes_an_accessibility_audit(page, lab, home):
    registry.write({"name": "two-gpus", "owner_pid": os.getpid(), "tasks": [  # its kernel and tasks: this process
        {"role": role, "task": task, "host": "127.0.0.1", "pid": os.getpid(), "device": device}
        for role, task, device in [("ps", 0, "cpu"), ("chief", 0, "cuda:0"), ("worker", 1, "cuda:1")]]})
    try:
        with RunStore() as store:
            runs = three_runs(store, "two-gpus")
        page.locator(TAB).click()  # at the side bar's default width
        panel = page.locator(PANEL)
        rows = {status: panel.locator(f'.jp-pscluster-run[data-run-id="{run}"][data-store="{store.path}"]')
                for status, run in runs.items()}
        for status, row in rows.items():
            row.locator(".jp-pscluster-run-status").get_by_text(status).wait_for(timeout=30_000)
        assert role_rows(panel, "two-gpus") == ["ps", "chief", "worker"]
        cause = panel.locator(f'.jp-pscluster-run-failure[data-run-id="{runs["failed"]}"] .jp-pscluster-failure')
        assert "NonFiniteError" in cause.inner_text() and cause.evaluate(CLIPPED)  # under its row, on one line
        print(f"the panel's default width: {panel.bounding_box()['width']:.0f} px")
        assert panel.evaluate(OVERFLOW) == []
        # every control named: the icons' buttons by what they do
        for button in ("Stop", "Restart worker 1", "Stop digits-mlp-live", "Details of digits-adamw"):
            assert panel.get_by_role("button", name=button, exact=True).first.is_visible()
        assert panel.get_by_role("checkbox", name="Compare digits-adamw").is_visible()

        settings = rows["failed"].locator(".jp-pscluster-run-settings")
        details = panel.locator(f'.jp-pscluster-run-details[data-run-id="{runs["failed"]}"]')
        assert not settings.is_visible() and not details.is_visible()
        toggle = rows["failed"].get_by_role("button", name="Details of digits-adamw")
        toggle.click()  # one click: what the row leaves out, the settings in full, the CSV download
        assert toggle.get_attribute("aria-expanded") == "true"
        text = details.inner_text()
        assert "37 of 1000000" in text and "steps/s" in text and "wall" in text and "seed=1234" in text
        assert "/metrics.csv" in details.get_by_role("link", name="CSV").get_attribute("href")
        assert not cause.evaluate(CLIPPED)  # the whole cause, wrapped
        assert panel.evaluate(OVERFLOW) == []  # the long line of settings wraps too
        REPORTS.mkdir(exist_ok=True)
        runs_box = panel.locator(".jp-pscluster-runs").bounding_box()
        page.screenshot(path=str(REPORTS / "side_panel_default_width.png"), clip={
            "x": 0, "y": 0, "width": panel.bounding_box()["x"] + panel.bounding_box()["width"],
            "height": runs_box["y"] + runs_box["height"] + 12})
        page.add_script_tag(path=str(AXE))
        assert page.evaluate(AUDIT) == []

        toggle.click()
        assert not details.is_visible()
        rows["finished"].focus()  # by keyboard: Tab from a run's row reaches its details button, Enter opens them
        page.keyboard.press("Tab")
        page.keyboard.press("Enter")
        finished = panel.locator(f'.jp-pscluster-run-details[data-run-id="{runs["finished"]}"]')
        finished.get_by_text("lr=0.1").wait_for()

        widen_side_bar(page, 560)  # wider, the panel shows more columns and still fits
        settings.wait_for()
        assert "seed=1234" in settings.inner_text()
        assert panel.evaluate(OVERFLOW) == []
    finally:
        registry.remove("two-gpus")
