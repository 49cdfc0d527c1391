"""The side panel draws the notebook's figures: what the figures endpoint serves for a run is what its dashboard
draws from the same run store, and the compare endpoint serves pscluster.compare's figure; the figures' drawing
code (figures.js) is the notebook's own. A stale push is named dropped_stale everywhere."""

import json
import time

import pytest

from pscluster.metrics.store import RunStore
from pscluster.widgets import Dashboard, figures, live, panels
from pscluster.widgets.figure_specs import expanded

SPEC = {"ps": [{"role": "ps", "index": i} for i in range(2)], "worker": [{"role": "worker", "index": i}
                                                                       for i in range(2)]}


class Variable:
    def __init__(self, name: str, ps: int, nbytes: int):
        self.name, self.ps, self.shape, self.dtype, self.nbytes = name, ps, (nbytes // 4,), "float32", nbytes


def written_run(store: RunStore, mode: str, steps: int = 60, *, accuracy: float = 0.5, finished: bool = True) -> int:
    """A run of 2 workers as the controller writes one: its placement, steps (every 7th push of worker 1 dropped as
    stale), ps samples, test evaluations and a checkpoint event."""
    run = store.create_run(name=f"{mode}-run", cluster="gone", mode=mode, spec=SPEC, config={
        "mode": mode, "steps": steps, "batch_size": 8, "optimizer": "Adam", "optimizer_kwargs": {"lr": 0.01},
        "num_workers": 2, "aggregates_steps": mode == "sync"})
    store.record_placement(run, [Variable("fc.weight", 0, 4096), Variable("fc.bias", 1, 64)])
    store.set_status(run, "training")
    write_steps(store, run, 1, steps, accuracy)
    store.add_event(run, "chief", "checkpoint", {"step": 60})
    store.add_evaluation(run, 40, 0.5, accuracy)
    if finished:
        store.set_status(run, "finished")
    return run


def write_steps(store: RunStore, run: int, first: int, last: int, accuracy: float = 0.5) -> None:
    """Local steps ``first`` to ``last`` of both workers, 20 ms apart, the last one now, and a sample of each ps every
    10 of them."""
    t0 = time.time() - last * 0.02
    events = []
    for s in range(first, last + 1):
        for w in range(2):
            dropped = w == 1 and s % 7 == 0
            events.append({"kind": "step", "task": f"worker:{w}", "time": t0 + 0.02 * s + 0.001 * w, "local_step": s,
                           "global_step": 2 * s + w, "loss": 2.0 / s + 0.1 * w, "accuracy": accuracy,
                           "compute_s": 0.01, "wait_s": 0.0, "comm_s": 0.001, "bytes_sent": 10, "bytes_received": 10,
                           "staleness": None if dropped else s % 3, "dropped": dropped})
        if s % 10 == 0:
            events += [{"kind": "ps", "task": f"ps:{ps}", "time": t0 + 0.02 * s, "step": 2 * s, "pushes": 2 * s,
                        "pulls": 2 * s, "applied": 2 * s, "dropped_stale": s // 7, "late": 0, "bytes_in": 100 * s,
                        "bytes_out": 100 * s, "waiting_for": [1], "lr": 0.01} for ps in range(2)]
    store.add_batch(run, events)


def dashboard_figures(path, run: int) -> list[dict]:
    """The figures of a new dashboard of ``run`` after one refresh, as its live figures are sent them."""
    dashboard = Dashboard(path, run)
    try:
        dashboard.refresh()
        return as_json([{"name": name, **live.figure_json(f.spec)} for name, f in dashboard.figures.items()])
    finally:
        dashboard.close()


def as_json(value):
    return json.loads(json.dumps(value))


@pytest.fixture
def compare(api):
    """``await compare(["1:<store>", "2"], metric=...)``: the compare endpoint's answer for those runs."""

    async def call(runs: list[str], **params):
        return await api("GET", "compare", **params, run=runs)

    return call


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_the_figures_of_a_run_are_those_its_notebook_dashboard_draws(api, home, mode):
    with RunStore() as store:
        run = written_run(store, mode, finished=False)
    status, body = await api("GET", "runs", str(run), "figures")  # while it trains
    assert status == 200 and body["run"]["id"] == run and body["figures"] == dashboard_figures(store.path, run)
    with RunStore() as store:  # it goes on: the next answer reads the new rows only, for the same figures
        write_steps(store, run, 61, 90)
        store.set_status(run, "finished")
    status, body = await api("GET", "runs", str(run), "figures")
    assert status == 200 and body["run"]["status"] == "finished"
    assert body["figures"] == dashboard_figures(store.path, run)
    assert [f["name"] for f in body["figures"]] == ["placement", "speed", "convergence",
                                                    "waiting" if mode == "sync" else "staleness", "ps_load", "traffic"]
    convergence = next(f for f in body["figures"] if f["name"] == "convergence")
    # one default smoothing, the notebook's: its controls start there, its smoothed lines are at that weight
    assert convergence["layout"]["meta"]["controls"]["smoothing"] == round(1 - 2 / (panels.SMOOTH_SPAN + 1), 4)
    assert {t["name"] for t in convergence["data"]} >= {"worker 0", "worker 0 (smoothed)", "test set"}
    assert max(convergence["data"][0]["x"]) == 180  # worker 0's last global step


async def test_a_run_without_rows_has_every_figure_saying_no_data_yet(api, home):
    with RunStore() as store:
        run = store.create_run(name="empty", cluster="gone", mode="async", spec={}, config={})
    status, body = await api("GET", "runs", str(run), "figures")
    assert status == 200 and len(body["figures"]) == 6
    assert all(f["data"] == [] and f["layout"]["annotations"][0]["text"] == "no data yet" for f in body["figures"])
    assert (await api("GET", "runs", str(run + 1), "figures"))[0] == 404


async def test_compare_is_the_figure_of_pscluster_compare_for_the_metric_chosen(compare, home):
    with RunStore() as store:
        runs = [written_run(store, "async", accuracy=a) for a in (0.3, 0.8)]
        compared = [figures.compared_run(store, r, label, ("accuracy",), points=2000)
                    for r, label in zip(runs, ["async-run", f"async-run #{runs[1]}"])]
        path = store.path
    expected = as_json(live.figure_json(expanded(figures.compare_spec(compared, "accuracy"))))
    status, body = await compare([f"{r}:{path}" for r in runs], metric="accuracy")
    assert status == 200 and body["metric"] == "accuracy" and [r["id"] for r in body["runs"]] == runs
    assert {k: body["figure"][k] for k in ("data", "layout")} == expected
    assert [t["y"][-1] for t in body["figure"]["data"][:2]] == pytest.approx([0.3, 0.8])
    assert {"loss", "accuracy", "dropped_stale"} <= set(body["available"]) and "dropped" not in body["available"]

    status, body = await compare([str(r) for r in runs], metric="dropped_stale")
    assert status == 200 and body["figure"]["layout"]["yaxis"]["title"]["text"] == "dropped_stale (mean over workers)"
    status, body = await compare([str(r) for r in runs], metric="nothing")
    assert status == 400 and "has a metric nothing" in body["error"]
    assert await compare([str(runs[0])]) == (400, {"error": "give two runs or more to compare, each as "
                                                           "run=ID:STORE (its id, then its store)"})
    status, body = await compare([str(runs[0]), "last"])
    assert status == 400 and body["error"].startswith("run='last': give a run as ID:STORE")


async def test_pushes_dropped_as_stale_are_named_dropped_stale_and_counted(api, home):
    with RunStore() as store:
        run = written_run(store, "sync")
    status, body = await api("GET", "runs")
    [info] = body["runs"]
    assert info["final"]["dropped_stale"] == 60 // 7  # worker 1's every 7th push, as the ps counts them
    assert "dropped" not in info["final"]
    status, body = await api("GET", "runs", str(run), "series", names="dropped_stale")
    assert status == 200 and "dropped_stale" in body["available"] and "dropped" not in body["available"]
    [_, worker1] = body["workers"]
    assert sum(worker1["columns"]["dropped_stale_mean"]) == 60 // 7


async def test_the_figures_are_drawn_by_the_notebook_s_own_script(jp_fetch):
    response = await jp_fetch("pscluster", "static", "figures.js")
    script = response.body.decode()
    assert response.headers["Content-Type"].startswith("text/javascript")
    assert script == live.PANEL_SCRIPT and "function figureView(" in script and "function smoothed(" in script
