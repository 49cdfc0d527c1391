"""The dashboard's worker panels, kept up to date from the rows new since the last refresh.

A panel is fed new rows of the run store (``feed``: a table's new rows as numpy columns by name,
``figure_specs.Rows``), keeps what its figure needs at a bounded size (``series``) and gives its figure as
plain data (``spec``). The live dashboard feeds a panel a few hundred rows per refresh; ``figures``
feeds a new one all the rows at once, for the same figure. A worker's rows are expected in the order it
reported them.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from ..metrics import speed
from ..metrics.speed import RECENT_S, RunRates
from ..metrics.store import METRIC_COLUMNS
from .marks import Marks
from .series import Decimated, Ewm
from .figure_specs import HEIGHT, Rows, Spec, color, no_data, size, spec

Tables = Mapping[str, Rows]  # new rows by table name: metrics, ps_metrics, evaluations, events, placement

SMOOTH_SPAN = 20  # steps of the exponential moving average
STORE_COLUMNS = {"row", *METRIC_COLUMNS}  # of metric rows; the others are a step_fn's own metrics


def groups(r: Rows, key: str):
    """(value, row mask) for each value of column ``key`` of ``r``, lowest first."""
    if size(r):
        column = r[key]
        for value in np.unique(column):
            yield int(value), column == value


class _WorkerLines:
    """One worker's convergence series: its global steps (``x``) and, for each value it has reported a number
    for (loss, accuracy, a step metric), the raw values and their moving average, thinned together."""

    def __init__(self):
        self.points = Decimated("x", "t")
        self._ewm: dict[str, Ewm] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._ewm

    def names(self) -> set[str]:
        return set(self._ewm)

    def extend(self, x: np.ndarray, t: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Append rows: their global steps, their times and their ``values`` by name. A value joins at the first
        row with a number for it (the loss at once); one these rows lack is NaN at them."""
        for name, v in values.items():
            if name not in self._ewm and (name == "loss" or np.isfinite(v).any()):
                self._ewm[name] = Ewm(SMOOTH_SPAN)
                self.points.add(f"raw:{name}")
                self.points.add(f"smooth:{name}")
        columns = {"x": x, "t": t}
        for name, ewm in self._ewm.items():
            v = values[name] if name in values else np.full(len(x), np.nan)
            columns[f"raw:{name}"], columns[f"smooth:{name}"] = v, ewm.update(v)
        self.points.extend(**columns)

    def raw(self, name: str) -> np.ndarray:
        return self.points[f"raw:{name}"]

    def smoothed(self, name: str) -> np.ndarray:
        return self.points[f"smooth:{name}"]


class Convergence:
    """Loss, accuracy, the step's own metrics and the learning rate against the global step: one plot each,
    stacked on one x axis, each with its own y axis.

    The loss is always there; accuracy and each of a ``step_fn``'s metrics (in name order) once a row has a
    number for them (a model without class logits has no accuracy); the learning rate of ps 0 (a thin line
    in a low plot at the bottom) once a ps sample has one. Per worker: the raw values (thin, translucent,
    named ``worker i``) and their moving average (``worker i (smoothed)``); the periodic test-set
    evaluation as markers (``test set``) on the loss and accuracy; the run's events (lost and replaced
    tasks, restores, checkpoints) as vertical marks across all plots (``marks``).

    For the live view's controls (``live.js``): each point's time in ``customdata``, each smoothed trace's raw
    trace in ``meta.smooths``, and the layout's ``meta.controls`` (the smoothing weight and the run's first
    time)."""

    TITLE = "convergence: loss and accuracy against global step"

    def __init__(self):
        self._workers: dict[int, _WorkerLines] = {}
        self._evaluations = {"global_step": np.empty(0), "loss": np.empty(0), "accuracy": np.empty(0)}
        self._lr = Decimated("x", "lr")
        self.marks = Marks()
        self._start = math.inf  # the first row's time: where relative time starts

    def feed(self, new: Tables) -> bool:
        """Take the new rows of the run's metrics (after its ``history``: rollup buckets as rows, see
        ``reader.RunReader``), evaluations, events and ps samples; whether they change the figure."""
        if "events" in new:  # first: events not yet followed by metric rows are marked where those go on
            self.marks.add_events(new["events"])
        for table in ("history", "metrics"):
            if table in new:
                self._add(new[table])
        if "evaluations" in new:
            for name in self._evaluations:
                values = np.asarray(new["evaluations"][name], dtype=float)
                self._evaluations[name] = np.append(self._evaluations[name], values)
        lr = "ps_metrics" in new and self._add_lr(new["ps_metrics"])
        return lr or bool(new.keys() & {"events", "history", "metrics", "evaluations"})

    def _add(self, metrics: Rows) -> None:
        values = ("loss", "accuracy", *(name for name in metrics if name not in STORE_COLUMNS))
        if size(metrics):
            self._start = min(self._start, float(np.min(metrics["time"])))
        for w, rows in groups(metrics, "worker"):
            lines = self._workers.setdefault(w, _WorkerLines())
            lines.extend(metrics["global_step"][rows], np.asarray(metrics["time"][rows], dtype=float),
                         {name: np.asarray(metrics[name][rows], dtype=float) for name in values})
        self.marks.add_metrics(metrics)

    def _add_lr(self, ps_metrics: Rows) -> bool:
        if "lr" not in ps_metrics:  # a store older than the learning rate
            return False
        lr = np.asarray(ps_metrics["lr"], dtype=float)
        keep = (np.asarray(ps_metrics["ps"]) == 0) & np.isfinite(lr)
        self._lr.extend(x=ps_metrics["step"][keep], lr=lr[keep])
        return bool(keep.any())

    def rows(self) -> list[str]:
        """The values plotted per worker, top to bottom: loss, accuracy (when there is some), the step metrics
        by name. The learning rate, when there is some, comes under them."""
        reported = set().union(*(lines.names() for lines in self._workers.values())) - {"loss", "accuracy"}
        accuracy = any("accuracy" in lines for lines in self._workers.values()) or \
            bool(np.isfinite(self._evaluations["accuracy"]).any())
        return ["loss", *(["accuracy"] if accuracy else []), *sorted(reported)]

    def spec(self) -> Spec:
        """The figure of the rows so far, as plain data."""
        if not self._workers:
            return no_data(self.TITLE)
        rows, lr = self.rows(), len(self._lr) > 0
        axes = {name: "y" if i == 0 else f"y{i + 1}" for i, name in enumerate(rows)}
        traces = []
        for w, lines in sorted(self._workers.items()):
            x, t = lines.points["x"], lines.points["t"]
            for name in rows:
                if name in lines:
                    common = dict(type="scatter", mode="lines", x=x, customdata=t, yaxis=axes[name],
                                  legendgroup=f"worker {w}", showlegend=name == "loss")
                    traces.append(dict(common, y=lines.raw(name), name=f"worker {w}", opacity=0.3,
                                       line=dict(color=color(w), width=1)))
                    traces.append(dict(common, y=lines.smoothed(name), name=f"worker {w} (smoothed)",
                                       meta=dict(smooths=len(traces) - 1), line=dict(color=color(w), width=2)))
        evaluations = self._evaluations
        if len(evaluations["global_step"]):
            for column in ("loss", "accuracy"):
                if column in axes:
                    traces.append(dict(type="scatter", mode="markers", yaxis=axes[column],
                                       x=evaluations["global_step"], y=evaluations[column], name="test set",
                                       legendgroup="test set", showlegend=column == "loss",
                                       marker=dict(color="black", symbol="diamond", size=8)))
        lowest = f"y{len(rows) + 1}" if lr else axes[rows[-1]]
        if lr:
            traces.append(dict(type="scatter", mode="lines", yaxis=lowest, x=self._lr["x"], y=self._lr["lr"],
                               name="learning rate (ps 0)", showlegend=False, line=dict(color="#555555", width=1.5)))
        height, layout = _stacked(rows, lr)
        # the live view's controls: TensorBoard's smoothing weight (this EMA's), log scale, x by step or time
        controls = dict(smoothing=round(1 - 2 / (SMOOTH_SPAN + 1), 4), start=self._start)
        return spec(_title(rows, lr), traces, height=height, shapes=self.marks.shapes(), meta=dict(controls=controls),
                    xaxis=dict(anchor=lowest, title_text="global step"), **layout)


ROW_PX = 130  # the height of one plot of the convergence stack; the learning rate's is half of it
GAP_PX = 22  # between two plots of the stack


def _stacked(rows: list[str], lr: bool) -> tuple[int, dict]:
    """The figure's height and its y axes: one plot per value of ``rows``, and with ``lr`` a half-height one
    for the learning rate, stacked top to bottom."""
    plots = [(name, 1.0, {}) for name in rows]
    if lr:
        plots.append(("lr", 0.5, dict(rangemode="tozero", exponentformat="e", nticks=3)))
    weight = sum(w for _, w, _ in plots)
    height = max(HEIGHT, round(100 + ROW_PX * weight))
    gap = GAP_PX / (height - 85)  # of the plotting area: the height less the top and bottom margins
    unit = (1 - gap * (len(plots) - 1)) / weight
    top, axes = 1.0, {}
    for i, (title, w, style) in enumerate(plots):
        bottom = max(0.0, top - w * unit)
        axes["yaxis" if i == 0 else f"yaxis{i + 1}"] = dict(domain=[round(bottom, 4), round(top, 4)],
                                                            title_text=title, **style)
        top = bottom - gap
    return height, axes


def _title(rows: list[str], lr: bool) -> str:
    """``convergence: loss, accuracy and error_rate against global step``; four step metrics or more are
    counted rather than named (their plots' axes name them)."""
    named, metrics = rows[:1 + ("accuracy" in rows)], rows[1 + ("accuracy" in rows):]
    named += metrics if len(metrics) < 4 else [f"{len(metrics)} step metrics"]
    named += ["learning rate"] if lr else []
    listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
    return f"convergence: {listed} against global step"


class Speed:
    """Local steps/s of each worker over time: at each of its rows, the rise of its local step over its
    last ``RECENT_S`` seconds (fewer at its start) per second, as ``speed.rate`` counts it; so a line ends
    at the number the roles table shows while the run trains (for a worker that reported last).

    The slowest worker by ``worker_rates`` is drawn thicker and named ``worker i (slowest)``; the title
    gives its steps/s. ``live``: whether the run trains still (its rates over its last ``RECENT_S``
    seconds), else over all its rows; the dashboard sets it. Time is in seconds since ``start`` (default:
    the first row). ``rates``: the run's ``speed.RunRates``."""

    TITLE = "speed: local steps/s per worker"

    def __init__(self, *, start: float | None = None, live: bool = False):
        self.start, self.live = start, live
        self.rates = RunRates()
        self._workers: dict[int, tuple[Decimated, np.ndarray, np.ndarray]] = {}  # points, last RECENT_S s of rows

    def feed(self, new: Tables) -> bool:
        """Take the new rows of the run's metrics (after its ``history``); whether any came."""
        for table in ("history", "metrics"):
            if table in new:
                self._add(new[table])
        return bool(new.keys() & {"history", "metrics"})

    def _add(self, metrics: Rows) -> None:
        if self.start is None and size(metrics):
            self.start = float(metrics["time"].min())
        self.rates.add(metrics)
        for w, rows in groups(metrics, "worker"):
            points, last_t, last_steps = self._workers.get(w) or (Decimated("t", "rate"), np.empty(0), np.empty(0))
            t = np.concatenate([last_t, metrics["time"][rows].astype(float)])
            steps = np.concatenate([last_steps, metrics["local_step"][rows].astype(float)])
            new = np.arange(len(last_t), len(t))
            rate = speed.over_time(t, steps)[new]
            ok = np.isfinite(rate)
            points.extend(t=t[new][ok], rate=rate[ok])
            keep = t >= t[-1] - RECENT_S
            self._workers[w] = points, t[keep], steps[keep]

    def worker_rates(self) -> dict[int, float]:
        """Each worker's steps/s by ``speed.rate`` (live or not, as ``live`` says), by worker index: the
        roles table's numbers."""
        return self.rates.workers(live=self.live)

    def slowest(self) -> tuple[int, float] | None:
        """The slowest worker and its steps/s, when there are several with a rate."""
        rates = {w: r for w, r in self.worker_rates().items() if not math.isnan(r)}
        if len(rates) < 2:
            return None
        w = min(rates, key=rates.get)
        return w, rates[w]

    def spec(self) -> Spec:
        """The figure of the rows so far, as plain data."""
        if not self._workers:
            return no_data(self.TITLE)
        title, slowest = self.TITLE, None
        if found := self.slowest():
            slowest, rate = found
            title += f" · slowest: worker {slowest} ({rate:.1f} steps/s)"
        traces = [dict(type="scatter", mode="lines", x=points["t"] - self.start, y=points["rate"],
                       name=f"worker {w}" + (" (slowest)" if w == slowest else ""),
                       line=dict(color=color(w), width=4 if w == slowest else 1.5))
                  for w, (points, *_) in sorted(self._workers.items())]
        return spec(title, traces, xaxis=dict(title_text="time (s)"),
                    yaxis=dict(title_text=f"steps/s (over {RECENT_S:g} s)", rangemode="tozero"))


class Staleness:
    """Histogram of the staleness of applied pushes (dropped pushes have none), for async training.

    A few far outliers would squash the others into one bar at the left, so the x axis ends at ``q``: one
    more than the highest staleness below the top ``TAIL`` of the pushes (one push at least), when the
    highest staleness is more than twice ``q``; the pushes from ``q`` up are counted in one bar named
    ``≥ q``. The title gives the mean and the highest. Rollups keep no histogram: of a run read after its
    oldest rows left the raw window (given a ``history``), the histogram counts the pushes since, as its title
    says."""

    TITLE = "staleness of applied pushes"
    TAIL = 0.01

    def __init__(self):
        self._counts: dict[int, int] = {}
        self._partial = False  # whether older pushes were in rows no longer held raw

    def feed(self, new: Tables) -> bool:
        """Take the new rows of the run's metrics; whether any came."""
        self._partial |= "history" in new
        if "metrics" not in new:
            return False
        metrics = new["metrics"]
        staleness, dropped = metrics["staleness"].astype(float), metrics["dropped"].astype(float)
        applied = staleness[~np.isnan(staleness) & (np.nan_to_num(dropped) == 0)].astype(int)
        for value, count in zip(*np.unique(applied, return_counts=True)):
            self._counts[int(value)] = self._counts.get(int(value), 0) + int(count)
        return True

    def spec(self) -> Spec:
        """The figure of the rows so far, as plain data."""
        if not self._counts:
            return no_data(self.TITLE)
        values = np.array(sorted(self._counts))
        counts = np.array([self._counts[v] for v in values])
        mean, highest = float((values * counts).sum() / counts.sum()), int(values[-1])
        tail = np.cumsum(counts[::-1])[::-1] <= max(1.0, self.TAIL * counts.sum())  # few pushes at or above
        q = int(values[np.argmax(tail) - 1]) + 1 if tail[1:].any() else highest + 1
        q = q if highest > 2 * q else highest + 1  # no tail bar when nothing is far out
        below = values < q
        traces = [dict(type="bar", x=values[below].astype(float), y=counts[below].astype(float),
                       name="applied pushes", marker_color=color(0))]
        if not below.all():
            traces.append(dict(type="bar", x=[float(q)], y=[float(counts[~below].sum())], name=f"≥ {q}",
                               text=[f"≥ {q}"], textposition="outside", marker_color="#888888"))
        of = f", of the last {counts.sum():,}" if self._partial else ""
        return spec(f"{self.TITLE} (mean {mean:.2f}, max {highest}{of})", traces,
                    xaxis=dict(title_text="staleness (global steps)", dtick=1 if q <= 20 else None),
                    yaxis=dict(title_text="pushes"))
