"""Every bundled notebook runs headless (nbclient) in its small smoke size."""

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from pscluster.widgets import live

pytestmark = pytest.mark.notebook
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute(name: str, report_dir: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    os.environ.update(PSCLUSTER_SMOKE="1", PSCLUSTER_REPORT_DIR=str(report_dir))
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        for key in ("PSCLUSTER_SMOKE", "PSCLUSTER_REPORT_DIR"):
            os.environ.pop(key, None)
    return nb


def test_committed_notebooks_have_no_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name


def report_html(nb) -> str:
    """The HTML report of an executed notebook, as ``make demo`` exports it: without widget state
    (``--ExecutePreprocessor.store_widget_state=False``), so each output's static HTML is what shows."""
    from nbconvert import HTMLExporter

    from pscluster.report import InlinePlotly

    nb = nbformat.from_dict(nb)
    nb.metadata.pop("widgets", None)
    return HTMLExporter(preprocessors=[InlinePlotly]).from_notebook_node(nb)[0]


def test_quickstart_runs_and_reports_both_runs(tmp_path):
    nb = execute("01_quickstart", tmp_path)
    # saved with its widget state (as nbconvert --to notebook does), the executed notebook stays small:
    # no plotly.js in the figures' state or outputs
    nbformat.write(nb, tmp_path / "executed.ipynb")
    assert (tmp_path / "executed.ipynb").stat().st_size <= 2_000_000
    assert nb.metadata.get("widgets") and "plotly.js v" not in (tmp_path / "executed.ipynb").read_text()
    assert report_html(nb).count("* plotly.js v") == 1
    report = json.loads((tmp_path / "01_quickstart.json").read_text())
    assert [r["mode"] for r in report["runs"]] == ["sync", "async"]
    for run in report["runs"]:
        for key in ("mode", "ps", "workers", "global_step", "local_steps", "test_accuracy",
                    "samples_per_sec", "wall_s"):
            assert run[key] is not None, key
        assert run["ps"] == 1 and run["workers"] == 2 and len(run["local_steps"]) == 2
        assert run["global_step"] == run["steps"]
    sync = report["runs"][0]
    assert sync["local_steps"] == [sync["global_step"]] * 2  # 2 workers, replicas_to_aggregate=2
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "training steps (" in text and "global steps), loss" in text


def static_figures(nb) -> list[dict]:
    """Every static pscluster figure (its ``data`` and ``layout``) in the executed notebook's HTML outputs."""
    decoder = json.JSONDecoder()
    figures = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            html = output.get("data", {}).get("text/html", "")
            start = 0
            while (at := html.find(live.STATIC_CALL, start)) >= 0:
                figure, end = decoder.raw_decode(html, at + len(live.STATIC_CALL))
                figures.append(figure)
                start = end
    return figures


def plotly_figures(nb) -> list[list[dict]]:
    """The trace lists of every static pscluster figure in the executed notebook's HTML outputs."""
    return [figure["data"] for figure in static_figures(nb)]


def test_sync_vs_async_shows_static_figures_per_worker(tmp_path):
    nb = execute("02_sync_vs_async", tmp_path)
    figures = plotly_figures(nb)
    assert figures, "no static plotly figure in the executed notebook"
    per_worker = [f for f in figures if {"worker 0", "worker 1"} <= {t.get("name") for t in f}]
    assert len(per_worker) >= 2  # the two-worker runs' convergence (and speed) figures
    for traces in per_worker:
        for name in ("worker 0", "worker 1"):
            trace = next(t for t in traces if t.get("name") == name)
            assert len(trace.get("x", [])) > 0 and len(trace.get("y", [])) > 0
    assert report_html(nb).count("* plotly.js v") == 1  # the library is embedded once per report: offline


def test_placement_and_embeddings_compares_placements_and_shows_shards(tmp_path):
    nb = execute("03_placement_and_embeddings", tmp_path)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    tasks = set(re.findall(r"embedding\.weight/part_\d: /job:ps/task:(\d) \(rows", text))
    assert tasks == {"0", "1"}  # the sparse table, split across both ps tasks
    assert "Warning" not in text
    assert "median bytes moved per worker step" in text
    html = "".join(o.get("data", {}).get("text/html", "") for c in nb.cells for o in c.get("outputs", []))
    assert "test AUC" in html and "max / mean" in html
    figures = plotly_figures(nb)
    placement = [f for f in figures if any(t.get("type") == "bar" and "ps:1" in (t.get("x") or []) for t in f)]
    assert placement, "no placement figure with both ps tasks"
    assert report_html(nb).count("* plotly.js v") == 1


def test_fault_tolerance_recovers_from_a_lost_worker_and_a_lost_ps(tmp_path):
    execute("04_fault_tolerance", tmp_path)
    report = json.loads((tmp_path / "04_fault_tolerance.json").read_text())
    assert report["status"] == "finished" and report["global_step"] == report["steps"]
    assert report["lost"] == ["worker:1", "ps:1"]
    # each lost task got a new engine (and so did a worker that had not ended when the ps restart began)
    assert report["replaced"][:2] == ["worker:1", "ps:1"] and set(report["replaced"]) == {"worker:1", "ps:1"}
    # every ps rolled back to one committed checkpoint, and the global step went on from there
    # the newest state there is (the survivors' shards, the workers' copies): a few steps from the loss
    assert 0 < report["rolled_back_to"] and abs(report["rolled_back_to"] - report["lost_at"]) <= 10
    assert report["resumed_at"] == report["rolled_back_to"] + 1
    assert report["restored_step"] == report["steps"] and report["restored_ps"] == 3
    assert report["restored_global_step"] > report["steps"]
    assert report["export_accuracy"] > 0.8
    # scaled from 1 to 3 workers during a run, then stopped: every ps on one step, and checkpointed there
    assert report["scaled_workers"] == 3 and report["scaled_status"] == "stopped"
    assert report["scaled_checkpoint_step"] == report["scaled_stop_step"] > 100


def test_multi_node_runs_its_local_part_on_loopback_ports_of_the_range(tmp_path):
    nb = execute("05_multi_node", tmp_path)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    addresses = re.findall(r"tcp://([\d.]+):(\d+)", text)
    assert len(addresses) >= 6  # 2 ps and the collector, then the same ps and the second cluster's
    assert all(host == "127.0.0.1" and 42500 <= int(port) <= 42599 for host, port in addresses)
    second = text.split("second:")[1]
    assert not set(re.findall(r":(\d+)'", second)) & set(re.findall(r":(\d+)'", text.split("second:")[0]))
    assert "global step 100" in text


def test_your_model_trains_with_a_dataloader_a_schedule_and_a_step_fn(tmp_path):
    import base64

    import numpy as np

    nb = execute("06_your_model", tmp_path)
    report = json.loads((tmp_path / "06_your_model.json").read_text())
    cnn, two = report["runs"]
    assert [cnn["name"], two["name"]] == ["bn-cnn", "two-tower"]
    for run in (cnn, two):
        assert run["status"] == "finished" and run["global_step"] == run["steps"] == report["steps"], run
        assert run["final_lr"] is not None and run["final_lr"] > 0, run["name"]
    # the BatchNorm CNN: its state_dict holds the running statistics, and loads strictly into a fresh model
    assert cnn["strict_load"]
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= set(cnn["state_dict_keys"])
    assert cnn["num_batches_tracked"] == cnn["steps"]  # buffers="chief": worker 0's, one batch per global step
    assert 0 <= cnn["test_accuracy"] <= 1
    # the step_fn run: its metrics are columns of run.metrics(), and run.evaluate() averages them
    assert {"error_rate", "margin"} <= set(two["metric_columns"])
    assert 0 <= two["test_error_rate"] <= 1 and two["test_margin"] is not None
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert re.search(r"global steps\), loss [\d.]+, error_rate [\d.e-]+, margin ", text), "no line with the metrics"
    assert "(buffer)" in text and "All keys matched successfully" in text

    # the dashboards' static convergence figures (traces and layout of each): the learning rate, and the metrics
    def values(data):  # a plotly array: a list, or a typed array {"dtype": "f8", "bdata": base64}
        if isinstance(data, dict):
            return np.frombuffer(base64.b64decode(data["bdata"]), dtype=data["dtype"]).tolist()
        return list(data)

    convergence = [(f["data"], f["layout"]) for f in static_figures(nb)
                   if any(t.get("name") == "learning rate (ps 0)" for t in f["data"])]
    assert len(convergence) == 2, "one convergence figure with the learning rate per run"
    for traces, _ in convergence:
        lr = values(next(t for t in traces if t.get("name") == "learning rate (ps 0)")["y"])
        assert lr and all(v > 0 for v in lr), lr
    traces, layout = convergence[1]  # the step_fn run's
    titles = {"y" + key[len("yaxis"):]: (value.get("title") or {}).get("text")
              for key, value in layout.items() if key.startswith("yaxis")}
    for metric in ("error_rate", "margin"):
        axis = next(a for a, title in titles.items() if title == metric)
        plotted = [t for t in traces if t.get("yaxis") == axis and t.get("name", "").startswith("worker")]
        assert {t["name"] for t in plotted} >= {"worker 0", "worker 1"}, metric
        assert all(values(t["y"]) for t in plotted), metric


def test_your_loop_runs_a_function_a_cell_and_a_session(tmp_path):
    execute("07_your_loop", tmp_path)
    report = json.loads((tmp_path / "07_your_loop.json").read_text())
    loop, early, session = report["runs"]
    assert [r["name"] for r in report["runs"]] == ["your-loop", "early-stop", "session"]
    assert loop["status"] == "finished" and loop["global_step"] == report["loop_steps"]
    assert {"accuracy", "lr"} <= set(loop["metric_columns"])  # ctx.log's numbers, columns of run.metrics()
    assert early["status"] == "finished" and report["stop_reason"].startswith("test accuracy")
    assert early["global_step"] < report["early_steps"]  # the chief's request_stop ended it early
    history = report["session_history"]
    assert session["status"] == "finished" and session["global_step"] == history[-1]["global_step"]
    assert [h["lr"] for h in history] == sorted((h["lr"] for h in history), reverse=True)  # only ever lowered
