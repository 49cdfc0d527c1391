"""The read endpoints over a real SQLite run store, and what they answer when it is missing,
locked or broken; authentication of every route."""

import io
import json
import os
import sqlite3
import time

import pandas as pd
import pytest
import torch

from pscluster.cluster import registry, run_records
from pscluster.labserver.service import SPARK_POINTS
from pscluster.metrics import speed
from pscluster.metrics.store import RunStore
from pscluster.runtime import optim
from pscluster.runtime.plan import TrainPlan
from pscluster.widgets import figures

ROUTES = [("GET", ("clusters",)), ("POST", ("clusters", "c", "stop")),
          ("POST", ("clusters", "c", "tasks", "worker", "1", "kill")),
          ("POST", ("clusters", "c", "tasks", "worker", "1", "restart")),
          ("GET", ("runs",)), ("GET", ("runs", "1", "series")), ("GET", ("runs", "1", "figures")),
          ("GET", ("compare",)), ("GET", ("runs", "1", "metrics.csv")),
          ("POST", ("runs", "1", "stop"))]


def steps(worker: int, first: int, last: int, t0: float = 1000.0) -> list[dict]:
    """Step events of one worker: global step == local step, one step per 0.1 s, falling loss."""
    return [{"kind": "step", "task": f"worker:{worker}", "time": t0 + 0.1 * s, "local_step": s,
             "global_step": s, "loss": 2.0 / (1 + s)} for s in range(first, last + 1)]


CONFIG = {"mode": "sync", "steps": 500, "batch_size": 64, "optimizer": "SGD", "optimizer_kwargs": {"lr": 0.1},
          "num_workers": 2, "scheduler": None, "seed": 0,  # as run_records keeps it: with the settings it shows
          "shown": ["num_workers", "scheduler", "mode", "steps", "seed", "batch_size"]}


def epoch(worker: int, number: int, t: float) -> dict:
    """A worker's event as an epoch of its ctx.shard loader begins."""
    return {"kind": "epoch", "task": f"worker:{worker}", "time": t, "epoch": number, "batches": 100,
            "global_step": 100 * (number - 1)}


def new_run(store: RunStore, cluster: str = "gone-cluster", steps_target: int = 500) -> int:
    return store.create_run(name=None, cluster=cluster, mode="sync", config={**CONFIG, "steps": steps_target},
                            spec={})


@pytest.mark.parametrize("mode, only_its_mode", [("sync", {"replicas_to_aggregate": 2}), ("async", {}),
                                                  ("ssp", {"staleness_bound": 3})])
async def test_a_run_s_settings_are_those_its_mode_reads_as_the_user_wrote_them(api, home, mode, only_its_mode):
    # as the run store keeps them: an async run showed replicas_to_aggregate=2, Adam's betas {'$tuple': [...]}
    model = torch.nn.Linear(3, 2)
    adam = optim.spec_of(torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9)),
                         list(model.named_parameters()))
    plan = TrainPlan.of(run_id=1, mode=mode, steps=100, batch_size=8, num_workers=2, replicas_to_aggregate=2,
                     staleness_bound=3, optimizer=adam.optimizer, optimizer_kwargs=adam.kwargs)
    with RunStore() as store:
        store.create_run(name=None, cluster="gone-cluster", mode=mode, config=run_records._config(plan), spec={})
    status, body = await api("GET", "runs")
    shown = body["runs"][0]["hyperparameters"]
    assert status == 200 and shown["betas"] == "(0.8, 0.9)" and shown["lr"] == 0.01 and shown["mode"] == mode
    assert {k: shown[k] for k in ("replicas_to_aggregate", "staleness_bound") if k in shown} == only_its_mode


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("token", ["", "token wrong"])
async def test_every_route_refuses_a_request_without_the_token(api, home, method, path, token):
    status, _ = await api(method, *path, headers={"Authorization": token})
    assert status == 403
    status, body = await api(method, *path)  # the route exists: with the token, our JSON answers
    assert isinstance(body, dict) and status != 403, (status, body)


async def test_nothing_yet_is_an_empty_list_with_a_message(api, home):
    assert await api("GET", "clusters") == (200, {"clusters": [], "skipped": []})
    status, body = await api("GET", "runs")
    assert status == 200 and body["runs"] == []
    assert "No run store yet" in body["message"] and str(home) in body["message"]
    status, body = await api("GET", "runs", "1", "series")
    assert status == 404 and "no run store yet" in body["error"]


async def test_runs_newest_first_with_step_speed_loss_and_sparkline(api, home):
    with RunStore() as store:
        done = new_run(store)
        store.add_batch(done, steps(0, 1, 200) + steps(1, 1, 200))
        store.add_batch(done, [epoch(0, 1, 1000.0), epoch(1, 1, 1000.0), epoch(1, 2, 1010.0), epoch(0, 2, 1010.0),
                               epoch(1, 3, 1020.0)])
        store.add_event(done, "controller", "diverging", {"since_step": 120, "loss": 950.0, "reference": 2.3,
                                                          "threshold": 11.5})  # as the supervisor records it
        store.set_status(done, "finished")
        lost = new_run(store)
        store.add_batch(lost, steps(0, 1, 10))
        store.set_status(lost, "training")
    status, body = await api("GET", "runs")
    assert status == 200 and body["message"] is None
    assert [r["id"] for r in body["runs"]] == [lost, done]
    second, first = body["runs"]
    assert first["status"] == "finished" and first["global_step"] == 200 and first["steps"] == 500
    with RunStore() as store:
        m, wall = store.metrics(done), store.runs().set_index("id").loc[done, "wall_s"]
    assert first["steps_per_s"] == speed.rate(m["time"], m["global_step"], live=False) == pytest.approx(10.0)
    assert first["wall_s"] == pytest.approx(wall)
    assert first["loss"] == first["final"]["loss"] == 2.0 / 201
    assert first["hyperparameters"] == {"optimizer": "SGD", "lr": 0.1, "batch_size": 64, "mode": "sync",
                                        "num_workers": 2, "steps": 500, "seed": 0}
    assert len(first["sparkline"]) == SPARK_POINTS and first["sparkline"][0] > first["sparkline"][-1]
    # its line as the panel draws it: from the top left (the highest loss) down to the bottom right (the lowest)
    path = first["sparkline_path"]
    assert path == figures.sparkline_path(first["sparkline"]) and path.startswith("M0,0L") and path.endswith("L1,1")
    assert path.count("L") == SPARK_POINTS - 1
    # training, but its cluster is in no registry: nobody will finish it
    assert second["status"] == "lost" and second["global_step"] == 10
    assert "the kernel of cluster gone-cluster is gone" in second["failure"]["cause"] and first["failure"] is None
    # each worker's epoch of its ctx.shard loader; none for a loop without epochs
    assert first["epochs"] == {"0": 2, "1": 3} and first["epochs_text"] == "worker 0 epoch 2, worker 1 epoch 3"
    assert second["epochs"] == {} and second["epochs_text"] == ""
    # what the divergence rule found in its loss, in the views' words; none for a run it found nothing in
    assert first["divergence"] == {"since_step": 120, "loss": 950.0, "reference": 2.3, "threshold": 11.5,
                                   "words": "diverging since step 120",
                                   "line": "diverging since step 120: the loss (smoothed) is 950, over 11.5, far "
                                           "above its level at the start, 2.3"}
    assert second["divergence"] is None


async def test_a_failed_run_says_why_where_and_its_traceback(api, home):
    failure = {"cause": "worker 1 failed: NonFiniteError: ...: fix the cause and train again", "task": "worker:1",
               "step": 37, "traceback": "Traceback (most recent call last):\n  ..."}
    with RunStore() as store:
        run = new_run(store)
        store.add_batch(run, steps(0, 1, 37))
        store.set_status(run, "failed", failure=failure)
    status, body = await api("GET", "runs")
    assert status == 200 and body["runs"][0]["status"] == "failed" and body["runs"][0]["failure"] == failure


async def test_a_training_run_s_speed_is_that_of_its_last_seconds(api, home):
    registry.write({"name": "live", "owner_pid": os.getpid(), "tasks": []})
    with RunStore() as store:
        run = new_run(store, cluster="live")
        slow = [{**e, "time": 1000.0 + 0.1 * e["global_step"]} for e in steps(0, 1, 100)]
        fast = [{**e, "time": 1010.0 + 0.05 * (e["global_step"] - 100)} for e in steps(0, 101, 300)]
        store.add_batch(run, slow + fast)
        store.set_status(run, "training")
        m = store.metrics(run)
    status, body = await api("GET", "runs")
    (listed,) = body["runs"]
    assert listed["status"] == "training" and listed["wall_s"] > 0
    assert listed["steps_per_s"] == speed.rate(m["time"], m["global_step"], live=True) == pytest.approx(20.0)


async def test_hundreds_of_runs(api, home):
    with RunStore() as store:
        for i in range(300):
            run = new_run(store)
            store.add_batch(run, steps(0, 1, 5 + i % 7))
            store.set_status(run, "finished")
    status, body = await api("GET", "runs")
    assert status == 200 and len(body["runs"]) == 300
    assert {r["global_step"] for r in body["runs"]} == set(range(5, 12))


def long_run(store: RunStore, steps: int, workers: int = 2, t0: float = 1000.0) -> int:
    """A finished run of ``steps`` global steps by ``workers`` workers in turn, 1000 global steps/s, a loss
    that falls as 1/step with a spike at step steps // 2, written in batches as the collector does."""
    run = new_run(store, steps_target=steps)
    for first in range(1, steps + 1, 50_000):
        s = pd.RangeIndex(first, min(first + 50_000, steps + 1))
        store.add_batch(run, [{"kind": "step", "task": f"worker:{g % workers}", "time": t0 + g / 1000,
                               "local_step": (g + workers - 1) // workers, "global_step": g,
                               "loss": 50.0 if g == steps // 2 else 1.0 / g} for g in s])
    store.set_status(run, "finished")
    return run


async def test_the_series_of_a_long_run_is_decimated_and_keeps_its_spikes(api, home):
    with RunStore() as store:
        run = long_run(store, 300_000)
    began = time.monotonic()
    status, body = await api("GET", "runs", str(run), "series", names="loss", points="1000")
    elapsed = time.monotonic() - began
    assert status == 200 and body["names"] == ["loss"] and "loss" in body["available"] and body["resolution"] > 0
    assert [w["worker"] for w in body["workers"]] == [0, 1]
    for w in body["workers"]:
        c = w["columns"]
        assert 100 <= len(c["x"]) <= 1000 and c["x"] == sorted(c["x"])
        assert {"x", "x_end", "time_last", "local_last", "count", "loss_mean", "loss_min", "loss_max"} <= set(c)
    assert max(max(w["columns"]["loss_max"]) for w in body["workers"]) == 50.0  # the spike survives
    assert body["run"]["loss"] == 1.0 / 300_000 and body["run"]["global_step"] == 300_000
    assert elapsed < 2, f"{elapsed:.2f}s"

    status, zoomed = await api("GET", "runs", str(run), "series", names="loss", start="1000", stop="2000")
    xs = [x for w in zoomed["workers"] for x in w["columns"]["x"]]
    assert status == 200 and zoomed["resolution"] < body["resolution"]
    assert min(xs) >= 1000 - zoomed["resolution"] and max(xs) <= 2000

    status, by_time = await api("GET", "runs", str(run), "series", x="time", points="50")
    assert status == 200 and all(len(w["columns"]["x"]) <= 50 for w in by_time["workers"])
    assert 1000 <= by_time["workers"][0]["columns"]["x"][0] < 1001


async def test_a_small_run_answers_its_raw_rows_and_nan_as_null(api, home):
    with RunStore() as store:
        run = new_run(store)
        store.add_batch(run, steps(0, 1, 5) + steps(1, 1, 3))
        store.add_batch(run, [{"kind": "step", "task": "worker:1", "time": 2000.0, "local_step": 4,
                               "global_step": 6, "loss": None}])
    status, body = await api("GET", "runs", str(run), "series")
    assert status == 200 and body["names"] == ["loss"] and body["resolution"] == 0
    one = body["workers"][1]["columns"]
    assert one["x"] == [1, 2, 3, 6] and one["loss_mean"][:3] == [2.0 / 2, 2.0 / 3, 2.0 / 4]
    assert one["loss_mean"][3] is None


async def test_a_diverged_loss_is_null_never_invalid_json(home, jp_fetch):
    with RunStore() as store:
        run = new_run(store)
        store.add_batch(run, steps(0, 1, 5) + [{"kind": "step", "task": "worker:0", "time": 2000.0, "local_step": 6,
                                                "global_step": 6, "loss": float("inf")}])
    response = await jp_fetch("pscluster", "api", "runs", str(run), "series")
    body = json.loads(response.body, parse_constant=pytest.fail)  # JSON.parse knows no Infinity or NaN
    assert body["workers"][0]["columns"]["loss_last"][-1] is None
    assert body["run"]["loss"] is None and len(body["run"]["sparkline"]) >= 2


async def test_download_the_metrics_as_csv(api, home, jp_fetch):
    with RunStore() as store:
        run = long_run(store, 20_000)
        raw = store.metrics(run)
    response = await jp_fetch("pscluster", "api", "runs", str(run), "metrics.csv")
    assert response.headers["Content-Type"].startswith("text/csv")
    assert "raw rows" in response.headers["X-Pscluster-Content"]
    pd.testing.assert_frame_equal(pd.read_csv(io.BytesIO(response.body)), raw.apply(pd.to_numeric), check_dtype=False)
    response = await jp_fetch("pscluster", "api", "runs", str(run), "metrics.csv", params={"points": "100"})
    df = pd.read_csv(io.BytesIO(response.body))
    assert "decimated" in response.headers["X-Pscluster-Content"]
    assert sorted(df["worker"].unique()) == [0, 1] and df.groupby("worker").size().max() <= 100
    assert {"loss_mean", "loss_min", "loss_max", "loss_last"} <= set(df.columns)


async def test_download_the_metrics_as_json_one_object_a_row(api, home, jp_fetch):
    with RunStore() as store:
        run = long_run(store, 25_000)  # more rows than one streamed chunk
        raw = store.metrics(run)
    response = await jp_fetch("pscluster", "api", "runs", str(run), "metrics.json")
    assert response.headers["Content-Type"].startswith("application/json")
    rows = json.loads(response.body, parse_constant=pytest.fail)  # NaN as null: JSON.parse reads it
    assert len(rows) == len(raw) > 20_000 and set(rows[0]) == set(raw.columns)
    pd.testing.assert_frame_equal(pd.DataFrame(rows, columns=raw.columns).apply(pd.to_numeric),
                                  raw.apply(pd.to_numeric), check_dtype=False)
    with RunStore() as store:  # a run with no rows yet: an empty array
        empty = new_run(store)
    assert json.loads((await jp_fetch("pscluster", "api", "runs", str(empty), "metrics.json")).body) == []


async def test_download_as_parquet_or_a_message_that_names_pyarrow(api, home, jp_fetch):
    with RunStore() as store:
        run = long_run(store, 1000)
        raw = store.metrics(run)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        status, body = await api("GET", "runs", str(run), "metrics.parquet")
        assert status == 400 and "pip install pyarrow" in body["error"] and "\n" not in body["error"]
        return
    response = await jp_fetch("pscluster", "api", "runs", str(run), "metrics.parquet")
    pd.testing.assert_frame_equal(pd.read_parquet(io.BytesIO(response.body)), raw, check_dtype=False)


async def test_plotly_js_is_served_once_and_cached(jp_fetch, jp_base_url):
    import plotly

    response = await jp_fetch("pscluster", "static", "plotly.min.js")
    assert response.body.startswith(b"/**") and b"plotly.js" in response.body[:2000]
    assert len(response.body) > 1_000_000 and plotly.__version__
    assert "max-age=604800" in response.headers["Cache-Control"]


async def test_runs_of_the_stores_of_running_clusters_too_each_store_once(api, home):
    default, own = home / "runs.sqlite", home / "elsewhere" / "own.sqlite"
    with RunStore() as store:
        new_run(store, cluster="a")
    with RunStore(own) as store:
        store.add_batch(new_run(store, cluster="b"), steps(0, 1, 3))
    (home / "link").symlink_to(home / "elsewhere")
    for name, path in (("a", default), ("b", own), ("b2", home / "link" / "own.sqlite")):
        registry.write({"name": name, "owner_pid": os.getpid(), "store": str(path), "tasks": []})
    status, body = await api("GET", "runs")
    assert status == 200
    assert [(r["id"], r["store"], r["cluster"]) for r in body["runs"]] == [(1, str(own), "b"), (1, str(default), "a")]
    status, body = await api("GET", "runs", "1", "series", store=str(own))
    assert status == 200 and body["run"]["cluster"] == "b" and body["workers"][0]["columns"]["local_last"] == [1, 2, 3]
    status, body = await api("GET", "runs", "1", "series")  # no store: the default one
    assert status == 200 and body["run"]["cluster"] == "a" and body["workers"] == []
    status, body = await api("GET", "runs", "1", "series", store=str(home / "other.sqlite"))
    assert status == 404 and "neither the default run store nor the store of a running cluster" in body["error"]
    status, body = await api("POST", "runs", "1", "stop", store=str(home / "other.sqlite"))
    assert status == 404


async def test_unknown_run_and_bad_cursor(api, home):
    with RunStore() as store:
        run = new_run(store)
    status, body = await api("GET", "runs", str(run + 1), "series")
    assert status == 404 and f"no run {run + 1}" in body["error"]
    status, body = await api("GET", "runs", str(run + 1), "metrics.csv")
    assert status == 404 and f"no run {run + 1}" in body["error"]
    status, body = await api("POST", "runs", str(run + 1), "stop")
    assert status == 404
    for args, message in [({"x": "row"}, "x=step"), ({"points": "1"}, "from 2 to"), ({"points": "many"}, "from 2"),
                          ({"start": "soon"}, "give a finite number"),
                          ({"names": "perplexity"}, "no metric perplexity")]:
        status, body = await api("GET", "runs", str(run), "series", **args)
        assert status == 400 and message in body["error"] and "\n" not in body["error"], (args, body)


async def test_a_locked_store_answers_503_then_recovers(api, home):
    with RunStore() as store:
        new_run(store)
    locker = sqlite3.connect(home / "runs.sqlite")
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    status, body = await api("GET", "runs")
    assert status == 503 and "locked by another process" in body["error"]
    locker.rollback()
    locker.close()
    status, body = await api("GET", "runs")
    assert status == 200 and len(body["runs"]) == 1


async def test_a_file_that_is_no_store_answers_503(api, home):
    (home / "runs.sqlite").write_bytes(b"not a database, " * 100)
    status, body = await api("GET", "runs")
    assert status == 503 and "is damaged (file is not a database)" in body["error"] and "move it aside" in body["error"]


async def test_entries_of_dead_kernels_and_broken_files_are_skipped(api, home, dead_pid):
    registry.write({"name": "orphan", "owner_pid": dead_pid, "tasks": []})
    (home / "clusters" / "broken.json").write_text("{")
    status, body = await api("GET", "clusters")
    assert status == 200 and body["clusters"] == []
    reasons = {s["name"]: s["reason"] for s in body["skipped"]}
    assert f"pid {dead_pid}" in reasons["orphan"] and "delete broken.json" in reasons["broken"]
    status, body = await api("POST", "clusters", "orphan", "stop")
    assert status == 409 and "stopped" in body["error"]
    status, body = await api("POST", "clusters", "never-was", "stop")
    assert status == 404 and "no running cluster never-was" in body["error"]
