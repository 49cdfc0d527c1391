"""The side panel in a real JupyterLab. A notebook in the page starts a cluster and a run with the
magics and shows the run's live dashboard; the panel lists the cluster's roles and the run, shows its
global step advancing, stops the run, then the cluster (each after a confirmation); hidden, it asks the
server nothing. A restarted server lists again a cluster that kept running in another process, with
the runs of that cluster's own store."""

import json
import re
import time
from pathlib import Path

import nbformat
import psutil
import pytest
import torch
from playwright.sync_api import TimeoutError as PlaywrightTimeout

import pscluster

pytestmark = pytest.mark.browser

TAB = '.jp-SideBar.jp-mod-left .lm-TabBar-tab[data-id="pscluster-panel"]'
PANEL = "#pscluster-panel"
NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden)"
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "reports" / "side_panel.png"
CELLS = [
    "%load_ext pscluster\nimport torch\nimport pscluster",
    "%pscluster start --ps 1 --workers 2 --name lab-demo",
    "%%pscluster train --mode sync --steps 1000000 --batch-size 64 --lr 0.1 --log-every 100000 --name digits-mlp\n"
    "model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n"
    "loss_fn = torch.nn.CrossEntropyLoss()\n"
    "dataset = pscluster.datasets.digits('train')",
]


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def open_panel(page):
    """Open the side panel, widened for the screenshot; returns its locator."""
    page.locator(TAB).click()
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle").first.bounding_box()
    page.mouse.move(handle["x"] + 1, handle["y"] + 200)
    page.mouse.down()
    page.mouse.move(handle["x"] + 160, handle["y"] + 200, steps=5)
    page.mouse.up()
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
    return [tasks.nth(i).locator("td").nth(0).inner_text() for i in range(tasks.count())]


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
    page.locator(".jp-DirListing-itemText", has_text="train_digits.ipynb").dblclick()
    notebook = page.locator(NOTEBOOK)
    notebook.wait_for()
    eventually(lambda: any(k["execution_state"] == "idle" and k["connections"] for k in lab.kernels()), 90)
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
    panel = open_panel(page)

    assert role_rows(panel, "lab-demo") == ["ps", "chief", "worker"]
    cluster = panel.locator('.jp-pscluster-cluster[data-name="lab-demo"]')
    assert cluster.locator(".jp-pscluster-restart").count() == 3  # one per role row
    assert set(cluster.locator(".jp-pscluster-task").first.locator("td").all_inner_texts()) >= {
        "127.0.0.1", "cpu", "running"}
    row = panel.locator(".jp-pscluster-run", has_text="digits-mlp")
    row.get_by_text("training").wait_for(timeout=60_000)
    first = global_step(row)
    eventually(lambda: global_step(row) > first)
    row.locator(".jp-pscluster-sparkline path").wait_for()

    dashboard = notebook.locator(".jp-OutputArea-output", has=page.locator(".js-plotly-plot"))
    dashboard.locator(".js-plotly-plot").nth(2).wait_for(timeout=120_000)  # ipywidgets + plotly render
    header = dashboard.locator(".widget-html").first  # run name, mode, status, global step...
    header.get_by_text("training", exact=True).wait_for()
    dashboard.scroll_into_view_if_needed()
    page.wait_for_timeout(1500)  # a few live updates of the dashboard
    SCREENSHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))

    row.locator(".jp-pscluster-stop-run").click()
    confirm(page, "Stop run digits-mlp?")
    row.get_by_text("stopped").wait_for(timeout=60_000)
    header.get_by_text("stopped", exact=True).wait_for(timeout=30_000)  # the notebook's dashboard saw it too

    row.locator(".jp-pscluster-run-name").click()  # the run's view in the main area
    view = page.locator(f'.jp-pscluster-runview[data-run-id="{row.get_attribute("data-run-id")}"]')
    view.locator(".jp-pscluster-chart").nth(1).wait_for()
    view.locator('[data-status="stopped"]').wait_for()

    page.locator(TAB).click()  # hidden: no polling
    page.wait_for_timeout(500)
    assert api_requests(page, 3) == []
    page.locator(TAB).click()
    assert api_requests(page, 3), "the visible panel stopped refreshing"

    entry = json.loads((home / "clusters" / "lab-demo.json").read_text())
    kernel = psutil.Process(entry["owner_pid"])
    assert {t["pid"] for t in entry["tasks"]} <= {p.pid for p in kernel.children(recursive=True)}
    cluster.locator(".jp-pscluster-stop").click()
    confirm(page, "Stop cluster lab-demo?")
    panel.get_by_text("No cluster running").wait_for(timeout=60_000)
    eventually(lambda: not kernel.children(recursive=True))  # every engine, the controller, the reaper


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
