"""The run view and the compare view in a real JupyterLab, as plotly draws them (the traces of each chart's div):
the notebook's figures of a run, as its dashboard draws them (smoothed lines over their faint raw lines, test
evaluations marked, each worker's speed), served by the lab server and drawn as they come; runs compared as
pscluster.compare draws them, by any metric, with the hyperparameters that differ. Screenshots go to ``reports/``
(``run_view.png`` and ``compare.png`` are those of docs/guide.md)."""

import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pscluster.metrics.store import RunStore
from pscluster.widgets import panels

from .test_panel import open_panel

pytestmark = pytest.mark.browser

REPORTS = Path(__file__).resolve().parents[2] / "reports"
RATES = {0: 40.0, 1: 20.0}  # local steps/s of each worker
EVALUATED = (400, 800, 1200, 1600)  # global steps of the test evaluations
# the traces plotly draws in a chart's div, once it has drawn every one of `names`
TRACES = """([chart, names]) => {
    const div = document.querySelector(chart);
    const drawn = div && div.data ? div.data : [];
    if (!names.every(n => drawn.some(t => t.name === n))) { return null; }
    return drawn.map(t => ({name: t.name, mode: t.mode, opacity: t.opacity ?? 1, fill: t.fill ?? null,
        showlegend: t.showlegend ?? true, yaxis: t.yaxis || 'y', x: t.x, y: t.y}));
}"""
TITLE = "(div) => div._fullLayout.title.text"


def noisy_run(store: RunStore, name: str, *, lr: float, batch_size: int, seconds: float, seed: int) -> int:
    """A finished run of 2 workers at RATES steps/s, each step taking 0.5 to 1.5 times its mean; a loss that
    falls under noise (faster for a higher ``lr``), an accuracy that rises with it; test evaluations at EVALUATED
    (those it reached); its learning rate divided by 10 half-way; 3 variables on 2 ps."""
    rng = np.random.default_rng(seed)
    t0 = time.time() - seconds
    steps = [(t0 + t, w, i + 1) for w, rate in RATES.items()
             for i, t in enumerate(np.cumsum(rng.uniform(0.5, 1.5, int(seconds * rate)) / rate))]
    steps.sort()
    clean = [2 * np.exp(-g * lr / 60) + 0.1 for g in range(1, len(steps) + 1)]  # faster for a higher lr
    run = store.create_run(name=name, cluster="gone", mode="async", spec={}, config={
        "mode": "async", "steps": len(steps), "batch_size": batch_size, "optimizer": "SGD",
        "optimizer_kwargs": {"lr": lr}, "num_workers": 2,
        "shown": ["num_workers", "mode", "steps", "batch_size"]})  # as run_records keeps it: the settings shown
    store.record_placement(run, [SimpleNamespace(name=f"fc{i}.weight", ps=i % 2, shape=(64, 64), dtype="float32",
                                                 nbytes=16384) for i in range(3)])
    loss = [c * rng.uniform(0.4, 1.6) for c in clean]
    store.add_batch(run, [{"kind": "step", "task": f"worker:{w}", "time": t, "local_step": local, "global_step": g,
                           "loss": loss[g - 1], "accuracy": 1 - loss[g - 1] / 3}
                          for g, (t, w, local) in enumerate(steps, start=1)])
    store.add_batch(run, [{"kind": "ps", "task": "ps:0", "time": steps[g - 1][0], "step": g,
                           "lr": lr if g < len(steps) // 2 else lr / 10} for g in range(1, len(steps) + 1, 100)])
    for g in (g for g in EVALUATED if g <= len(steps)):
        store.add_evaluation(run, g, clean[g - 1], 1 - clean[g - 1] / 3)
    store.set_status(run, "finished")
    return run


def traces(page, chart: str, *names: str, yaxis: str = "y") -> dict[str, dict]:
    """The traces of `chart` on `yaxis` by name, once it has drawn `names`."""
    found = page.wait_for_function(TRACES, arg=[chart, list(names)], timeout=30_000).json_value()
    return {t["name"]: t for t in found if t["yaxis"] == yaxis}


def open_view(page, store_path: str, *runs: int):
    """Open the view of one run (a click on its name) or the comparison of several (checked, then Compare)."""
    panel = open_panel(page)
    rows = [panel.locator(f'.jp-pscluster-run[data-run-id="{run}"][data-store="{store_path}"]') for run in runs]
    rows[0].get_by_text("finished").wait_for(timeout=30_000)
    if len(rows) == 1:
        rows[0].locator(".jp-pscluster-run-name").click()
        return page.locator(f'.jp-pscluster-runview[data-run-id="{runs[0]}"]')
    for row in rows:
        row.locator(".jp-pscluster-run-checkbox").check()
    panel.locator(".jp-pscluster-compare").click()
    return page.locator(f'.jp-pscluster-runview[data-compare="{len(runs)}"]')


def test_the_run_view_draws_the_notebook_s_figures_smoothed_lines_over_faint_raw_lines(page, lab, home):
    with RunStore() as store:
        run = noisy_run(store, "noisy", lr=0.1, batch_size=32, seconds=60, seed=1)
        path = store.path
        evaluations = store.evaluations(run)
    view = open_view(page, path, run)
    chart = f'.jp-pscluster-runview[data-run-id="{run}"] .jp-pscluster-plot[data-chart="%s"]'

    for name, yaxis in (("loss", "y"), ("accuracy", "y2")):  # one figure, a plot each, as in the notebook
        drawn = traces(page, chart % "convergence", "worker 0 (smoothed)", "worker 1 (smoothed)", "test set",
                       yaxis=yaxis)
        assert not [t["name"] for t in drawn.values() if t["fill"]]  # no min..max band over the curves
        names = list(drawn)
        for w in RATES:
            raw, smoothed = drawn[f"worker {w}"], drawn[f"worker {w} (smoothed)"]
            assert raw["opacity"] == pytest.approx(0.3) and smoothed["opacity"] == 1
            assert names.index(raw["name"]) < names.index(smoothed["name"])  # the smoothed line drawn over it
            assert np.std(np.diff(smoothed["y"])) < np.std(np.diff(raw["y"])) / 2
        test = drawn["test set"]
        assert test["mode"] == "markers" and test["x"] == list(EVALUATED)
        assert test["y"] == pytest.approx(evaluations[name].tolist())
    # the notebook's controls over it, at the notebook's smoothing
    slider = view.locator(".pscluster-controls input[type=range]")
    assert float(slider.input_value()) == pytest.approx(1 - 2 / (panels.SMOOTH_SPAN + 1), abs=1e-3)

    drawn = traces(page, chart % "speed", "worker 0", "worker 1 (slowest)")
    assert page.locator(chart % "speed").evaluate(TITLE).startswith("speed: local steps/s per worker · slowest: "
                                                                    "worker 1")
    for w, rate in RATES.items():  # over 5 s of steps 0.5 to 1.5 times their mean: near it, never a step's noise
        line = drawn[f"worker {w}" + " (slowest)" * (w == 1)]
        ys = [y for x, y in zip(line["x"], line["y"]) if y is not None and x > line["x"][0] + 10]
        assert len(ys) > 100 and rate * 0.85 < min(ys) and max(ys) < rate * 1.15
    for name in ("placement", "staleness", "ps_load", "traffic"):  # every figure of the dashboard, in its order
        page.locator(chart % name).locator(".main-svg").first.wait_for()
    order = view.locator(".jp-pscluster-plot").evaluate_all("(divs) => divs.map(d => d.dataset.chart)")
    assert order == ["placement", "speed", "convergence", "staleness", "ps_load", "traffic"]
    view.locator(".jp-pscluster-runview-header").scroll_into_view_if_needed()
    REPORTS.mkdir(exist_ok=True)
    page.screenshot(path=str(REPORTS / "run_view.png"))


def test_compare_draws_accuracy_of_two_runs_with_a_hyperparameter_diff(page, lab, home):
    with RunStore() as store:
        fast = noisy_run(store, "lr-0.2", lr=0.2, batch_size=32, seconds=30, seed=2)
        slow = noisy_run(store, "lr-0.05", lr=0.05, batch_size=64, seconds=30, seed=3)
        path = store.path
        final = {name: store.metrics(run)["accuracy"].iloc[-200:].mean() for name, run in (("lr-0.2", fast),
                                                                                           ("lr-0.05", slow))}
    view = open_view(page, path, fast, slow)

    diff = view.locator("table.jp-pscluster-hyperparameters")
    runs = diff.locator("thead th").all_inner_texts()[1:]
    assert sorted(runs) == ["lr-0.05", "lr-0.2"]
    cells = {row.locator("th").inner_text(): dict(zip(runs, row.locator("td").all_inner_texts()))
             for row in diff.locator("tbody tr").all()}
    assert cells == {"lr": {"lr-0.2": "0.2", "lr-0.05": "0.05"}, "batch_size": {"lr-0.2": "32", "lr-0.05": "64"}}

    chart = '.jp-pscluster-runview[data-compare="2"] .jp-pscluster-plot[data-chart="compare"]'
    traces(page, chart, "lr-0.2", "lr-0.05", "global steps/s")  # the loss first, as before a choice
    assert page.locator(chart).evaluate(TITLE) == "compare runs: convergence and speed"
    chooser = view.get_by_label("metric")
    assert chooser.locator("option").all_inner_texts() == ["loss", "accuracy"]
    chooser.select_option("accuracy")
    page.wait_for_function("(c) => document.querySelector(c)._fullLayout.yaxis.title.text.startsWith('accuracy')",
                           arg=chart, timeout=30_000)
    drawn = traces(page, chart, "lr-0.2", "lr-0.05")
    for name, value in final.items():  # each run's accuracy, its workers' mean, smoothed
        assert drawn[name]["y"][-1] == pytest.approx(value, rel=0.1)
    assert drawn["lr-0.2"]["y"][-1] > drawn["lr-0.05"]["y"][-1]  # learns faster
    REPORTS.mkdir(exist_ok=True)
    page.screenshot(path=str(REPORTS / "compare.png"))


def test_compare_says_in_one_line_that_the_hyperparameters_are_the_same(page, lab, home):
    with RunStore() as store:
        runs = [noisy_run(store, f"seed-{seed}", lr=0.1, batch_size=32, seconds=5, seed=seed) for seed in (4, 5)]
        path = store.path
    view = open_view(page, path, *runs)
    same = view.locator(".jp-pscluster-hyperparameters")
    same.wait_for()
    assert same.inner_text().startswith("The 2 runs have the same hyperparameters: optimizer=SGD lr=0.1")
    assert view.locator("table.jp-pscluster-hyperparameters").count() == 0
