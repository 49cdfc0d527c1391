"""What the series endpoint answers besides the metrics, over a real SQLite run store: each worker's speed by the
notebook's rule, the run's test-set evaluations and its learning rate."""

import numpy as np
import pytest

from pscluster.metrics import speed
from pscluster.metrics.store import RunStore
from pscluster.widgets import figure_specs, panels

from .test_api import long_run, new_run, steps


async def test_each_worker_s_speed_is_the_notebook_s_speed_chart(api, home):
    """At each raw row, the rise of the worker's local step over its last RECENT_S seconds per second: the points
    of the dashboard's speed chart fed the same rows."""
    rng = np.random.default_rng(3)
    times = 1000.0 + np.cumsum(rng.uniform(0.01, 0.2, 300))  # 5 to 100 steps/s: every window differs
    with RunStore() as store:
        run = new_run(store)
        store.add_batch(run, [{"kind": "step", "task": "worker:0", "time": float(t), "local_step": i + 1,
                               "global_step": i + 1, "loss": 1.0} for i, t in enumerate(times)])
        metrics = store.metrics(run)
    dashboard = panels.Speed()
    dashboard.feed({"metrics": figure_specs.rows(metrics)})
    [drawn] = dashboard.spec().traces

    status, body = await api("GET", "runs", str(run), "series", x="time")
    assert status == 200 and body["resolution"] == 0 and body["speed_window_s"] == speed.RECENT_S
    [worker] = body["workers"]
    rates = worker["columns"]["local_steps_per_s"]
    assert rates[0] is None  # one row: no time to count a rise over
    assert rates[1:] == pytest.approx(list(drawn["y"]))
    assert min(rates[1:]) < 15 and max(rates[1:]) > 15  # the window follows the changes of speed


async def test_a_long_run_s_speed_is_counted_over_buckets_wider_than_the_window(api, home):
    with RunStore() as store:
        run = long_run(store, 300_000)  # 1000 global steps/s by 2 workers in turn: 500 local steps/s each
    status, body = await api("GET", "runs", str(run), "series", points="20")  # buckets of ~15 s
    assert status == 200 and body["resolution"] >= 10_000
    for w in body["workers"]:
        assert w["columns"]["local_steps_per_s"] == pytest.approx([500.0] * len(w["columns"]["x"]), rel=1e-3)


async def test_the_series_brings_the_test_evaluations_and_where_the_learning_rate_changed(api, home):
    with RunStore() as store:
        run = new_run(store)
        store.add_batch(run, steps(0, 1, 50))
        store.add_evaluation(run, 20, 0.9, 0.5)
        store.add_evaluation(run, 40, 0.6, None)
        store.add_batch(run, [{"kind": "ps", "task": "ps:0", "time": 1000.0 + s / 10, "step": s,
                               "lr": 0.1 if s < 30 else 0.01} for s in range(0, 50, 5)])
        bare = new_run(store)
        store.add_batch(bare, steps(0, 1, 5))
    status, body = await api("GET", "runs", str(run), "series")
    assert status == 200
    assert [(e["global_step"], e["loss"], e["accuracy"]) for e in body["evaluations"]] == [(20, 0.9, 0.5),
                                                                                        (40, 0.6, None)]
    assert all(e["time"] > 0 for e in body["evaluations"])
    assert [(r["step"], r["time"], r["lr"]) for r in body["learning_rates"]] == [
        (0, 1000.0, 0.1), (30, 1003.0, 0.01), (45, 1004.5, 0.01)]  # each change, then the last sample

    status, body = await api("GET", "runs", str(bare), "series")
    assert status == 200 and body["evaluations"] == [] and body["learning_rates"] == []


def test_over_time_is_the_rise_over_the_last_seconds():
    t = np.array([0.0, 1.0, 2.0, 6.0, 6.5, 20.0])
    c = np.array([0.0, 10.0, 30.0, 40.0, 45.0, 50.0])
    rates = speed.over_time(t, c, recent_s=5.0)
    assert np.isnan(rates[0]) and np.isnan(rates[5])  # alone in its window
    assert rates[1:5] == pytest.approx([10.0, 15.0, 30 / 5, 15 / 4.5])
    wide = speed.over_time(t, c, recent_s=5.0, since=[0, 0, 0, 0, 0, 6.0])  # its window reaches back to 6 s
    assert wide[5] == pytest.approx(10 / 14)
