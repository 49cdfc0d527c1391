"""A finished run's dashboard after its kernel is gone, in a real JupyterLab: a notebook executed headless
(nbclient, as CI or a colleague runs it) and opened untrusted, as every received notebook is, shows each figure
as its image (pixels checked); trusted, plotly.js draws the figures and the convergence figure's smoothing and
log scale change the drawn curve, with no kernel; the HTML report has the same controls. Screenshots go to
``reports/``."""

import io
import urllib.request
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter
from PIL import Image

from pscluster.metrics.store import RunStore
from pscluster.report import InlinePlotly
from pscluster.widgets.figure_specs import color

from ..unit.widgets.test_dashboard import Writer
from .lab import NOTEBOOK, open_notebook

pytestmark = pytest.mark.browser

REPORTS = Path(__file__).resolve().parents[2] / "reports"
FIGURES = 6  # placement, speed, convergence, staleness, ps load, traffic
CONVERGENCE = f"{NOTEBOOK} .pscluster-controls + .pscluster-figure"
# the drawn convergence figure: worker 0's smoothed loss, and the loss axis's type
DRAWN = """div => { const t = div.data.find(t => t.name === 'worker 0 (smoothed)');
    return { y: Array.from(t.y).slice(0, 50), axis: div._fullLayout.yaxis.type }; }"""


@pytest.fixture(scope="module")
def executed(home, lab):
    """A notebook that showed a finished async run's dashboard, executed headless, in the lab's files."""
    with RunStore() as store:
        run = Writer(store, "async", step_metrics=True, lr=True)
        for _ in range(8):
            run.write(40)
        store.set_status(run.run_id, "finished")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f"import pscluster\npscluster.open_run({run.run_id}).dashboard()")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    nbformat.write(nb, lab.root / "files" / "finished.ipynb")
    return nb


def image(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def drawn_share(png: bytes) -> float:
    """The share of a screenshot's pixels that are drawn: neither white nor near it."""
    return float((image(png).min(axis=-1) < 235).mean())


def coloured(png: bytes, hex_color: str) -> int:
    """How many of a screenshot's pixels are close to ``hex_color``."""
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(image(png) - rgb).max(axis=-1) <= 20).sum())


def trust(page) -> None:
    """Trust the open notebook, as a user does: the command palette's "Trust Notebook", then the dialog's
    button."""
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input").fill("Trust Notebook")
    page.locator(".lm-CommandPalette-item", has_text="Trust Notebook").first.click()
    page.locator(".jp-Dialog-button.jp-mod-accept").click()


def shut_down_kernels(lab) -> None:
    for kernel in lab.kernels():
        request = urllib.request.Request(f"{lab.url}/api/kernels/{kernel['id']}", method="DELETE",
                                         headers={"Authorization": f"token {lab.token}"})
        urllib.request.urlopen(request, timeout=60).close()
    assert not lab.kernels()


def changes_the_curve(page, figure, control, before: dict, key: str) -> dict:
    """Work ``control`` (a function of the page), then wait until the figure's ``key`` (DRAWN) differs from
    ``before``; returns what is drawn then."""
    control()
    page.wait_for_function(f"([div, before]) => JSON.stringify(({DRAWN})(div).{key}) !== JSON.stringify(before)",
                           arg=[figure.element_handle(), before[key]], timeout=10_000)
    return figure.evaluate(DRAWN)


def test_an_untrusted_notebook_shows_every_figure_and_trusted_its_controls_work_without_a_kernel(
        page, lab, executed):
    REPORTS.mkdir(exist_ok=True)
    open_notebook(page, "finished.ipynb")
    stills = page.locator(f"{NOTEBOOK} img.pscluster-still")
    stills.nth(FIGURES - 1).wait_for(timeout=30_000)
    assert stills.count() == FIGURES
    assert page.locator(f"{NOTEBOOK} .js-plotly-plot").count() == 0  # untrusted: no script ran
    for i in range(FIGURES):
        shot = stills.nth(i).screenshot()
        assert stills.nth(i).evaluate("img => img.complete && img.naturalWidth") > 0
        assert drawn_share(shot) > 0.02, f"figure {i} is blank"
    convergence_still = stills.nth(2).screenshot()
    assert coloured(convergence_still, color(0)) > 50 and coloured(convergence_still, color(1)) > 50  # both workers
    page.screenshot(path=str(REPORTS / "untrusted_figures.png"), full_page=True)

    trust(page)
    plots = page.locator(f"{NOTEBOOK} .pscluster-figure.js-plotly-plot")
    plots.nth(FIGURES - 1).wait_for(timeout=30_000)
    assert stills.count() == 0  # each image gave way to its drawn figure
    shut_down_kernels(lab)  # what follows is the page's alone
    figure = page.locator(CONVERGENCE)
    before = figure.evaluate(DRAWN)
    shot = figure.screenshot()
    slider = page.locator(f"{NOTEBOOK} .pscluster-controls input[type=range]")
    smoother = changes_the_curve(page, figure, lambda: slider.evaluate(
        "s => { s.value = '0.99'; s.dispatchEvent(new Event('input')); }"), before, "y")
    assert np.std(np.diff(smoother["y"][5:])) < np.std(np.diff(before["y"][5:]))  # smoother indeed
    logged = changes_the_curve(page, figure, lambda: page.locator(
        f"{NOTEBOOK} .pscluster-controls input[type=checkbox]").check(), smoother, "axis")
    assert logged["axis"] == "log"
    assert figure.screenshot() != shot
    page.screenshot(path=str(REPORTS / "finished_controls.png"), full_page=True)


def test_the_html_report_draws_every_figure_with_its_controls(page, executed, tmp_path):
    report, _ = HTMLExporter(preprocessors=[InlinePlotly]).from_notebook_node(executed)
    path = tmp_path / "report.html"
    path.write_text(report)
    page.goto(path.as_uri())
    plots = page.locator(".pscluster-figure.js-plotly-plot")
    plots.nth(FIGURES - 1).wait_for(timeout=30_000)
    assert plots.count() == FIGURES
    figure = page.locator(".pscluster-controls + .pscluster-figure")
    before = figure.evaluate(DRAWN)
    logged = changes_the_curve(page, figure, lambda: page.locator(".pscluster-controls input[type=checkbox]").check(),
                               before, "axis")
    assert logged["axis"] == "log"
