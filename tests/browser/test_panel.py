"""The side panel in a real JupyterLab: a cluster and a run started from the Python API show up,
the run's global step advances, the panel stops it; hidden, the panel asks the server nothing."""

import re
import time
from pathlib import Path

import pytest
import torch

import pscluster

pytestmark = pytest.mark.browser

TAB = '.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="pscluster-panel"]'
PANEL = "#pscluster-panel"
SCREENSHOT = Path(__file__).resolve().parents[2] / "reports" / "side_panel.png"


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def global_step(row) -> int:
    return int(re.match(r"\d+", row.locator(".jp-pscluster-run-step").inner_text()).group())


def api_requests(page, seconds: float) -> list[str]:
    seen = []

    def listener(request):
        seen.append(request)

    page.on("request", listener)
    page.wait_for_timeout(seconds * 1000)
    page.remove_listener("request", listener)
    return [r.url for r in seen if "/pscluster/api/" in r.url]


def test_panel_shows_a_cluster_and_its_run_and_stops_the_run(page, home):
    page.locator(TAB).click()
    panel = page.locator(PANEL)
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle").first.bounding_box()
    page.mouse.move(handle["x"] + 1, handle["y"] + 200)  # a wider side panel for the screenshot
    page.mouse.down()
    page.mouse.move(handle["x"] + 160, handle["y"] + 200, steps=5)
    page.mouse.up()
    panel.get_by_text("No cluster running").wait_for()
    panel.get_by_text("No run store yet").wait_for()

    with pscluster.Cluster(ps=1, workers=2) as cluster:
        run = cluster.train(mlp, pscluster.datasets.digits("train"), torch.nn.CrossEntropyLoss(), steps=100_000,
                            lr=0.1, log_every=100_000, name="panel-run")
        tasks = panel.locator(f'.jp-pscluster-cluster[data-name="{cluster.name}"] .jp-pscluster-task')
        tasks.first.wait_for(timeout=30_000)
        assert [tasks.nth(i).locator("td").nth(0).inner_text() for i in range(tasks.count())] == [
            "ps", "chief", "worker"]
        assert set(tasks.nth(0).locator("td").all_inner_texts()) >= {"127.0.0.1", "cpu", "running"}

        row = panel.locator(f'.jp-pscluster-run[data-run-id="{run.id}"]')
        row.get_by_text("training").wait_for(timeout=30_000)
        first = global_step(row)
        deadline = time.monotonic() + 30
        while global_step(row) <= first and time.monotonic() < deadline:
            page.wait_for_timeout(300)
        assert global_step(row) > first, "the global step shown did not advance"
        row.locator(".jp-pscluster-sparkline path").wait_for()

        row.locator(".jp-pscluster-run-name").click()  # the run's view in the main area, live
        view = page.locator(f"#pscluster-run-{run.id}")
        view.locator(".jp-pscluster-chart").nth(1).wait_for()
        assert view.get_by_text("Convergence: loss by global step").is_visible()
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT))

        row.locator(".jp-pscluster-stop-run").click()
        page.locator(".jp-Dialog").get_by_text(f"Stop run {run.name}?").wait_for()
        page.locator(".jp-Dialog .jp-mod-accept").click()
        row.get_by_text("stopped").wait_for(timeout=60_000)
        assert run.status == "stopped"  # the kernel's own Run object saw it
        view.locator('[data-status="stopped"]').wait_for(timeout=10_000)

        page.locator(TAB).click()  # hidden: no polling
        page.wait_for_timeout(500)
        assert api_requests(page, 4) == []
        page.locator(TAB).click()
        assert api_requests(page, 4), "the visible panel stopped refreshing"
