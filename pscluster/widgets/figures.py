"""Dashboard figures: pure functions from run-store DataFrames to plotly figures.

No widgets and no I/O here. The inputs are shaped like the answers of ``pscluster.metrics.store``
(``metrics``, ``ps_metrics``, ``placement``, ``evaluations``, ``events``); the live dashboard's panels
(``panels``, ``ps_panels``) draw most of these figures, fed here all the rows at once. ``pscluster.compare``,
``Cluster.plan`` and the tests call these functions. An empty input gives an empty figure that says
"no data yet", never an error.
"""

from __future__ import annotations

import html
import math
import time
from typing import NamedTuple

import pandas as pd
import plotly.graph_objects as go

from ..footprint import placement_line
from ..metrics import speed
from .panels import SMOOTH_SPAN, Convergence, Speed, Staleness
from .ps_panels import PsLoad, Traffic, Waiting
from .series import Decimated, Ewm
from .figure_specs import Spec, color, columns, figure, no_data, rows, spec


def no_data_figure(title: str) -> go.Figure:
    """The figure shown before a run has produced what ``title`` plots."""
    return figure(no_data(title))


def steps_per_second(metrics: pd.DataFrame, *, live: bool = False) -> pd.Series:
    """Local steps/s of each worker by ``speed.rate`` (a Series by worker index): over the run's last
    ``speed.RECENT_S`` seconds when ``live`` (NaN for a worker with fewer than two rows there: a stalled or
    lost one), else over all its rows."""
    return pd.Series(speed.of(metrics).workers(live=live), dtype=float)


def _drawn(panel, **frames: pd.DataFrame | None) -> go.Figure:
    """The figure of a new ``panel`` fed all the rows of ``frames`` (by table name) at once."""
    panel.feed({table: rows(frame) for table, frame in frames.items() if frame is not None and len(frame)})
    return figure(panel.spec())


def convergence_figure(metrics: pd.DataFrame, evaluations: pd.DataFrame | None = None,
                       events: pd.DataFrame | None = None, ps_metrics: pd.DataFrame | None = None) -> go.Figure:
    """Loss, accuracy and the step's own metrics (``metrics``' other columns) against the global step, per
    worker raw and smoothed, with the test-set evaluations, the learning rate of ps 0 (from ``ps_metrics``)
    and the run's events as marks: see ``panels.Convergence``."""
    return _drawn(Convergence(), metrics=metrics, evaluations=evaluations, events=events, ps_metrics=ps_metrics)


def speed_figure(metrics: pd.DataFrame, *, start: float | None = None, live: bool = False) -> go.Figure:
    """Local steps/s of each worker over time, the slowest highlighted: see ``panels.Speed``."""
    return _drawn(Speed(start=start, live=live), metrics=metrics)


def staleness_figure(metrics: pd.DataFrame) -> go.Figure:
    """Histogram of the staleness of applied pushes: see ``panels.Staleness``."""
    return _drawn(Staleness(), metrics=metrics)


def waiting_figure(ps_metrics: pd.DataFrame, num_workers: int, *, last_s: float = 30.0,
                   start: float | None = None) -> go.Figure:
    """Sync training: who the current step waits for, over the last ``last_s`` seconds: see
    ``ps_panels.Waiting``."""
    return _drawn(Waiting(num_workers, last_s=last_s, start=start), ps_metrics=ps_metrics)


def ps_load_figure(ps_metrics: pd.DataFrame, *, start: float | None = None) -> go.Figure:
    """Bytes/s and requests/s of each ps task over time: see ``ps_panels.PsLoad``."""
    return _drawn(PsLoad(start=start), ps_metrics=ps_metrics)


def traffic_share_figure(placement: pd.DataFrame, ps_metrics: pd.DataFrame | None = None, *,
                         num_ps: int | None = None) -> go.Figure:
    """Share of the traffic each ps task carries, predicted from the placement next to measured: see
    ``ps_panels.Traffic``."""
    return _drawn(Traffic(num_ps=num_ps), placement=placement, ps_metrics=ps_metrics)


def placement_spec(placement: pd.DataFrame, optimizer_slots: int, *, num_ps: int | None = None) -> Spec:
    """Bytes held by each ps task, stacked by variable, optimizer state included.

    Each trained variable counts ``bytes × (1 + optimizer_slots)``: the ps keeps the optimizer's state next to
    the variable; frozen parameters and buffers count their bytes alone, and say what they are on hover.
    ``num_ps`` also shows ps tasks that hold nothing.
    """
    title = f"placement: bytes per ps (variables + {optimizer_slots} optimizer slot(s) each)"
    if placement.empty:
        return no_data(title)
    num_ps = max(num_ps or 0, int(placement["ps"].max()) + 1)

    def kind(v) -> str:
        return getattr(v, "kind", "param")

    traces = [dict(type="bar", x=[f"ps:{v.ps}"],
                   y=[int(v.bytes) * (1 + (optimizer_slots if kind(v) == "param" else 0))],
                   name=v.variable if kind(v) == "param" else f"{v.variable} ({kind(v)})",
                   showlegend=len(placement) <= 12, hovertext=f"{v.variable} {tuple(v.shape)} {v.dtype}"
                   + ("" if kind(v) == "param" else f", {kind(v)}"), hoverinfo="text+y")
              for v in placement.itertuples(index=False)]
    return spec(title, traces, barmode="stack",
                xaxis=dict(categoryorder="array", categoryarray=[f"ps:{i}" for i in range(num_ps)]),
                yaxis=dict(title_text="bytes", ticksuffix="B"))


def placement_figure(placement: pd.DataFrame, optimizer_slots: int, *, num_ps: int | None = None) -> go.Figure:
    """The figure of ``placement_spec``."""
    return figure(placement_spec(placement, optimizer_slots, num_ps=num_ps))


def _rows(v) -> tuple[int, int] | None:
    """The rows ``(start, stop)`` of a placement row that is a shard (``part`` set), else None."""
    part = getattr(v, "part", None)
    return None if part is None or pd.isna(part) else (int(v.start), int(v.stop))


def placement_lines(placement: pd.DataFrame, slot_names: tuple[str, ...] = ()) -> list[str]:
    """One TF-style line per variable or shard: ``fc1.weight: /job:ps/task:0``, or for a shard of a
    partitioned variable ``emb.weight/part_1: /job:ps/task:1 (rows 500-999, 125.0 KB)``; after each trained one,
    a line per optimizer slot the ps keeps beside it (``slot_names``, see ``footprint.optimizer_slot_names``),
    as TF's device log lists ``weights_1/Adam``: ``fc1.weight/exp_avg: /job:ps/task:0``. Frames without the
    ``part``, ``start`` and ``stop`` columns (a store of schema 1) are whole variables."""
    lines = []
    for v in placement.itertuples(index=False):
        kind, rows = getattr(v, "kind", "param"), _rows(v)
        lines.append(placement_line(v.variable, int(v.ps), rows, int(v.bytes), kind))
        if kind == "param":
            lines += [placement_line(f"{v.variable}/{slot}", int(v.ps), rows, int(v.bytes)) for slot in slot_names]
    return lines


def sparkline_path(values: list[float]) -> str:
    """The SVG path (``d``) of a sparkline of ``values`` in the unit square: the first value at x 0, the last at
    x 1, the lowest at y 1 (the bottom), the highest at y 0; non-finite values left out; '' for fewer than 2."""
    finite = [v for v in values if math.isfinite(v)]
    if len(values) < 2 or not finite:
        return ""
    lo, hi = min(finite), max(finite)
    lo, hi = (lo - 1, hi + 1) if lo == hi else (lo, hi)
    points = [(i / (len(values) - 1), (hi - v) / (hi - lo)) for i, v in enumerate(values) if math.isfinite(v)]
    return "".join(f"{'L' if i else 'M'}{x:.4g},{y:.4g}" for i, (x, y) in enumerate(points))


def number(v: float, digits: int) -> str:
    """``v`` with ``digits`` decimals, or below 1 with ``digits + 1`` significant digits, so that a small
    number shows as itself (0.00032, not 0.00)."""
    return f"{v:.{digits}f}" if v == 0 or abs(v) >= 1 else f"{v:.{digits + 1}g}"


def table_html(frame: pd.DataFrame, digits: int = 1) -> str:
    """A small HTML table of ``frame`` (floats as ``number`` with ``digits``, NaN blank)."""
    def cell(v):
        if isinstance(v, float):
            return "" if math.isnan(v) else number(v, digits)
        return html.escape(str(v))
    style = "padding: 1px 10px; text-align: left"
    head = "".join(f"<th style='{style}'>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td style='{style}'>{cell(v)}</td>" for v in row) + "</tr>"
                   for row in frame.to_numpy(dtype=object).tolist())
    return f"<table style='border-collapse: collapse; font-size: 12px'><tr>{head}</tr>{body}</table>"


# --- comparing runs -----------------------------------------------------------------------------
class ComparedRun(NamedTuple):
    """One run of a comparison: its label; ``series``, its loss by global step for every worker
    (``RunStore.series``: raw rows or rollup buckets, whatever the run's length); ``recent``, the same by
    time over its last ``speed.RECENT_S`` seconds; when it started and ended (its run-store record's;
    ``ended`` None while it trains)."""

    label: str
    series: pd.DataFrame
    recent: pd.DataFrame
    started: float
    ended: float | None


def compare_spec(runs: list[ComparedRun], metric: str = "loss") -> Spec:
    """Several runs side by side: ``metric`` (default the loss; one their ``series`` hold) against global step
    (mean over workers, smoothed; left) and the global and the local steps/s (summed over workers) of each run by
    ``speed.rate`` (bars; right)."""
    title = "compare runs: convergence and speed"
    runs = [r for r in runs if len(r.series)]
    if not runs:
        return no_data(title)
    traces = []
    for i, run in enumerate(runs):
        column = f"{metric}_mean"
        if column not in run.series:  # a run without this metric
            continue
        values = _weighted_mean(run.series.dropna(subset=[column]), "x", column)
        points = Decimated("x", "y")
        points.extend(x=values.index.to_numpy(), y=Ewm(SMOOTH_SPAN).update(values.to_numpy()))
        traces.append(dict(type="scatter", mode="lines", x=points["x"], y=points["y"], name=run.label,
                           line_color=color(i)))
    table = compare_table(runs)
    for name, column, bar_color in (("global steps/s", "global steps/s", "#636efa"),
                                    ("local steps/s (all workers)", "local steps/s", "#b6bcfb")):
        traces.append(dict(type="bar", xaxis="x2", yaxis="y2", x=list(table["run"]),
                           y=table[column].to_numpy(dtype=float), name=name, marker_color=bar_color))
    return spec(title, traces, barmode="group", **columns(
        0.62, left=dict(title_text=f"{metric} (mean over workers)", x=dict(title_text="global step")),
        right=dict(title_text="steps/s")))


def compare_figure(runs: list[ComparedRun], metric: str = "loss") -> go.Figure:
    """The figure of ``compare_spec``."""
    return figure(compare_spec(runs, metric))


def compared_run(store, run_id: int, label: str, names: tuple[str, ...] = ("loss",), *,
                 points: int = 2000) -> ComparedRun | None:
    """Run ``run_id`` of ``store`` (a ``RunStore``) as a comparison takes it: its metrics ``names`` (the loss
    among them, for its final loss) at most ``points`` per worker; None when there is no such run."""
    record = store.run(run_id)
    if record is None:
        return None
    names = tuple(dict.fromkeys(("loss", *names)))
    series = store.series(run_id, names, max_points=points)
    last = float(series["time_last"].max()) if len(series) else 0.0
    recent = store.series(run_id, ["loss"], x="time", start=last - speed.RECENT_S, max_points=points)
    return ComparedRun(label, series, recent, record["started"], record["ended"])


def _weighted_mean(series: pd.DataFrame, by: str | None = None, column: str = "loss_mean"):
    """The mean of ``column`` over the rows ``series`` holds (each bucket's mean weighted by its rows), by ``by``."""
    weighted = series.assign(total=series[column] * series["count"])
    if by is None:
        return weighted["total"].sum() / weighted["count"].sum() if len(weighted) else math.nan
    sums = weighted.groupby(by)[["total", "count"]].sum()
    return sums["total"] / sums["count"]


def compare_table(runs: list[ComparedRun]) -> pd.DataFrame:
    """One row per run: workers, global step, local steps (rows), its times by ``speed.phases`` (wall s:
    ``RunStore.runs()``'s ``wall_s``, to now while it trains; startup s; training s), global and local
    steps/s (summed over workers) by ``speed.rate`` (live while it trains), and the final loss: the mean
    loss of the rows of its last ``speed.RECENT_S`` seconds (of any worker)."""
    table = []
    for run in runs:
        s, live = run.series, run.ended is None
        rates = speed.of_buckets(s, run.recent)
        times = speed.phases(run.started, run.ended, rates.span(), time.time())
        local = [r for r in rates.workers(live=live).values() if not math.isnan(r)]
        table.append([run.label, s["worker"].nunique(), int(s["step_last"].max()) if len(s) else 0,
                      int(s["count"].sum()),
                      *(math.nan if times[k] is None else times[k] for k in ("wall_s", "startup_s", "training_s")),
                      rates.run(live=live), sum(local) if local else math.nan,
                      _weighted_mean(run.recent.dropna(subset=["loss_mean"]))])
    return pd.DataFrame(table, columns=["run", "workers", "global steps", "local steps", "wall s", "startup s",
                                        "training s", "global steps/s", "local steps/s", "final loss"])
