"""Dashboard figures: pure functions from run-store DataFrames to plotly figures.

No widgets and no I/O here. The inputs are shaped like the answers of ``pscluster.metrics.store``
(``metrics``, ``ps_metrics``, ``placement``, ``evaluations``, ``events`` and the ``run`` record);
the dashboard, ``pscluster.compare`` and the tests call these functions. An empty input gives an
empty figure that says "no data yet", never an error.
"""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from ..runtime.placement import placement_line

HEIGHT = 300
TEMPLATE = "plotly_white"
COLORS = qualitative.Plotly
MAX_POINTS = 500  # per trace: bounds widget messages and static HTML on long runs
SMOOTH_SPAN = 20  # steps of the exponential moving average
PS_SAMPLE_S = 0.5  # how often each ps task samples its counters
FINAL = ("finished", "failed", "stopped")
ROLE_COLUMNS = ["role", "task", "host", "device", "state", "steps/s"]


# --- helpers ------------------------------------------------------------------------------------
# The dashboard rebuilds its figures several times a second while a run trains: figures are built in
# one constructor call from plain dicts and numpy arrays, with subplots laid out by hand (two rows
# sharing one x axis, or two columns), and without plotly's validation, which costs 5-10x the rest.
# The template goes by name: validation (a FigureWidget, static HTML) resolves it, and a template object
# would be deep-copied into every figure. The tests build every figure again with validation on.
def _figure(title: str, traces: list[dict], *, height: int = HEIGHT, **layout) -> go.Figure:
    """A figure in the dashboard's style: compact, ``plotly_white``, a small title at the top left."""
    traces = [{k: v.to_numpy() if isinstance(v, (pd.Series, pd.Index)) else v for k, v in t.items()}
              for t in traces]
    return go.Figure(data=traces, layout=dict(
        template=TEMPLATE, height=height, title=dict(text=title, x=0.01, font=dict(size=14)),
        margin=dict(l=55, r=20, t=45, b=40), legend=dict(font=dict(size=10)), **layout), _validate=False)


def no_data_figure(title: str) -> go.Figure:
    """The figure shown before a run has produced what ``title`` plots."""
    return _figure(title, [], xaxis=dict(visible=False), yaxis=dict(visible=False),
                   annotations=[dict(text="no data yet", x=0.5, y=0.5, xref="paper", yref="paper",
                                     showarrow=False, font=dict(size=14, color="gray"))])


def _columns(split: float = 0.5, *, left: dict, right: dict) -> dict:
    """Layout of two side-by-side plots; traces of the right one use ``xaxis="x2", yaxis="y2"``.
    ``left`` and ``right`` are y axis properties, with the x axis's under the key ``"x"``."""
    return dict(xaxis=dict(domain=[0, split - 0.05], **left.pop("x", {})), yaxis=left,
                xaxis2=dict(domain=[split + 0.05, 1], anchor="y2", **right.pop("x", {})),
                yaxis2=dict(anchor="x2", **right))


def _color(i: int) -> str:
    return COLORS[int(i) % len(COLORS)]


def _thin(n: int, max_points: int = MAX_POINTS):
    """Positions of at most about ``max_points`` of ``n`` evenly spaced points, the last one kept."""
    if n <= max_points:
        return slice(None)
    return np.unique(np.append(np.arange(0, n, math.ceil(n / max_points)), n - 1))


def _smooth(values: pd.Series) -> np.ndarray:
    """Exponential moving average over ``SMOOTH_SPAN`` points (NaNs skipped)."""
    return values.astype(float).ewm(span=SMOOTH_SPAN, min_periods=1).mean().to_numpy()


def _by_worker(metrics: pd.DataFrame):
    """(worker index, its rows in time order) for each worker, lowest index first."""
    for w, g in metrics.groupby("worker", sort=True):
        yield int(w), g if g["time"].is_monotonic_increasing else g.sort_values("time")


def _start(frame: pd.DataFrame, start: float | None) -> float:
    return frame["time"].min() if start is None else start


def steps_per_second(metrics: pd.DataFrame, *, recent_s: float | None = None) -> pd.Series:
    """Local steps per second of each worker (a Series by worker index): its increase of ``local_step``
    over the time span of its rows, or of its rows in the last ``recent_s`` seconds of the run (NaN
    for a worker with fewer than two rows there: a stalled or lost one)."""
    if metrics.empty:
        return pd.Series(dtype=float)
    rows = metrics if recent_s is None else metrics[metrics["time"] >= metrics["time"].max() - recent_s]
    by_worker = rows.groupby("worker")
    span = by_worker["time"].max() - by_worker["time"].min()
    rate = (by_worker["local_step"].max() - by_worker["local_step"].min()) / span.where(span > 0)
    return rate.reindex(sorted(metrics["worker"].unique())).astype(float)


# --- figures ------------------------------------------------------------------------------------
def convergence_figure(metrics: pd.DataFrame, evaluations: pd.DataFrame | None = None) -> go.Figure:
    """Loss (top) and accuracy (bottom) against the global step.

    Per worker: the raw values (thin, translucent, named ``worker i``) and their moving average
    (``worker i (smoothed)``); the periodic test-set evaluation as markers (``test set``) when present.
    """
    title = "convergence: loss and accuracy against global step"
    if metrics.empty:
        return no_data_figure(title)
    traces = []
    for w, g in _by_worker(metrics):
        keep = _thin(len(g))
        x = g["global_step"].to_numpy()[keep]
        for axis, column in (("y", "loss"), ("y2", "accuracy")):
            common = dict(type="scatter", mode="lines", x=x, yaxis=axis, legendgroup=f"worker {w}",
                          showlegend=axis == "y")
            traces.append(dict(common, y=g[column].astype(float).to_numpy()[keep], name=f"worker {w}",
                               opacity=0.3, line=dict(color=_color(w), width=1)))
            traces.append(dict(common, y=_smooth(g[column])[keep], name=f"worker {w} (smoothed)",
                               line=dict(color=_color(w), width=2)))
    if evaluations is not None and not evaluations.empty:
        for axis, column in (("y", "loss"), ("y2", "accuracy")):
            traces.append(dict(type="scatter", mode="markers", yaxis=axis, x=evaluations["global_step"],
                               y=evaluations[column], name="test set", legendgroup="test set",
                               showlegend=axis == "y", marker=dict(color="black", symbol="diamond", size=8)))
    return _figure(title, traces, height=HEIGHT + 60, xaxis=dict(anchor="y2", title_text="global step"),
                   yaxis=dict(domain=[0.54, 1], title_text="loss"),
                   yaxis2=dict(domain=[0, 0.46], title_text="accuracy"))


def speed_figure(metrics: pd.DataFrame, *, window: int = 10, start: float | None = None) -> go.Figure:
    """Local steps/s of each worker over time (a rolling rate over ``window`` steps).

    The slowest worker (lowest mean steps/s) is drawn thicker and named ``worker i (slowest)``.
    Time is in seconds since ``start`` (default: the first row).
    """
    title = "speed: local steps/s per worker"
    if metrics.empty:
        return no_data_figure(title)
    mean = steps_per_second(metrics).dropna()
    slowest = int(mean.idxmin()) if len(mean) > 1 else None
    if slowest is not None:
        title += f" · slowest: worker {slowest} ({mean[slowest]:.1f} steps/s)"
    t0 = _start(metrics, start)
    traces = []
    for w, g in _by_worker(metrics):
        t, steps = g["time"].to_numpy(), g["local_step"].to_numpy()
        k = max(1, min(window, len(g) - 1))
        with np.errstate(divide="ignore", invalid="ignore"):
            rate = (steps[k:] - steps[:-k]) / (t[k:] - t[:-k])
        ok = np.isfinite(rate)
        t, rate = t[k:][ok] - t0, rate[ok]
        keep = _thin(len(t))
        traces.append(dict(type="scatter", mode="lines", x=t[keep], y=rate[keep],
                           name=f"worker {w}" + (" (slowest)" if w == slowest else ""),
                           line=dict(color=_color(w), width=4 if w == slowest else 1.5)))
    return _figure(title, traces, xaxis=dict(title_text="time (s)"),
                   yaxis=dict(title_text="steps/s", rangemode="tozero"))


def placement_figure(placement: pd.DataFrame, optimizer_slots: int, *, num_ps: int | None = None) -> go.Figure:
    """Bytes held by each ps task, stacked by variable, optimizer state included.

    Each variable counts ``bytes × (1 + optimizer_slots)``: the ps keeps the optimizer's state next to
    the variable. ``num_ps`` also shows ps tasks that hold nothing.
    """
    title = f"placement: bytes per ps (variables + {optimizer_slots} optimizer slot(s) each)"
    if placement.empty:
        return no_data_figure(title)
    num_ps = max(num_ps or 0, int(placement["ps"].max()) + 1)
    traces = [dict(type="bar", x=[f"ps:{v.ps}"], y=[v.bytes * (1 + optimizer_slots)], name=v.variable,
                   showlegend=len(placement) <= 12, hovertext=f"{v.variable} {tuple(v.shape)} {v.dtype}",
                   hoverinfo="text+y")
              for v in placement.itertuples(index=False)]
    return _figure(title, traces, barmode="stack",
                   xaxis=dict(categoryorder="array", categoryarray=[f"ps:{i}" for i in range(num_ps)]),
                   yaxis=dict(title_text="bytes", ticksuffix="B"))


def _rows(v) -> tuple[int, int] | None:
    """The rows ``(start, stop)`` of a placement row that is a shard (``part`` set), else None."""
    part = getattr(v, "part", None)
    return None if part is None or pd.isna(part) else (int(v.start), int(v.stop))


def placement_lines(placement: pd.DataFrame) -> list[str]:
    """One TF-style line per variable or shard: ``fc1.weight: /job:ps/task:0``, or for a shard of a
    partitioned variable ``emb.weight/part_1: /job:ps/task:1 (rows 500-999, 125.0 KB)``. Frames without the
    ``part``, ``start`` and ``stop`` columns (a store of schema 1) are whole variables."""
    return [placement_line(v.variable, int(v.ps), _rows(v), int(v.bytes)) for v in placement.itertuples(index=False)]


def _ps_bytes_so_far(ps_metrics: pd.DataFrame, num_ps: int) -> np.ndarray:
    """Bytes in + out each ps task has moved so far: the sum of the rises of its cumulative counters (a
    restarted ps counts from 0 again; what it moved before its first sample after the restart is lost)."""
    ps, t = ps_metrics["ps"].to_numpy(dtype=int), ps_metrics["time"].to_numpy(dtype=float)
    total = ps_metrics["bytes_in"].to_numpy(dtype=float) + ps_metrics["bytes_out"].to_numpy(dtype=float)
    order = np.lexsort((t, ps))
    ps, total = ps[order], total[order]
    first = np.r_[True, ps[1:] != ps[:-1]]  # each ps task's first sample counts from 0
    rise = np.where(first, total, np.clip(np.diff(total, prepend=0.0), 0, None))
    return np.bincount(ps, weights=rise, minlength=num_ps)


def traffic_share_figure(placement: pd.DataFrame, ps_metrics: pd.DataFrame | None = None, *,
                         num_ps: int | None = None) -> go.Figure:
    """Share of the traffic each ps task carries: predicted from the placement next to measured.

    Predicted: the ps task's share of the dense variables' bytes (every step pulls and pushes all of a
    dense variable, so traffic follows bytes). Sparse variables move only the rows a batch touches, which
    placement cannot predict: they are left out of the prediction and named in the title. Measured: the
    ps task's share of all bytes in + out so far (``ps_metrics``' cumulative counters), sparse included.
    """
    title = "share of traffic per ps: predicted (from placement) vs measured (bytes in+out so far)"
    has_ps = ps_metrics is not None and not ps_metrics.empty
    if placement.empty and not has_ps:
        return no_data_figure(title)
    counts = [num_ps or 0]
    for frame in (placement, ps_metrics if has_ps else placement):
        if not frame.empty:
            counts.append(int(frame["ps"].max()) + 1)
    num_ps = max(counts)
    x = [f"ps:{i}" for i in range(num_ps)]
    sparse = placement["sparse"].astype(bool).to_numpy() if "sparse" in placement else \
        np.zeros(len(placement), bool)
    dense = placement[~sparse]
    predicted = np.bincount(dense["ps"].to_numpy(dtype=int), weights=dense["bytes"].to_numpy(dtype=float),
                            minlength=num_ps)
    measured = _ps_bytes_so_far(ps_metrics, num_ps) if has_ps else np.zeros(num_ps)
    traces = []
    for name, values, color, what in (("predicted (dense variable bytes)", predicted, "#b6bcfb", "bytes held"),
                                      ("measured (bytes in + out so far)", measured, "#636efa", "bytes moved")):
        total = values.sum()
        share = values / total * 100 if total > 0 else np.full(num_ps, np.nan)
        traces.append(dict(type="bar", x=x, y=share, name=name, marker_color=color,
                           hovertext=[f"{what}: {v:,.0f}" for v in values], hoverinfo="text+y+name"))
    if sparse.any():
        names = list(dict.fromkeys(v.split("/part_")[0] for v in placement["variable"][sparse]))
        title += f" · sparse, moved by touched rows only (not predicted): {', '.join(names[:3])}" + \
            (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return _figure(title, traces, barmode="group",
                   xaxis=dict(categoryorder="array", categoryarray=x),
                   yaxis=dict(title_text="share of bytes (%)", rangemode="tozero", ticksuffix="%"))


def staleness_figure(metrics: pd.DataFrame) -> go.Figure:
    """Histogram of the staleness of applied pushes (dropped pushes have none), for async training."""
    title = "staleness of applied pushes"
    staleness = metrics["staleness"] if not metrics.empty else pd.Series(dtype=float)
    staleness = staleness[staleness.notna() & (metrics["dropped"].fillna(0) == 0)].astype(int) \
        if len(staleness) else staleness
    if staleness.empty:
        return no_data_figure(title)
    counts = staleness.value_counts().sort_index()
    return _figure(f"{title} (mean {staleness.mean():.2f}, max {staleness.max()})",
                   [dict(type="bar", x=counts.index, y=counts.to_numpy(), name="applied pushes",
                         marker_color=_color(0))],
                   xaxis=dict(title_text="staleness (global steps)", dtick=1 if counts.index.max() <= 20 else None),
                   yaxis=dict(title_text="pushes"))


def waiting_figure(ps_metrics: pd.DataFrame, num_workers: int, *, last_s: float = 30.0,
                   start: float | None = None) -> go.Figure:
    """Sync training: which workers the current step still waits for, as a worker × time heat strip
    over the last ``last_s`` seconds (seconds since ``start``).

    A cell is lit when a ps sample in that ``PS_SAMPLE_S`` slot waited for the worker; the title names
    the workers the latest samples wait for and counts the stale gradients dropped so far.
    """
    if ps_metrics.empty:
        return no_data_figure("sync: waiting for workers")
    t0 = _start(ps_metrics, start)
    recent = ps_metrics[ps_metrics["time"] > ps_metrics["time"].max() - last_s]
    waiting: dict[int, set] = {}
    for slot, workers in zip(((recent["time"] - t0) // PS_SAMPLE_S).astype(int), recent["waiting_for"]):
        waiting.setdefault(slot, set()).update(workers)
    slots = sorted(waiting)
    latest = ps_metrics.loc[ps_metrics.groupby("ps")["time"].idxmax()]
    who = ", ".join(f"worker {w}" for w in sorted(set().union(*latest["waiting_for"]))) or "nobody"
    # A stale gradient is dropped by every ps it reaches: the largest counter counts each once.
    dropped = int(latest["dropped_stale"].max())
    workers = range(max([num_workers, *[w + 1 for s in waiting.values() for w in s]]))
    heat = dict(type="heatmap", x=np.array(slots) * PS_SAMPLE_S, y=[f"worker {w}" for w in workers],
                z=[[int(w in waiting[s]) for s in slots] for w in workers], zmin=0, zmax=1, showscale=False,
                colorscale=[[0, "#eeeeee"], [1, "#ef553b"]], xgap=1, ygap=3, name="waiting for",
                hovertemplate="%{y} at %{x:.1f} s: %{z}<extra></extra>")
    return _figure(f"sync: step {int(latest['step'].max())} waits for {who} · {dropped} stale gradients dropped",
                   [heat], xaxis=dict(title_text="time (s)"), yaxis=dict(autorange="reversed"))


def _ps_rates(ps_metrics: pd.DataFrame):
    """(ps, sample times, bytes/s in + out, requests/s) per ps task, from the differences of its
    cumulative counters between samples; NaN where a counter goes down (a restarted ps)."""
    for ps, g in ps_metrics.groupby("ps", sort=True):
        g = g if g["time"].is_monotonic_increasing else g.sort_values("time")
        t = g["time"].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            rates = [np.diff(counter.to_numpy().astype(float)) / np.diff(t)
                     for counter in (g["bytes_in"] + g["bytes_out"], g["pushes"] + g["pulls"])]
        yield int(ps), t[1:], *(np.where(r >= 0, r, np.nan) for r in rates)


def ps_load_figure(ps_metrics: pd.DataFrame, *, start: float | None = None) -> go.Figure:
    """Bytes/s (left) and requests/s (pushes + pulls; right) of each ps task over time (seconds since
    ``start``), from the differences of the ps tasks' cumulative counters."""
    title = "ps load: bytes/s and requests/s per ps"
    rates = [r for r in _ps_rates(ps_metrics) if len(r[1])] if not ps_metrics.empty else []
    if not rates:
        return no_data_figure(title)
    t0 = _start(ps_metrics, start)
    traces = []
    for ps, t, bytes_per_s, requests_per_s in rates:
        keep = _thin(len(t))
        for axes, y in ((("x", "y"), bytes_per_s), (("x2", "y2"), requests_per_s)):
            traces.append(dict(type="scatter", mode="lines", xaxis=axes[0], yaxis=axes[1], x=t[keep] - t0,
                               y=y[keep], name=f"ps {ps}", legendgroup=f"ps {ps}", showlegend=axes[0] == "x",
                               line_color=_color(ps)))
    return _figure(title, traces, **_columns(
        left=dict(title_text="bytes/s", ticksuffix="B", rangemode="tozero", x=dict(title_text="time (s)")),
        right=dict(title_text="requests/s", rangemode="tozero", x=dict(title_text="time (s)"))))


# --- tables -------------------------------------------------------------------------------------
def _task_states(events: pd.DataFrame) -> dict[str, str]:
    """The latest reported state of each task: its last 'state' event, or 'lost' / 'done'."""
    states = {}
    for task, kind, detail in zip(events["task"], events["kind"], events["detail"]):
        if kind == "state":
            states[task] = detail.get("state", "?")
        elif kind in ("lost", "done"):
            states[task] = kind
    return states


def roles_frame(record: dict | None, metrics: pd.DataFrame, events: pd.DataFrame, *,
                recent_s: float = 5.0) -> pd.DataFrame:
    """The cluster's tasks: role (ps, chief for worker 0, worker), task, host, device, state and the
    steps/s of each worker over the last ``recent_s`` seconds.

    The state is a task's latest state event ("waiting for chief", "training", "lost"...); once the
    run is over it is the run's final status, except for tasks that were lost.
    """
    if not record or not record.get("spec"):
        return pd.DataFrame(columns=ROLE_COLUMNS)
    status = record["status"]
    states = _task_states(events) if not events.empty else {}
    rates = steps_per_second(metrics, recent_s=recent_s)
    rows = []
    for task in [*record["spec"].get("ps", []), *record["spec"].get("worker", [])]:
        name = f"{task['role']}:{task['index']}"
        is_worker = task["role"] == "worker"
        state = states.get(name) or ("serving" if status == "training" and not is_worker else status)
        if status in FINAL and state != "lost":
            state = status
        rows.append([("chief" if task["index"] == 0 else "worker") if is_worker else task["role"], name,
                     task.get("host", ""), task.get("device", ""), state,
                     rates.get(task["index"], np.nan) if is_worker else np.nan])
    return pd.DataFrame(rows, columns=ROLE_COLUMNS)


def table_html(frame: pd.DataFrame, digits: int = 1) -> str:
    """A small HTML table of ``frame`` (floats with ``digits`` decimals, NaN blank)."""
    def cell(v):
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.{digits}f}"
        return html.escape(str(v))
    style = "padding: 1px 10px; text-align: left"
    head = "".join(f"<th style='{style}'>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join("<tr>" + "".join(f"<td style='{style}'>{cell(v)}</td>" for v in row) + "</tr>"
                   for row in frame.itertuples(index=False))
    return f"<table style='border-collapse: collapse; font-size: 12px'><tr>{head}</tr>{body}</table>"


# --- comparing runs -----------------------------------------------------------------------------
def _run_rates(metrics: pd.DataFrame) -> tuple[float, float]:
    """(global steps/s, local steps/s summed over workers) of one run."""
    if metrics.empty:
        return np.nan, np.nan
    span = metrics["time"].max() - metrics["time"].min()
    global_rate = (metrics["global_step"].max() - metrics["global_step"].min()) / span if span > 0 else np.nan
    return float(global_rate), float(steps_per_second(metrics).sum(min_count=1))


def compare_figure(runs: list[tuple[str, pd.DataFrame]]) -> go.Figure:
    """Several runs side by side: loss against global step (mean over workers, smoothed; left) and
    global and local steps per second of each run (bars; right). ``runs``: (label, metrics) pairs."""
    title = "compare runs: convergence and speed"
    runs = [(label, m) for label, m in runs if not m.empty]
    if not runs:
        return no_data_figure(title)
    traces = []
    for i, (label, m) in enumerate(runs):
        loss = m.groupby("global_step")["loss"].mean()
        keep = _thin(len(loss))
        traces.append(dict(type="scatter", mode="lines", x=loss.index.to_numpy()[keep], y=_smooth(loss)[keep],
                           name=label, line_color=_color(i)))
    labels = [label for label, _ in runs]
    rates = [_run_rates(m) for _, m in runs]
    for k, (name, color) in enumerate((("global steps/s", "#636efa"), ("local steps/s (all workers)", "#b6bcfb"))):
        traces.append(dict(type="bar", xaxis="x2", yaxis="y2", x=labels, y=[r[k] for r in rates], name=name,
                           marker_color=color))
    return _figure(title, traces, barmode="group", **_columns(
        0.62, left=dict(title_text="loss (mean over workers)", x=dict(title_text="global step")),
        right=dict(title_text="steps/s")))


def compare_table(runs: list[tuple[str, pd.DataFrame]]) -> pd.DataFrame:
    """One row per run: workers, global and local steps, wall time, steps/s and the final loss
    (mean of the last ``SMOOTH_SPAN`` rows)."""
    rows = []
    for label, m in runs:
        global_rate, local_rate = _run_rates(m)
        last = m.sort_values("time").tail(SMOOTH_SPAN)
        rows.append([label, m["worker"].nunique(), int(m["global_step"].max()) if len(m) else 0, len(m),
                     float(m["time"].max() - m["time"].min()) if len(m) else 0.0, global_rate, local_rate,
                     float(last["loss"].mean()) if len(m) else np.nan])
    return pd.DataFrame(rows, columns=["run", "workers", "global steps", "local steps", "wall s",
                                       "global steps/s", "local steps/s", "final loss"])
