"""The live dashboard on a real run store (SQLite in a temp dir), written the way the controller writes it.

No engines: the test plays the controller, writing step and ps events with ``add_batch``. Every
dashboard a test makes is closed at teardown, which stops its thread.
"""

import time
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest

from pscluster.comparison import Comparison, compare
from pscluster.errors import ConfigError
from pscluster.metrics import store as store_module
from pscluster.metrics.divergence import Diverging
from pscluster.metrics.store import RunStore
from pscluster.runtime.waiting import wait_until
from pscluster.widgets import Dashboard, dashboard, figure_specs, figures, live, show

WIDGET = "application/vnd.jupyter.widget-view+json"
SPEC = {"name": "c", "ps": [{"role": "ps", "index": i, "host": "127.0.0.1", "port": 5000 + i, "device": "cpu"}
                            for i in range(2)],
        "worker": [{"role": "worker", "index": i, "host": "127.0.0.1", "port": 0, "device": "cpu"}
                   for i in range(2)]}
VARIABLES = [SimpleNamespace(name="fc1.weight", ps=0, shape=(32, 64), dtype="float32", nbytes=8192),
             SimpleNamespace(name="fc1.bias", ps=1, shape=(32,), dtype="float32", nbytes=128),
             SimpleNamespace(name="fc2.weight", ps=0, shape=(10, 32), dtype="float32", nbytes=1280)]


class Writer:
    """Plays the controller of one run: step events of 2 workers and ps samples, with real timestamps.

    ``step_metrics``: each step has a step_fn's metrics, error_rate 0.5 / step and logit_scale 10 (worker 0) or
    20 (worker 1); ``lr``: each ps sample has the learning rate 0.1 / (1 + step // 10); ``accuracy=False``: a
    model without class logits."""

    def __init__(self, store: RunStore, mode: str = "sync", optimizer: str = "Adam", *, step_metrics: bool = False,
                 lr: bool = False, accuracy: bool = True, steps: int | None = 100):
        self.store = store
        self.step_metrics, self.lr, self.accuracy = step_metrics, lr, accuracy
        config = {"mode": mode, "steps": steps, "batch_size": 8, "optimizer": optimizer, "optimizer_kwargs": {},
                  "replicas_to_aggregate": 2, "num_workers": 2, "seed": 0, "log_every": 10,
                  "aggregates_steps": mode == "sync"}  # as the control plane records it (run_records)
        self.run_id = store.create_run(name=f"{mode}-run", cluster="c", mode=mode, config=config, spec=SPEC)
        store.record_placement(self.run_id, VARIABLES)
        store.set_status(self.run_id, "training")
        store.add_batch(self.run_id, [{"kind": "state", "task": f"worker:{w}", "time": time.time(),
                                       "state": "training"} for w in range(2)])
        self.steps = 0
        self._clock = 0.0  # the time after the last step written

    def write(self, steps: int) -> None:
        """``steps`` more local steps of each worker, 1 ms apart from now on (after the last ones written), and a
        sample of each ps."""
        events, now = [], max(time.time(), self._clock)
        self._clock = now + 0.001 * steps
        for i in range(steps):
            self.steps += 1
            for w in range(2):
                events.append({"kind": "step", "task": f"worker:{w}", "time": now + 0.001 * i + 0.0001 * w,
                               "local_step": self.steps, "global_step": self.steps, "loss": 1.0 / self.steps,
                               "accuracy": 0.5 if self.accuracy else None, "compute_s": 0.001, "wait_s": 0.0,
                               "comm_s": 0.001, "bytes_sent": 10, "bytes_received": 10, "staleness": w,
                               "dropped": False})
                if self.step_metrics:
                    events[-1]["metrics"] = {"error_rate": 0.5 / self.steps, "logit_scale": 10.0 * (w + 1)}
        for ps in range(2):
            events.append({"kind": "ps", "task": f"ps:{ps}", "time": now + 0.001 * steps, "step": self.steps,
                           "pushes": 2 * self.steps, "pulls": 2, "applied": self.steps, "dropped_stale": 0,
                           "late": 0, "bytes_in": 100 * self.steps, "bytes_out": 100 * self.steps,
                           "waiting_for": [1], **({"lr": 0.1 / (1 + self.steps // 10)} if self.lr else {})})
        self.store.add_batch(self.run_id, events)


@pytest.fixture
def store(tmp_path):
    s = RunStore(tmp_path / "runs.sqlite")
    yield s
    s.close()


@pytest.fixture
def dashboards():
    """Factory of dashboards that closes every one of them (their threads stop) at teardown."""
    made = []

    def make(path, run_id, **kw):
        made.append(Dashboard(path, run_id, **kw))
        return made[-1]

    yield make
    for d in made:
        d.close()
    assert not any(d.running for d in made), "a dashboard thread did not stop"


def names(widget) -> list[str]:
    return [t.name for t in widget.figure.data]


def test_refresh_fills_the_figure_widgets(store, dashboards):
    run = Writer(store)
    run.write(10)
    run.write(10)  # a second ps sample: the first rates
    d = dashboards(store.path, run.run_id)
    assert set(d.figures) == {"placement", "speed", "convergence", "waiting", "ps_load", "traffic"}
    assert all(isinstance(f, live.LiveFigure) for f in d.figures.values())
    assert d.refresh() is False  # still training
    speed, convergence = d.figures["speed"].figure, d.figures["convergence"].figure
    assert len(speed.data) == 2 and any("(slowest)" in n for n in [t.name for t in speed.data])
    assert names(d.figures["convergence"]).count("worker 0") == 2
    assert names(d.figures["convergence"]).count("worker 1 (smoothed)") == 2
    assert len(convergence.data[0].x) == 20
    assert names(d.figures["placement"]) == ["fc1.weight", "fc1.bias", "fc2.weight"]
    assert d.figures["placement"].figure.data[0].y[0] == 8192 * 3  # Adam: two slots per variable
    assert len(d.figures["ps_load"].figure.data) == 4
    predicted, measured = d.figures["traffic"].figure.data  # both ps tasks moved as many bytes; ps 0 holds 98.7%
    assert list(predicted.y) == pytest.approx([100 * 9472 / 9600, 100 * 128 / 9600])
    assert list(measured.y) == pytest.approx([50, 50])
    assert "waits for worker 1" in d.figures["waiting"].figure.layout.title.text
    assert "fc1.weight: /job:ps/task:0" in d.lines.value
    assert "chief" in d.roles.value and "training" in d.roles.value
    assert "sync-run" in d.header.value and "20 / 100" in d.header.value
    assert d.figures["speed"] in d.box.children


def epoch(run: Writer, worker: int, number: int) -> None:
    """Worker ``worker``'s ctx.shard loader begins its epoch ``number``."""
    run.store.add_batch(run.run_id, [{"kind": "epoch", "task": f"worker:{worker}", "time": time.time(),
                                      "epoch": number, "batches": 6, "global_step": run.steps}])


def test_a_run_without_a_step_target_shows_its_epochs_and_steps_so_far(store, dashboards):
    run = Writer(store, steps=None)  # a user's loop that ends with its epochs
    for e in (1, 2):
        epoch(run, 0, e)
        epoch(run, 1, e)
        run.write(6)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    assert "· epoch 2 · global step 12 ·" in d.header.value and "<progress" not in d.header.value
    epoch(run, 1, 3)  # worker 1 ahead: each worker's epoch
    run.write(1)
    d.refresh()
    assert "worker 0 epoch 2, worker 1 epoch 3 · global step 13 ·" in d.header.value
    assert "worker 1 epoch 3" in d.static_html(images=False)  # what an HTML report keeps


def test_a_run_with_a_target_shows_the_epoch_beside_its_bar_and_one_without_epochs_none(store, dashboards):
    run = Writer(store)
    run.write(3)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    assert "epoch" not in d.header.value and "global step 3 / 100 <progress" in d.header.value
    epoch(run, 0, 1)
    epoch(run, 1, 1)
    d.refresh()
    assert "· epoch 1 · global step 3 / 100 <progress" in d.header.value


def test_a_diverging_run_says_so_in_the_header_in_the_warning_colour(store, dashboards):
    run = Writer(store)
    run.write(3)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    assert "diverging" not in d.header.value
    found = Diverging(since_step=2, loss=950.0, reference=2.3, threshold=11.5)
    store.add_event(run.run_id, "controller", "diverging", asdict(found))  # as the supervisor records it
    run.write(1)
    d.refresh()
    assert (f"training</span> · <span class='pscluster-diverging' style='color: {dashboard.WARNING_COLOR}; "
            "font-weight: bold' title='diverging since step 2: the loss (smoothed) is 950, over 11.5, far above its "
            "level at the start, 2.3'>⚠ diverging since step 2</span> · global step 4 / 100") in d.header.value
    assert "⚠ diverging since step 2" in d.static_html(images=False)  # what an HTML report keeps


def test_a_second_refresh_appends_in_place(store, dashboards):
    run = Writer(store, mode="async")
    run.write(5)
    run.write(5)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    assert "staleness" in d.figures and "waiting" not in d.figures
    widgets = dict(d.figures)
    time.sleep(0.01)
    run.write(15)
    d.refresh()
    assert d.figures == widgets  # the same FigureWidgets, updated in place
    assert len(d.figures["convergence"].figure.data[0].x) == 25
    assert list(d.figures["staleness"].figure.data[0].y) == [25, 25]
    assert "25 / 100" in d.header.value


def test_a_dashboard_opened_before_the_first_step_fills_in_as_rows_arrive(store, dashboards):
    run = Writer(store)
    d = dashboards(store.path, run.run_id)
    d.refresh()  # no metric rows yet: empty frames, "no data yet" figures
    assert [a.text for a in d.figures["convergence"].figure.layout.annotations] == ["no data yet"]
    for total in (3, 8):
        run.write(total - run.steps)
        d.refresh()
        assert d.error is None and len(d.figures["convergence"].figure.data[0].x) == total
        assert d.figures["speed"].figure.data[0].y.dtype.kind == "f"  # numbers, not objects, after appending
    assert d.refreshes == 3


def edits(d) -> dict[str, tuple]:
    """Each figure widget and the count of messages it was sent."""
    return {name: (w, w.messages) for name, w in d.figures.items()}


def test_a_refresh_without_new_rows_sends_no_widget_update(store, dashboards):
    run = Writer(store)
    run.write(10)
    run.write(10)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    before, roles, lines = edits(d), d.roles.value, d.lines.value
    d.refresh()
    assert edits(d) == before and d.roles.value == roles and d.lines.value == lines
    time.sleep(0.01)
    run.write(5)
    d.refresh()
    after = edits(d)
    assert after["placement"] == before["placement"]  # drawn once
    for name in ("convergence", "speed", "ps_load"):  # the same widget, one message more
        widget, messages = before[name]
        assert after[name] == (widget, messages + 1)


def same_traces(widget, fig) -> None:
    widget = widget.figure
    assert widget.layout.title.text == fig.layout.title.text
    assert len(widget.data) == len(fig.data)
    for shown, static in zip(widget.data, fig.data):
        assert shown.name == static.name
        for axis in ("x", "y", "z"):
            np.testing.assert_equal(np.asarray(getattr(shown, axis, None)), np.asarray(getattr(static, axis, None)))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_live_figures_are_those_of_all_the_rows_at_once(store, dashboards, mode):
    run = Writer(store, mode=mode)
    d = dashboards(store.path, run.run_id)
    for _ in range(6):  # 1200 steps of each worker: thinned, more than MAX_POINTS points each
        run.write(200)
        d.refresh()
    metrics, ps_metrics = store.metrics(run.run_id), store.ps_metrics(run.run_id)
    started = store.run(run.run_id)["started"]
    same_traces(d.figures["convergence"], figures.convergence_figure(metrics))
    same_traces(d.figures["speed"], figures.speed_figure(metrics, start=started, live=True))
    same_traces(d.figures["ps_load"], figures.ps_load_figure(ps_metrics, start=started))
    same_traces(d.figures["traffic"], figures.traffic_share_figure(store.placement(run.run_id), ps_metrics,
                                                                    num_ps=2))
    if mode == "sync":
        same_traces(d.figures["waiting"], figures.waiting_figure(ps_metrics, 2, start=started))
    else:
        same_traces(d.figures["staleness"], figures.staleness_figure(metrics))
    assert len(d.figures["convergence"].figure.data[0].x) <= figure_specs.MAX_POINTS + 1


def test_marks_of_new_events_are_sent_once(store, dashboards, monkeypatch):
    run = Writer(store)
    run.write(10)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    sent = []
    monkeypatch.setattr(live.LiveFigure, "send", lambda self, message: sent.append((self, message)))
    time.sleep(0.02)  # after the rows written so far
    store.add_event(run.run_id, "worker:1", "lost")
    store.add_event(run.run_id, "controller", "checkpoint", {"step": 5})
    time.sleep(0.01)
    run.write(5)
    d.refresh()
    shapes = d.figures["convergence"].figure.layout.shapes  # as the frontend and static copies have them
    assert [(s.x0, s.name) for s in shapes] == [(10, "task lost"), (5, "checkpoint")]
    assert shapes[0].label.text == "worker:1 lost"
    layouts = [m.get("layout", {}) for w, m in sent if w is d.figures["convergence"]]
    assert len(layouts) == 1 and "shapes" in layouts[0]
    sent.clear()
    run.write(5)
    d.refresh()  # new rows, no new event: the marks are not sent again
    (message,) = [m for w, m in sent if w is d.figures["convergence"]]
    assert message["type"] == "patch" and "shapes" not in message.get("layout", {})
    # the new points only: each series keeps the points it had and gets the 5 new ones
    assert all(v["x"]["keep"] >= 15 and len(v["x"]["append"]) <= 6 for v in message["traces"].values() if "x" in v)
    assert "worker:1 lost" in d.static_html()


def plots(widget) -> dict[str, str]:
    """The y axis of each plot of a convergence figure, by its title."""
    layout = widget.figure.to_dict()["layout"]
    return {axis["title"]["text"]: "y" + key[len("yaxis"):] for key, axis in layout.items()
            if key.startswith("yaxis") and "title" in axis}


def test_step_metrics_and_the_learning_rate_are_plotted_like_the_loss(store, dashboards):
    run = Writer(store, step_metrics=True, lr=True)
    d = dashboards(store.path, run.run_id)
    run.write(10)
    d.refresh()
    time.sleep(0.01)
    run.write(15)
    d.refresh()
    convergence = d.figures["convergence"].figure
    assert plots(d.figures["convergence"]) == {"loss": "y", "accuracy": "y2", "error_rate": "y3", "logit_scale": "y4",
                                               "lr": "y5"}
    steps = np.arange(1, 26)
    for w in (0, 1):
        raw = [t for t in convergence.data if t.name == f"worker {w}"]
        assert [t.yaxis for t in raw] == ["y", "y2", "y3", "y4"]
        np.testing.assert_array_equal(raw[2].x, steps)
        np.testing.assert_allclose(raw[2].y, 0.5 / steps)
        np.testing.assert_allclose(raw[3].y, 10.0 * (w + 1))
        assert names(d.figures["convergence"]).count(f"worker {w} (smoothed)") == 4
    (lr,) = [t for t in convergence.data if t.name == "learning rate (ps 0)"]
    assert lr.yaxis == "y5" and list(lr.x) == [10, 25] and list(lr.y) == pytest.approx([0.05, 0.1 / 3])
    metrics, ps_metrics = store.metrics(run.run_id), store.ps_metrics(run.run_id)
    same_traces(d.figures["convergence"], figures.convergence_figure(metrics, store.evaluations(run.run_id), None,
                                                                     ps_metrics))
    # still one message per refresh, to the same widget
    before = edits(d)
    time.sleep(0.01)
    run.write(5)
    d.refresh()
    widget, messages = before["convergence"]
    assert edits(d)["convergence"] == (widget, messages + 1)
    convergence = d.figures["convergence"].figure
    assert len(convergence.data[0].x) == 30 and convergence.data[-1].x[-1] == 30
    html = d._repr_mimebundle_()["text/html"]  # the static copy an nbconvert report keeps
    for text in ("error_rate", "logit_scale", "learning rate (ps 0)", "loss, accuracy, error_rate, logit_scale "
                 "and learning rate against global step"):
        assert text in html


def test_a_run_without_step_metrics_learning_rate_or_accuracy_shows_the_loss_alone(store, dashboards):
    run = Writer(store, accuracy=False)
    d = dashboards(store.path, run.run_id)
    for _ in range(2):
        run.write(10)
        d.refresh()
        time.sleep(0.01)
    convergence = d.figures["convergence"]
    assert d.error is None and plots(convergence) == {"loss": "y"}
    assert names(convergence) == ["worker 0", "worker 0 (smoothed)", "worker 1", "worker 1 (smoothed)"]
    assert convergence.figure.layout.title.text == "convergence: loss against global step"
    assert "learning rate" not in d.static_html()
    same_traces(convergence, figures.convergence_figure(store.metrics(run.run_id), None, None,
                                                         store.ps_metrics(run.run_id)))


def test_each_dashboard_reads_the_rows_of_its_own_run(store, dashboards):
    a, b = Writer(store), Writer(store, mode="async")
    da, db = dashboards(store.path, a.run_id), dashboards(store.path, b.run_id)
    for steps in (3, 4):
        a.write(steps)
        b.write(2 * steps)
        da.refresh()
        db.refresh()
    assert list(da.figures["convergence"].figure.data[0].x) == list(range(1, 8))
    assert list(db.figures["convergence"].figure.data[0].x) == list(range(1, 15))


def test_the_thread_stops_by_itself_when_the_run_is_over(store, dashboards):
    run = Writer(store)
    run.write(5)
    d = dashboards(store.path, run.run_id, refresh_s=0.05).start()
    assert wait_until(lambda: "5 / 100" in d.header.value, 5)
    assert d.running
    run.write(5)
    store.set_status(run.run_id, "finished")
    assert wait_until(lambda: not d.running, 5)
    assert "finished" in d.header.value and "10 / 100" in d.header.value
    assert len(d.figures["convergence"].figure.data[0].x) == 10  # the last refresh read everything


def test_errors_show_in_the_header_and_never_raise(store, dashboards, monkeypatch):
    run = Writer(store)
    d = dashboards(store.path, run.run_id, refresh_s=0.02)
    monkeypatch.setattr(d._reader, "read", lambda _: 1 / 0)
    d.start()
    assert wait_until(lambda: not d.running, 5)  # gave up after MAX_FAILURES tries
    assert "ZeroDivisionError" in d.header.value and "stopped refreshing" in d.header.value


def test_unknown_run_is_a_clear_error(store, dashboards):
    with pytest.raises(ConfigError, match="no run 42"):
        dashboards(store.path, 42)


def test_display_bundle_is_the_widget_and_small_static_html_then_the_static_html_alone(store, dashboards):
    run = Writer(store)
    run.write(10)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    bundle = d._repr_mimebundle_()
    assert bundle[WIDGET]["model_id"] == d.box.model_id
    html = bundle["text/html"]
    assert html.count(live.STATIC_CALL) == 6 and "plotly.js v" not in html  # the page loads plotly.js
    assert "fc1.weight: /job:ps/task:0" in html and "chief" in html and "sync-run" in html
    # each figure's widget state holds no plotly.js: a few KB (a plotly FigureWidget's holds 5 MB)
    assert all(len(str(f.get_state())) < 20_000 for f in d.figures.values())  # its view's code (live.js, controls.js)
    store.set_status(run.run_id, "finished")
    d.refresh()
    final = d._repr_mimebundle_()  # a run that is over: what a reopened notebook shows, kernel or not
    assert WIDGET not in final and "finished" in final["text/html"] and final["text/html"].count(live.STATIC_CALL) == 6


def test_a_writer_is_never_disturbed_by_a_polling_dashboard(store, dashboards):
    run = Writer(store)
    run.write(1)
    d = dashboards(store.path, run.run_id, refresh_s=0.02)
    refreshes = []
    refresh = d._refresh
    d._refresh = lambda s: refreshes.append(1) or refresh(s)
    d.start()
    errors, batches = [], 0
    began = time.monotonic()
    # the dashboard polls all along: at least 1.5 s and 3 refreshes (a loaded machine refreshes slower)
    while time.monotonic() - began < 1.5 or (len(refreshes) < 3 and time.monotonic() - began < 30):
        try:
            run.write(5)
            batches += 1
        except Exception as e:  # pragma: no cover - what the test is about
            errors.append(e)
        time.sleep(0.005)
    assert not errors and batches > 20 and len(refreshes) > 2
    assert len(store.metrics(run.run_id)) == 2 * (1 + 5 * batches)
    assert d.running and d.error is None
    store.set_status(run.run_id, "finished")
    assert wait_until(lambda: not d.running, 5)
    assert d.figures["convergence"].figure.data[0].x[-1] == 1 + 5 * batches  # it read every row in the end


def test_show_displays_and_updates_the_display_when_the_run_ends(store, monkeypatch):
    run = Writer(store)
    run.write(3)
    shown, updates = [], []
    handle = SimpleNamespace(update=lambda obj: updates.append(obj._repr_mimebundle_()))
    monkeypatch.setattr("IPython.display.display", lambda obj, display_id: shown.append(obj) or handle)
    d = show(store.path, run.run_id, refresh_s=0.05)
    try:
        assert shown == [d] and d.running and len(d.figures["convergence"].figure.data[0].x) == 3
        run.write(4)
        store.set_status(run.run_id, "finished")
        assert wait_until(lambda: not d.running, 5)
        assert len(updates) == 1 and "finished" in updates[0]["text/html"]
    finally:
        d.close()


def test_compare_runs_by_id_and_by_run_object(store):
    a, b = Writer(store, "sync"), Writer(store, "async")
    a.write(10)
    b.write(20)
    result = compare([a.run_id, SimpleNamespace(id=b.run_id, store=store)], store=store.path)
    assert isinstance(result, Comparison)
    labels = ["sync-run (sync, 2 workers)", "async-run (async, 2 workers)"]
    assert [t.name for t in result.figure.data][:2] == labels
    assert list(result.table["run"]) == labels and list(result.table["global steps"]) == [10, 20]
    bundle = result._repr_mimebundle_()
    assert WIDGET in bundle and bundle["text/html"].count(live.STATIC_CALL) == 1
    with pytest.raises(ConfigError, match="no run 99"):
        compare([99], store=store.path)
    with pytest.raises(ConfigError, match="Run objects or run ids"):
        compare(["run-1"], store=store.path)


@pytest.fixture
def short_raw_window(monkeypatch):
    """A run store that keeps the newest 1,000 metric rows of a run raw (100,000 in use): runs of a few
    thousand steps are as long as a million-step one is for the real window."""
    monkeypatch.setattr(store_module, "RAW_WINDOW", 1000)
    monkeypatch.setattr(store_module, "RAW_SLACK", 100)


def loss_trace(d, worker: int = 0):
    return next(t for t in d.figures["convergence"].figure.data if t.name == f"worker {worker}")


def test_a_dashboard_opened_on_a_run_past_the_raw_window_draws_all_of_it(store, dashboards, short_raw_window):
    run = Writer(store, mode="async")
    for _ in range(12):
        run.write(500)  # 6,000 steps of 2 workers: 12,000 rows
    assert len(store.metrics(run.run_id)) <= 1100  # the older rows live in the rollups only
    d = dashboards(store.path, run.run_id)
    d.refresh()
    for w in (0, 1):
        x, y = np.asarray(loss_trace(d, w).x), np.asarray(loss_trace(d, w).y)
        assert x[0] < 100 and x[-1] == 6000  # from the first buckets on, not from the raw window's first (5,500)
        assert np.all(np.diff(x) > 0)
        early = x < 200
        assert y[early].max() > 0.05  # the early loss (1 / step), as the rollups average it
    assert "of the last 1," in d.figures["staleness"].figure.layout.title.text  # its histogram: the raw rows only
    table = compare([run.run_id], store=store.path).table.iloc[0]
    assert (table["global steps"], table["local steps"]) == (6000, 12000)
    every = np.mean(1 / np.arange(1, 6001))  # the mean loss of all the steps: of the last seconds, no more
    assert 1 / 6000 < table["final loss"] <= every * 1.001


def test_a_dashboard_that_fell_behind_the_raw_window_fills_the_gap(store, dashboards, short_raw_window):
    run = Writer(store, mode="async")
    run.write(500)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    for _ in range(10):
        run.write(500)  # 5,000 more steps while the dashboard did not read: 4,000 of them no longer raw
    d.refresh()
    x = np.asarray(loss_trace(d).x)
    assert x[0] == 1 and x[-1] == 5500
    # no hole where the missed rows were: rollup buckets (64 steps at the finest), thinned with the rest
    assert np.all(np.diff(x) > 0) and np.diff(x).max() <= 4 * 64


def test_pscluster_compare_is_the_function_once_its_module_is_imported():
    """Importing ``pscluster.comparison`` (this module did) leaves ``pscluster.compare`` the function."""
    import pscluster

    assert pscluster.compare is compare


def test_paused_figures_hold_still_while_the_header_follows_and_resume_with_every_row(store, dashboards):
    run = Writer(store)
    run.write(10)
    d = dashboards(store.path, run.run_id)
    d.refresh()
    convergence = d.figures["convergence"]
    sent = convergence.messages
    d.redraw.value = dict(dashboard.REDRAW_CHOICES)["paused"]
    run.write(10)
    d.refresh()
    assert convergence.messages == sent and len(convergence.figure.data[0].x) == 10  # held still
    assert "global step 20 / 100" in d.header.value  # the header follows
    d.redraw.value = dict(dashboard.REDRAW_CHOICES)["live"]
    d.refresh()
    assert convergence.messages == sent + 1 and len(convergence.figure.data[0].x) == 20  # every row, one message


def test_a_slower_redraw_rate_sends_the_figures_at_most_that_often_and_the_end_at_once(store, dashboards):
    run = Writer(store)
    run.write(10)
    d = dashboards(store.path, run.run_id)
    d.redraw.value = dict(dashboard.REDRAW_CHOICES)["every 10 s"]
    d.refresh()  # the first refresh shows the figures
    speed = d.figures["speed"]
    sent = speed.messages
    for _ in range(3):
        run.write(5)
        d.refresh()
    assert speed.messages == sent  # within 10 s of the last redraw
    store.set_status(run.run_id, "finished")
    d.refresh()
    assert speed.messages == sent + 1 and len(d.figures["convergence"].figure.data[0].x) == 25  # the end, at once
