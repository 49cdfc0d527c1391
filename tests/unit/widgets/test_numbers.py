"""The numbers a run shows, pinned on one synthetic run in a real run store: every steps/s pscluster shows is
``speed.rate``'s (the roles table, the speed chart's title, ``figures.steps_per_second``, ``compare``), while
the run trains and once it ended; ``compare``'s times are those of ``RunStore.runs()`` and its final loss is
the mean loss of the rows of the last ``speed.RECENT_S`` seconds, shown with its significant digits."""

import math
import re

import numpy as np
import pytest

from pscluster.comparison import compare
from pscluster.metrics import speed
from pscluster.metrics.store import RunStore
from pscluster.widgets import figure_specs, figures, panels, task_table

SPEC = {"ps": [{"role": "ps", "index": 0, "host": "h", "device": "cpu"}],
        "worker": [{"role": "worker", "index": w, "host": "h", "device": "cpu"} for w in range(3)]}
STARTUP_S = 2.0  # from the run's start to its first reported step
TRAIN_S = 10.0  # from the first reported step to the last
RATES = {0: 30.0, 1: 40.0, 2: 35.0}  # each worker's steps/s; worker 1 slows to SLOW over the last SLOW_S seconds
SLOW, SLOW_S = 12.5, 3.0
FLOOR = 3.2e-4  # the loss of the last steps


def step_times(rng, w: int) -> np.ndarray:
    """Worker w's report times since the run's first step: steps jittered by ±50% around its rate."""
    times, t = [], 0.0
    while t <= TRAIN_S:
        times.append(t)
        slow = w == 1 and t > TRAIN_S - SLOW_S
        t += rng.uniform(0.5, 1.5) / (SLOW if slow else RATES[w])
    return np.array(times)


@pytest.fixture
def run(tmp_path):
    """(store, run id, panels.Speed fed as the dashboard feeds it): an async run whose three workers' step
    events are written in batches of about 0.2 s, as the collector writes them; every push is applied (one
    global step each)."""
    rng = np.random.default_rng(7)
    with RunStore(tmp_path / "runs.sqlite") as store:
        run_id = store.create_run(name="n", cluster="c", mode="async", config={"steps": 900}, spec=SPEC)
        store.set_status(run_id, "training")
        first = store.run(run_id)["started"] + STARTUP_S
        events = sorted(({"kind": "step", "task": f"worker:{w}", "time": first + t, "local_step": i + 1,
                          "loss": max(FLOOR, 1.0 / (i + 1) ** 2), "staleness": w}
                         for w in RATES for i, t in enumerate(step_times(rng, w))), key=lambda e: e["time"])
        for g, event in enumerate(events):
            event["global_step"] = g + 1
        speed_panel, row = panels.Speed(), 0
        for batch in np.array_split(np.array(events, dtype=object), TRAIN_S / 0.2):
            store.add_batch(run_id, list(batch))
            new = store.metrics(run_id, after_row=row)
            row = int(new["row"].max())
            speed_panel.feed({"metrics": figure_specs.rows(new)})
        yield store, run_id, speed_panel


def expected(metrics, *, live: bool) -> tuple[dict[int, float], float]:
    """Each worker's steps/s and the run's, by ``speed.rate`` itself."""
    latest = metrics["time"].max()
    local = {w: speed.rate(rows["time"], rows["local_step"], live=live, latest=latest)
             for w, rows in metrics.groupby("worker")}
    return local, speed.rate(metrics["time"], metrics["global_step"], live=live)


def slowest_in_title(speed_panel) -> tuple[int, float]:
    title = speed_panel.spec().layout["title"]["text"]
    worker, rate = re.search(r"slowest: worker (\d+) \(([\d.]+) steps/s\)", title).groups()
    return int(worker), float(rate)


@pytest.mark.parametrize("live", [True, False])
def test_every_steps_per_second_is_speed_rate(run, live):
    store, run_id, speed_panel = run
    if not live:
        store.set_status(run_id, "finished")
    record, metrics = store.run(run_id), store.metrics(run_id)
    local, global_ = expected(metrics, live=live)
    slowest = min(local, key=local.get)
    assert slowest == (1 if live else 0)  # worker 1 is the slowest lately, worker 0 over the whole run
    speed_panel.live = live  # what the dashboard tells it

    table = task_table.roles_frame(record, speed_panel.worker_rates(), {})
    np.testing.assert_allclose(table["steps/s"][1:], list(local.values()))
    assert slowest_in_title(speed_panel) == (slowest, round(local[slowest], 1))
    np.testing.assert_allclose(figures.steps_per_second(metrics, live=live), list(local.values()))
    compared = compare([run_id], store=store.path).table
    wall = store.runs().set_index("id").loc[run_id, "wall_s"]  # to now while it trains
    assert wall > 0 and compared["wall s"][0] == pytest.approx(wall, abs=1.0)
    assert compared["global steps/s"][0] == pytest.approx(global_)
    assert compared["local steps/s"][0] == pytest.approx(sum(local.values()))
    assert global_ == pytest.approx(sum(local.values()), rel=0.2)  # one global step per local step (async)
    # the progress bar's and Run.summary()'s: RunRates fed the store's new rows, as Run.rates() feeds it
    assert speed_panel.rates.run(live=live) == pytest.approx(global_)


def test_the_speed_chart_draws_each_workers_rate_over_its_last_seconds(run):
    store, run_id, speed_panel = run
    metrics, shown = store.metrics(run_id), speed_panel.spec()
    assert shown.layout["yaxis"]["title_text"] == f"steps/s (over {speed.RECENT_S:g} s)"
    for w, rows in metrics.groupby("worker"):
        line = next(t for t in shown.traces if t["name"].startswith(f"worker {w}"))
        assert line["y"][-1] == pytest.approx(speed.rate(rows["time"], rows["local_step"], live=True))
        middle = line["y"][(line["x"] > speed.RECENT_S) & (line["x"] < TRAIN_S - SLOW_S)]  # since the first step
        assert np.ptp(middle) < 0.1 * RATES[w]  # smooth: the steps are jittered by ±50%


def test_compare_gives_the_run_stores_times_and_the_final_loss_it_claims(run):
    store, run_id, _ = run
    store.set_status(run_id, "finished")
    comparison = compare([run_id], store=store.path)
    row, metrics = comparison.table.iloc[0], store.metrics(run_id)
    listed = store.runs().set_index("id").loc[run_id]
    assert row["wall s"] == listed["wall_s"]  # from start to end, as runs() has it
    assert row["startup s"] == pytest.approx(STARTUP_S, abs=0.05)
    assert row["training s"] == pytest.approx(metrics["time"].max() - metrics["time"].min())
    last = metrics[metrics["time"] >= metrics["time"].max() - speed.RECENT_S]["loss"]
    assert row["final loss"] == pytest.approx(last.mean()) == pytest.approx(FLOOR)
    assert ">0.00032<" in comparison._repr_html_()  # its significant digits, not 0.00
    rates = speed.of(metrics)
    assert row["global steps/s"] == pytest.approx(rates.run(live=False))
    assert speed.phases(listed["started"], listed["ended"], rates.span()) == {
        "wall_s": row["wall s"], "startup_s": row["startup s"], "training_s": row["training s"]}


def test_a_stalled_worker_has_no_live_rate(run):
    store, run_id, _ = run
    metrics = store.metrics(run_id)
    cut = metrics[(metrics["worker"] != 2) | (metrics["time"] < metrics["time"].max() - speed.RECENT_S - 1)]
    speed_panel = panels.Speed(live=True)
    speed_panel.feed({"metrics": figure_specs.rows(cut)})
    rates = figures.steps_per_second(cut, live=True)
    np.testing.assert_allclose(list(speed_panel.worker_rates().values()), rates)
    assert math.isnan(rates[2]) and np.isfinite(rates[[0, 1]]).all() and speed_panel.slowest()[0] == 1
