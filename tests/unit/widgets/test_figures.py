"""The dashboard's figures, from small hand-made DataFrames shaped like the run store's answers."""

import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from pscluster.metrics import speed
from pscluster.metrics.store import RunStore
from pscluster.footprint import optimizer_slot_names, optimizer_slots
from pscluster.widgets import figure_specs, figures, panels, task_table
from pscluster.widgets.series import Decimated, Ewm

RATES = {0: 20.0, 1: 10.0, 2: 16.0}  # steps/s of each worker: worker 1 is the slowest
STEPS = 30


def make_metrics(rates=RATES, steps=STEPS, t0=1000.0) -> pd.DataFrame:
    """One row per local step of each worker, at its steady rate; staleness cycles 0, 1, 2, 3."""
    rows = []
    for w, rate in rates.items():
        for i in range(1, steps + 1):
            rows.append(dict(worker=w, time=t0 + i / rate, local_step=i, global_step=len(rates) * i + w,
                             loss=2.0 / i, accuracy=min(1.0, i / steps), compute_s=0.01, wait_s=0.0,
                             comm_s=0.001, bytes_sent=100, bytes_received=100, staleness=i % 4,
                             dropped=int(i % 10 == 0)))
    return pd.DataFrame(rows).sort_values("time", ignore_index=True)


def make_ps_metrics(t0=1000.0) -> pd.DataFrame:
    """Two ps tasks sampled at 0.5 s: ps 0 moves 1000 bytes/s more each sample, ps 1 is restarted last."""
    rows = []
    for ps in (0, 1):
        for k in range(6):
            restarted = ps == 1 and k == 5
            rows.append(dict(ps=ps, time=t0 + 0.5 * k + 0.01 * ps, step=10 * k, pushes=0 if restarted else 20 * k,
                             pulls=0 if restarted else 2 * k, applied=10 * k, dropped_stale=k // 2, late=0,
                             bytes_in=0 if restarted else 1000 * k * k, bytes_out=0 if restarted else 500 * k,
                             waiting_for=[1] if k == 5 else ([0, 1] if k % 2 else [])))
    return pd.DataFrame(rows).sort_values("time", ignore_index=True)


PLACEMENT = pd.DataFrame({"variable": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], "ps": [0, 1, 0, 1],
                          "shape": [(32, 64), (32,), (10, 32), (10,)], "dtype": ["float32"] * 4,
                          "bytes": [8192, 128, 1280, 40]})


def names(fig) -> list[str]:
    return [t.name for t in fig.data]


def no_data(fig) -> bool:
    return [a.text for a in fig.layout.annotations] == ["no data yet"]


def test_convergence_has_raw_and_smoothed_traces_per_worker_and_the_test_set():
    metrics = make_metrics()
    evaluations = pd.DataFrame({"global_step": [30, 60, 90], "time": [1, 2, 3], "loss": [1.0, 0.5, 0.3],
                                "accuracy": [0.5, 0.7, 0.9]})
    fig = figures.convergence_figure(metrics, evaluations)
    for w in RATES:  # loss and accuracy: one raw and one smoothed line each
        assert names(fig).count(f"worker {w}") == 2
        assert names(fig).count(f"worker {w} (smoothed)") == 2
    raw = next(t for t in fig.data if t.name == "worker 1" and t.yaxis == "y")
    assert len(raw.x) == STEPS and list(raw.x) == sorted(raw.x)
    assert names(fig).count("test set") == 2
    assert [t.yaxis for t in fig.data if t.name == "test set"] == ["y", "y2"]
    assert go.Figure(fig).layout.template.layout.paper_bgcolor == "white" and fig.layout.height >= 300
    assert "test set" not in names(figures.convergence_figure(metrics, evaluations.iloc[:0]))


def test_convergence_smooths_with_a_moving_average():
    fig = figures.convergence_figure(make_metrics({0: 10.0}))
    raw, smooth = fig.data[0].y, fig.data[1].y
    assert smooth[0] == raw[0] and np.all(np.diff(smooth) < 0)  # a falling loss stays falling
    assert smooth[-1] > raw[-1]  # and lags behind it


def step_metrics_run(store: RunStore) -> int:
    """A run whose step_fn reports ``error_rate`` and ``logit_scale`` and whose model has no class logits
    (accuracy None): worker w reports local step i (1..40) at global step 2 i + w. ps 0 samples every 4 global
    steps a learning rate that halves every 20; ps 1 reports another one, which the figure leaves out."""
    run = store.create_run(name="r", cluster="c", mode="sync", config={}, spec={})
    store.add_batch(run, [{"kind": "step", "task": f"worker:{w}", "time": 1000.0 + i + 0.1 * w, "local_step": i,
                           "global_step": 2 * i + w, "loss": 1.0 / i, "accuracy": None,
                           "metrics": {"error_rate": 0.5 / i, "logit_scale": 10.0 * (w + 1)}}
                          for i in range(1, 41) for w in (0, 1)])
    store.add_batch(run, [{"kind": "ps", "task": f"ps:{ps}", "time": 1000.0 + k, "step": 4 * k, "waiting_for": [],
                           "lr": 0.1 * 0.5 ** (4 * k // 20) if ps == 0 else 99.0} for k in range(21) for ps in (0, 1)])
    return run


def trace(fig, name: str, yaxis: str):
    return next(t for t in fig.data if t.name == name and t.yaxis == yaxis)


def test_convergence_stacks_the_step_metrics_and_the_learning_rate_under_the_loss(tmp_path):
    with RunStore(tmp_path / "runs.sqlite") as store:
        run = step_metrics_run(store)
        metrics, ps_metrics = store.metrics(run), store.ps_metrics(run)
    fig = figures.convergence_figure(metrics, None, None, ps_metrics)
    layout = go.Figure(fig.to_dict()).to_dict()["layout"]  # validated: nested as the browser gets it
    axes = [layout[k] for k in ("yaxis", "yaxis2", "yaxis3", "yaxis4")]
    assert [a["title"]["text"] for a in axes] == ["loss", "error_rate", "logit_scale", "lr"]  # no accuracy plot
    assert "yaxis5" not in layout and layout["xaxis"]["anchor"] == "y4"  # the global step under the lowest
    assert layout["title"]["text"] == "convergence: loss, error_rate, logit_scale and learning rate against global step"
    tops, bottoms = [a["domain"][1] for a in axes], [a["domain"][0] for a in axes]
    assert tops[0] == 1 and bottoms[-1] == 0 and all(b > t for b, t in zip(bottoms, tops[1:]))  # stacked, apart
    heights = np.subtract(tops, bottoms)
    assert heights[3] == pytest.approx(heights[0] / 2, abs=0.01) and np.ptp(heights[:3]) < 0.01
    assert layout["height"] > figure_specs.HEIGHT + 60  # taller than loss and accuracy alone
    i = np.arange(1, 41)
    for w in (0, 1):  # each metric like the loss: every worker raw and smoothed, in its legend group
        raw, smoothed = trace(fig, f"worker {w}", "y2"), trace(fig, f"worker {w} (smoothed)", "y2")
        np.testing.assert_array_equal(raw.x, 2 * i + w)
        np.testing.assert_allclose(raw.y, 0.5 / i)
        np.testing.assert_allclose(smoothed.y, pd.Series(0.5 / i).ewm(span=figures.SMOOTH_SPAN).mean())
        np.testing.assert_allclose(trace(fig, f"worker {w}", "y3").y, 10.0 * (w + 1))
        assert raw.legendgroup == f"worker {w}" and not raw.showlegend
        assert trace(fig, f"worker {w}", "y").showlegend  # the legend entries are the loss's
    lr = trace(fig, "learning rate (ps 0)", "y4")
    np.testing.assert_array_equal(lr.x, 4 * np.arange(21))
    np.testing.assert_allclose(lr.y, 0.1 * 0.5 ** (4 * np.arange(21) // 20))
    assert lr.line.width < 2 and not lr.showlegend


def test_convergence_of_a_model_without_accuracy_shows_the_loss_alone():
    for accuracy in (np.nan, None):  # None: what a store gives for a column that is NULL throughout
        metrics = make_metrics().assign(accuracy=accuracy)
        fig = figures.convergence_figure(metrics, None, None, make_ps_metrics())  # samples without lr
        assert {t.yaxis for t in fig.data} == {"y"} and len(fig.data) == 2 * len(RATES)
        assert "yaxis2" not in fig.to_dict()["layout"] and fig.layout.xaxis.anchor == "y"
        assert fig.layout.title.text == "convergence: loss against global step"
        assert fig.layout.height == figure_specs.HEIGHT
    evaluations = pd.DataFrame({"global_step": [30], "time": [1], "loss": [0.5], "accuracy": [None]})
    fig = figures.convergence_figure(make_metrics().assign(accuracy=np.nan), evaluations)
    assert [t.yaxis for t in fig.data if t.name == "test set"] == ["y"]


def test_a_metric_that_comes_later_or_from_one_worker_is_drawn_the_same_live_and_at_once():
    metrics = make_metrics({0: 10.0, 1: 10.0})  # 30 steps each, 1000.1 s to 1003 s
    metrics["grad_norm"] = np.where((metrics["worker"] == 0) & (metrics["time"] > 1001.5), metrics["time"], np.nan)
    metrics.loc[metrics.index[:10], "accuracy"] = np.nan  # accuracy from the 6th step on
    whole = panels.Convergence()
    whole.feed({"metrics": figure_specs.rows(metrics)})
    live = panels.Convergence()
    for chunk in np.array_split(np.arange(len(metrics)), 7):
        new = figure_specs.rows(metrics.iloc[chunk])
        if np.isnan(new["grad_norm"]).all():  # as the dashboard reads them: a chunk without it has no column
            del new["grad_norm"]
        live.feed({"metrics": new})
    assert live.rows() == whole.rows() == ["loss", "accuracy", "grad_norm"]
    a, b = live.spec(), whole.spec()
    assert a.layout == b.layout and len(a.traces) == len(b.traces) == 2 * 2 + 2 * 3  # worker 1 has no grad_norm
    for x, y in zip(a.traces, b.traces):
        assert x.keys() == y.keys() and x["name"] == y["name"] and x["yaxis"] == y["yaxis"]
        for key in ("x", "y"):
            np.testing.assert_array_equal(x[key], y[key])
    grad_norm = [t for t in b.traces if t["yaxis"] == "y3"]
    assert [t["name"] for t in grad_norm] == ["worker 0", "worker 0 (smoothed)"]
    assert np.isnan(grad_norm[0]["y"][:15]).all() and np.isfinite(grad_norm[0]["y"][15:]).all()


def test_four_step_metrics_or_more_are_counted_in_the_title():
    metrics = make_metrics().assign(a=1.0, b=2.0, c=3.0, d=4.0)
    fig = go.Figure(figures.convergence_figure(metrics).to_dict())
    assert fig.layout.title.text == "convergence: loss, accuracy and 4 step metrics against global step"
    assert [fig.layout[f"yaxis{i}"].title.text for i in range(2, 7)] == ["accuracy", "a", "b", "c", "d"]


def test_long_runs_are_thinned_but_keep_their_last_point():
    fig = figures.convergence_figure(make_metrics({0: 100.0}, steps=5 * figure_specs.MAX_POINTS))
    x = fig.data[0].x
    assert len(x) <= figure_specs.MAX_POINTS + 1 and x[-1] == 5 * figure_specs.MAX_POINTS


def test_thinned_series_keep_the_same_points_however_they_come():
    whole = Decimated("i", "twice", cap=100)
    whole.extend(i=np.arange(1000), twice=2 * np.arange(1000))
    parts = Decimated("i", "twice", cap=100)
    for chunk in np.array_split(np.arange(1000), 37):
        parts.extend(i=chunk, twice=2 * chunk)
    np.testing.assert_array_equal(whole["i"], parts["i"])
    np.testing.assert_array_equal(whole["twice"], 2 * whole["i"])
    assert len(whole) <= 101 and whole["i"][-1] == 999  # the newest point is always there
    assert set(np.diff(whole["i"][:-1])) == {whole.stride}  # evenly spaced


def test_moving_average_goes_on_from_chunk_to_chunk_like_pandas():
    values = np.random.default_rng(0).normal(size=500)
    values[[0, 1, 57, 58, 300]] = np.nan
    ewm = Ewm(figures.SMOOTH_SPAN)
    chunked = np.concatenate([ewm.update(chunk) for chunk in np.array_split(values, 9)])
    expected = pd.Series(values).ewm(span=figures.SMOOTH_SPAN, min_periods=1).mean().to_numpy()
    np.testing.assert_allclose(chunked, expected, equal_nan=True)


def test_convergence_marks_run_events_at_their_global_steps(tmp_path):
    with RunStore(tmp_path / "runs.sqlite") as store:
        run = store.create_run(name="r", cluster="c", mode="sync", config={}, spec={})
        t0 = 1000.0  # worker w reports local step i at t0 + i + 0.1 w, global step 2 i + w
        store.add_batch(run, [{"kind": "step", "task": f"worker:{w}", "time": t0 + i + 0.1 * w, "local_step": i,
                               "global_step": 2 * i + w, "loss": 1.0 / i, "accuracy": 0.5}
                              for i in range(1, 21) for w in (0, 1)])
        for task, kind, t, detail in [
                ("worker:0", "state", t0, {"state": "training"}),  # not marked
                ("controller", "checkpoint", t0 + 5.5, {"step": 10, "path": "ckpt/10"}),
                ("worker:1", "lost", t0 + 7.5, {"pid": 1}),  # the last row before: worker 1's step 7
                ("worker:1", "replaced", t0 + 9.05, {"pid": 2}),  # worker 0's step 9
                ("worker:0", "restored", t0 + 12.0, {"step": 10, "path": "ckpt/10"}),
                ("controller", "checkpoint", t0 + 15.5, {"step": 20, "path": "ckpt/20"})]:
            store.add_batch(run, [{"kind": kind, "task": task, "time": t, **detail}])
        fig = figures.convergence_figure(store.metrics(run), store.evaluations(run), store.events(run))
    marks = [(m.x0, m.x1, m.name, m.label.text, m.showlegend) for m in fig.layout.shapes]
    assert marks == [(10, 10, "checkpoint", "", True), (15, 15, "task lost", "worker:1 lost", True),
                     (18, 18, "task replaced", "worker:1 replaced", True),
                     (10, 10, "restored from a checkpoint", "restored step 10", True),
                     (20, 20, "checkpoint", "", False)]
    assert all((m.xref, m.yref, m.y0, m.y1) == ("x", "paper", 0, 1) for m in fig.layout.shapes)
    assert fig.layout.shapes[1].line.dash == "dash" and fig.layout.shapes[0].line.dash == "dot"
    go.Figure(fig.to_dict())  # valid


def test_a_mark_moves_to_its_step_once_the_rows_after_its_event_are_in():
    convergence, metrics = panels.Convergence(), make_metrics({0: 10.0})  # step i at 1000 + i / 10
    lost = pd.DataFrame({"time": [1001.55], "task": ["worker:0"], "kind": ["lost"], "detail": [{}]})
    convergence.feed({"metrics": figure_specs.rows(metrics.iloc[:10])})
    convergence.feed({"events": figure_specs.rows(lost)})
    assert convergence.spec().layout["shapes"][0]["x0"] == 10  # the latest step so far
    convergence.feed({"metrics": figure_specs.rows(metrics.iloc[10:])})
    assert convergence.spec().layout["shapes"][0]["x0"] == 15


def test_speed_highlights_the_slowest_worker():
    fig = figures.speed_figure(make_metrics(), start=1000.0)
    assert names(fig) == ["worker 0", "worker 1 (slowest)", "worker 2"]
    widths = {t.name: t.line.width for t in fig.data}
    assert widths["worker 1 (slowest)"] > widths["worker 0"] == widths["worker 2"]
    assert "slowest: worker 1 (10.0 steps/s)" in fig.layout.title.text
    for trace, rate in zip(fig.data, RATES.values()):
        np.testing.assert_allclose(trace.y, rate, rtol=1e-6)
        assert trace.x[0] > 0  # seconds since the start


def test_speed_of_a_single_worker_has_no_slowest():
    assert names(figures.speed_figure(make_metrics({3: 5.0}))) == ["worker 3"]


def test_steps_per_second_over_the_run_or_lately():
    metrics = make_metrics(steps=200)  # worker 0 ends at 10 s, worker 2 at 12.5 s, worker 1 at 20 s
    np.testing.assert_allclose(figures.steps_per_second(metrics).to_numpy(), list(RATES.values()))
    # without worker 1's rows from 5 s on, the run's last RECENT_S seconds are 7.5 s to 12.5 s: none of them
    cut = metrics[(metrics["worker"] != 1) | (metrics["time"] < 1005.0)]
    recent = figures.steps_per_second(cut, live=True)
    assert math.isnan(recent[1]) and recent[0] == pytest.approx(20.0) and recent[2] == pytest.approx(16.0)


@pytest.mark.parametrize("slots", [0, 1, 2])
def test_placement_stacks_bytes_per_ps_with_optimizer_state(slots):
    fig = figures.placement_figure(PLACEMENT, slots, num_ps=3)
    assert fig.layout.barmode == "stack" and names(fig) == list(PLACEMENT["variable"])
    per_ps = {}
    for trace in fig.data:
        per_ps[trace.x[0]] = per_ps.get(trace.x[0], 0) + trace.y[0]
    assert per_ps == {"ps:0": (8192 + 1280) * (1 + slots), "ps:1": (128 + 40) * (1 + slots)}
    assert list(fig.layout.xaxis.categoryarray) == ["ps:0", "ps:1", "ps:2"]  # the empty ps shows too


def test_placement_lines_are_tf_style():
    assert figures.placement_lines(PLACEMENT) == [
        "fc1.weight: /job:ps/task:0", "fc1.bias: /job:ps/task:1", "fc2.weight: /job:ps/task:0",
        "fc2.bias: /job:ps/task:1"]


SHARDED = pd.DataFrame({"variable": ["emb.weight/part_0", "emb.weight/part_1", "fc.weight", "fc.bias"],
                        "ps": [0, 1, 1, 0], "shape": [(500, 16), (500, 16), (10, 16), (10,)],
                        "dtype": ["float32"] * 4, "bytes": [32000, 32000, 640, 40], "start": [0, 500, 0, 0],
                        "stop": [500, 1000, 10, 10], "part": pd.array([0, 1, None, None], dtype="Int64"),
                        "sparse": [0, 0, 0, 0]})


def test_placement_lines_show_rows_and_size_of_shards():
    assert figures.placement_lines(SHARDED) == [
        "emb.weight/part_0: /job:ps/task:0 (rows 0-499, 31.2 KB)",
        "emb.weight/part_1: /job:ps/task:1 (rows 500-999, 31.2 KB)",
        "fc.weight: /job:ps/task:1", "fc.bias: /job:ps/task:0"]


def ps_totals(moved: dict[int, list[int]], t0=1000.0) -> pd.DataFrame:
    """ps samples whose bytes_in + bytes_out are ``moved[ps]`` (bytes_out a quarter of it)."""
    rows = [dict(ps=ps, time=t0 + 0.5 * k, step=k, pushes=k, pulls=k, applied=k, dropped_stale=0, late=0,
                 bytes_in=total - total // 4, bytes_out=total // 4, waiting_for=[])
            for ps, totals in moved.items() for k, total in enumerate(totals)]
    return pd.DataFrame(rows).sort_values("time", ignore_index=True)


def test_traffic_share_predicted_from_dense_bytes_next_to_measured():
    fig = figures.traffic_share_figure(PLACEMENT, ps_totals({0: [0, 600, 1200], 1: [0, 200, 400]}), num_ps=3)
    predicted, measured = fig.data
    assert names(fig) == ["predicted (dense variable bytes)", "measured (bytes in + out so far)"]
    assert list(predicted.x) == ["ps:0", "ps:1", "ps:2"] and fig.layout.barmode == "group"
    dense = PLACEMENT["bytes"].sum()
    np.testing.assert_allclose(predicted.y, [100 * 9472 / dense, 100 * 168 / dense, 0])
    np.testing.assert_allclose(measured.y, [75, 25, 0])
    assert "sparse" not in fig.layout.title.text


def test_traffic_share_leaves_sparse_variables_out_of_the_prediction_and_names_them():
    sparse = SHARDED.assign(sparse=[1, 1, 0, 0])
    fig = figures.traffic_share_figure(sparse, None)
    predicted, measured = fig.data
    np.testing.assert_allclose(predicted.y, [100 * 40 / 680, 100 * 640 / 680])
    assert np.isnan(measured.y).all()  # nothing measured yet
    assert "not predicted): emb.weight" in fig.layout.title.text


def test_traffic_share_counts_a_restarted_ps_from_zero():
    # ps 1 restarts after 300 bytes: its counter goes down to 0, then rises to 100 again
    fig = figures.traffic_share_figure(PLACEMENT, ps_totals({0: [0, 400], 1: [0, 300, 0, 100]}))
    np.testing.assert_allclose(fig.data[1].y, [50, 50])


def test_staleness_histogram_counts_applied_pushes_only():
    metrics = make_metrics()
    metrics.loc[metrics.index[:5], "staleness"] = np.nan  # pushes without a staleness
    fig = figures.staleness_figure(metrics)
    applied = metrics[(metrics["dropped"] == 0) & metrics["staleness"].notna()]
    expected = applied["staleness"].astype(int).value_counts().sort_index()
    assert list(fig.data[0].x) == list(expected.index) and list(fig.data[0].y) == list(expected)
    assert sum(fig.data[0].y) < len(metrics)
    assert f"max {int(applied['staleness'].max())}" in fig.layout.title.text


def test_far_stale_pushes_go_to_one_tail_bar_and_keep_the_others_readable():
    metrics = make_metrics()  # 90 pushes of staleness 0 to 3, some dropped
    metrics.loc[metrics.index[-1], ["staleness", "dropped"]] = [343, 0]
    fig = figures.staleness_figure(metrics)
    bars, tail = fig.data
    assert list(bars.x) == [0, 1, 2, 3] and (tail.name, list(tail.x), list(tail.y)) == ("≥ 4", [4], [1])
    assert "max 343" in fig.layout.title.text and fig.layout.xaxis.dtick == 1
    metrics.loc[metrics.index[-1], "staleness"] = 5  # not far out: drawn as it is
    assert [t.name for t in figures.staleness_figure(metrics).data] == ["applied pushes"]


def test_waiting_strip_shows_who_the_latest_step_waits_for():
    fig = figures.waiting_figure(make_ps_metrics(), num_workers=3, start=1000.0)
    (heat,) = fig.data
    assert list(heat.y) == ["worker 0", "worker 1", "worker 2"]
    assert [row[-1] for row in heat.z] == [0, 1, 0]  # the last slot waits for worker 1 only
    assert [row[1] for row in heat.z] == [1, 1, 0]  # slot 1 waited for workers 0 and 1
    assert list(heat.x) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert list(heat.colorbar.ticktext) == ["not waited for", "waited for"]  # the strip's legend
    assert "waits for worker 1" in fig.layout.title.text and "2 stale gradients dropped" in fig.layout.title.text


def test_ps_load_rates_come_from_counter_differences():
    fig = figures.ps_load_figure(make_ps_metrics(), start=1000.0)
    assert names(fig) == ["ps 0", "ps 0", "ps 1", "ps 1"]
    bytes0, requests0, bytes1, requests1 = fig.data
    assert (bytes0.xaxis, requests0.xaxis) == ("x", "x2")
    # bytes_in + bytes_out of ps 0: 1000 k² + 500 k, sampled every 0.5 s
    expected = [(1000 * (k * k - (k - 1) ** 2) + 500) / 0.5 for k in range(1, 6)]
    np.testing.assert_allclose(bytes0.y, expected)
    np.testing.assert_allclose(requests0.y, 22 / 0.5)
    np.testing.assert_allclose(bytes0.x, [0.5, 1.0, 1.5, 2.0, 2.5])
    assert math.isnan(bytes1.y[-1]) and math.isnan(requests1.y[-1])  # a restarted ps's counters went down


SPEC = {"name": "c", "ps": [{"role": "ps", "index": i, "host": "127.0.0.1", "port": 1, "device": "cpu"}
                            for i in range(2)],
        "worker": [{"role": "worker", "index": i, "host": "127.0.0.1", "port": 0, "device": f"cuda:{i}"}
                   for i in range(3)]}


def make_events(*rows) -> pd.DataFrame:
    return pd.DataFrame([dict(time=float(i), task=task, kind=kind, detail=detail)
                         for i, (task, kind, detail) in enumerate(rows)], columns=["time", "task", "kind", "detail"])


def test_roles_frame_lists_ps_chief_and_workers_with_their_state():
    events = make_events(("controller", "start", {}), ("worker:1", "state", {"state": "waiting for chief"}),
                         ("worker:0", "state", {"state": "initializing"}), ("worker:0", "state", {"state": "training"}),
                         ("worker:2", "lost", {}))
    record = {"status": "training", "spec": SPEC}
    rates, states = figures.steps_per_second(make_metrics(), live=True), task_table.task_states(events)
    frame = task_table.roles_frame(record, rates, states)
    assert list(frame.columns) == task_table.ROLE_COLUMNS
    assert list(frame["role"]) == ["ps", "ps", "chief", "worker", "worker"]
    assert list(frame["task"]) == ["ps:0", "ps:1", "worker:0", "worker:1", "worker:2"]
    assert list(frame["state"]) == ["serving", "serving", "training", "waiting for chief", "lost"]
    assert list(frame["device"][2:]) == ["cuda:0", "cuda:1", "cuda:2"]
    assert frame["steps/s"][:2].isna().all()
    np.testing.assert_allclose(frame["steps/s"][2:], list(RATES.values()))

    finished = task_table.roles_frame({"status": "finished", "spec": SPEC}, rates, states)
    assert list(finished["state"]) == ["finished"] * 4 + ["lost"]


def test_task_states_of_chunks_of_events_are_those_of_all_of_them():
    events = make_events(("worker:0", "state", {"state": "initializing"}), ("worker:1", "lost", {}),
                         ("worker:0", "state", {"state": "training"}), ("worker:1", "state", {"state": "training"}))
    states = task_table.task_states(events.iloc[:2])
    states.update(task_table.task_states(events.iloc[2:]))
    assert states == task_table.task_states(events) == {"worker:0": "training", "worker:1": "training"}


def test_table_html_escapes_and_blanks_nan():
    text = figures.table_html(pd.DataFrame({"a": ["<b>"], "b": [np.nan], "c": [1.25]}))
    assert "&lt;b&gt;" in text and "<td style='padding: 1px 10px; text-align: left'></td>" in text
    assert ">1.2<" in text or ">1.3<" in text
    small = figures.table_html(pd.DataFrame({"loss": [3.2e-4, 0.0, 0.125, 2.5]}), digits=2)
    assert all(f">{v}<" in small for v in ("0.00032", "0.00", "0.125", "2.50"))


def compared(label, metrics, wall_s=10.0) -> figures.ComparedRun:
    """The run of ``metrics`` as ``compare`` reads it back from a real run store (started at 990 s)."""
    with tempfile.TemporaryDirectory() as home, RunStore(Path(home) / "runs.sqlite") as store:
        run_id = store.create_run(name=label, cluster="c", mode="async", config={}, spec={})
        store.add_batch(run_id, [{"kind": "step", "task": f"worker:{int(row.pop('worker'))}", **row}
                                 for row in metrics.to_dict("records")])
        last = metrics["time"].max() if len(metrics) else 0.0
        return figures.ComparedRun(label, store.series(run_id, ["loss"]),
                                   store.series(run_id, ["loss"], x="time", start=last - speed.RECENT_S),
                                   990.0, 990.0 + wall_s)


def test_compare_overlays_runs_and_tabulates_them():
    metrics = [make_metrics({0: 10.0, 1: 10.0}), make_metrics({0: 20.0}), make_metrics().iloc[:0]]
    runs = [compared(label, m) for label, m in zip(("sync", "async", "empty"), metrics)]
    fig = figures.compare_figure(runs)
    assert names(fig) == ["sync", "async", "global steps/s", "local steps/s (all workers)"]
    assert list(fig.data[2].x) == ["sync", "async"]
    np.testing.assert_allclose(fig.data[3].y, [20.0, 20.0])  # local steps/s summed over workers
    table = figures.compare_table(runs[:2])
    assert list(table["run"]) == ["sync", "async"] and list(table["workers"]) == [2, 1]
    assert list(table["local steps"]) == [2 * STEPS, STEPS]
    np.testing.assert_allclose(table["wall s"], 10.0)  # the record's, from start to end
    np.testing.assert_allclose(table["startup s"], [10.1, 10.05])  # to the first step, at 1000 + 1 / rate
    np.testing.assert_allclose(table["training s"], [2.9, 1.45])
    np.testing.assert_allclose(table["global steps"], [2 * STEPS + 1, STEPS])
    last = [m[m["time"] >= m["time"].max() - speed.RECENT_S]["loss"].mean() for m in metrics[:2]]
    np.testing.assert_allclose(table["final loss"], last)  # of the rows of its last seconds


EMPTY_METRICS = make_metrics().iloc[:0]
EMPTY_PS = make_ps_metrics().iloc[:0]


@pytest.mark.parametrize("build", [
    lambda: figures.convergence_figure(EMPTY_METRICS, None),
    lambda: figures.speed_figure(EMPTY_METRICS),
    lambda: figures.staleness_figure(EMPTY_METRICS),
    lambda: figures.staleness_figure(make_metrics().assign(staleness=np.nan)),
    lambda: figures.waiting_figure(EMPTY_PS, 2),
    lambda: figures.ps_load_figure(EMPTY_PS),
    lambda: figures.ps_load_figure(make_ps_metrics().iloc[:1]),  # one sample: no rate yet
    lambda: figures.placement_figure(PLACEMENT.iloc[:0], 2),
    lambda: figures.traffic_share_figure(PLACEMENT.iloc[:0], EMPTY_PS),
    lambda: figures.compare_figure([]),
])
def test_empty_inputs_give_a_no_data_figure(build):
    fig = build()
    assert isinstance(fig, go.Figure) and no_data(fig) and not fig.data


def test_roles_frame_without_a_run_is_empty():
    assert list(task_table.roles_frame(None, {}, {}).columns) == task_table.ROLE_COLUMNS
    frame = task_table.roles_frame({"status": "starting", "spec": SPEC}, figures.steps_per_second(EMPTY_METRICS), {})
    assert list(frame["state"]) == ["starting"] * 5 and frame["steps/s"].isna().all()


@pytest.mark.parametrize("build", [
    lambda: figures.convergence_figure(make_metrics(), None),
    lambda: figures.convergence_figure(make_metrics(), None, make_events(("controller", "checkpoint", {"step": 3}))),
    lambda: figures.convergence_figure(make_metrics().assign(accuracy=np.nan, error_rate=0.1, scale=2.0), None, None,
                                       make_ps_metrics().assign(lr=0.01)),
    lambda: figures.speed_figure(make_metrics()),
    lambda: figures.staleness_figure(make_metrics()),
    lambda: figures.waiting_figure(make_ps_metrics(), 2),
    lambda: figures.ps_load_figure(make_ps_metrics()),
    lambda: figures.placement_figure(PLACEMENT, 1),
    lambda: figures.placement_figure(SHARDED, 1),
    lambda: figures.traffic_share_figure(SHARDED.assign(sparse=[1, 1, 0, 0]), make_ps_metrics(), num_ps=3),
    lambda: figures.compare_figure([compared("a", make_metrics())]),
    lambda: figures.no_data_figure("x"),
])
def test_figures_pass_plotly_validation(build):
    # Figures are built unvalidated for speed: validating them again must not find a bad property.
    go.Figure(build().to_dict())


@pytest.mark.parametrize("optimizer, kwargs, slots", [
    ("sgd", {"lr": 0.1}, 0), ("SGD", {"momentum": 0.9}, 1), ("SGD", {"momentum": 0}, 0), ("Adam", {}, 2),
    ("adamw", {"amsgrad": True}, 3), ("Adagrad", {}, 1), ("RMSprop", {}, 1), ("RMSprop", {"momentum": 0.9}, 2),
    ("RMSprop", {"momentum": 0.9, "centered": True}, 3), ("Adadelta", {}, 2), ("NAdam", {}, 2),
    ("mypackage.optim:Lion", {}, 2),
])
def test_optimizer_slots(optimizer, kwargs, slots):
    assert optimizer_slots(optimizer, kwargs) == slots


@pytest.mark.parametrize("optimizer, kwargs", [
    ("SGD", {"momentum": 0.9}), ("Adam", {}), ("Adam", {"amsgrad": True}), ("AdamW", {}), ("Adagrad", {}),
    ("RMSprop", {"momentum": 0.9, "centered": True}), ("Adadelta", {}), ("ASGD", {}), ("Adamax", {}), ("NAdam", {}),
    ("RAdam", {}), ("Rprop", {}), ("SparseAdam", {}),
])
def test_optimizer_slot_names_are_the_state_torch_keeps(optimizer, kwargs):
    parameter = torch.nn.Parameter(torch.zeros(3))
    opt = getattr(torch.optim, optimizer)([parameter], lr=0.1, **kwargs)
    parameter.grad = torch.ones(3).to_sparse() if optimizer == "SparseAdam" else torch.ones(3)
    opt.step()
    kept = {k for k, v in opt.state[parameter].items() if torch.is_tensor(v) and v.shape == parameter.shape}
    assert set(optimizer_slot_names(optimizer, kwargs)) == kept
