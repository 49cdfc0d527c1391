"""Compare runs from the run store: convergence and speed overlaid, and a short table.

``compare([run_a, run_b])`` takes Run objects or run ids. The result displays like the dashboard: a
live figure (``widgets.live``) in JupyterLab, static HTML in an nbconvert report.
"""

from __future__ import annotations

import numbers

import pandas as pd
import plotly.graph_objects as go

from .errors import ConfigError
from .metrics import speed
from .metrics.store import RunStore, default_path
from .widgets import figures
from .widgets.dashboard import FigureView

POINTS = 2000  # per worker and run: what a run of any length is read as


class Comparison(FigureView):
    """The comparison of some runs: ``figure`` (a plotly Figure) and ``table`` (a DataFrame, one row a run)."""

    def __init__(self, figure: go.Figure, table: pd.DataFrame):
        self.figure = figure
        self.table = table

    def _tail_html(self) -> str:
        return figures.table_html(self.table, digits=2)


def _source(run, store) -> tuple[str, int]:
    """(store path, run id) of a Run object or a run id."""
    if isinstance(run, numbers.Integral):
        return (getattr(store, "path", store) or default_path()), int(run)
    try:
        return run.store.path, run.id
    except AttributeError:
        raise ConfigError(f"cannot compare {run!r}: pass Run objects or run ids (see pscluster.runs())") from None


def compare(runs, *, store=None) -> Comparison:
    """Overlay the convergence and speed of ``runs`` (Run objects, or run ids in ``store``: a path or a
    RunStore, default ``$PSCLUSTER_HOME/runs.sqlite``). Each run is labelled by name, mode and workers; the
    table (``figures.compare_table``) gives its times, its steps/s and its final loss. A run of any length
    costs the same: its metrics are read as ``RunStore.series``."""
    compared, stores = [], {}
    try:
        for run in runs:
            path, run_id = _source(run, store)
            if path not in stores:
                stores[path] = RunStore(path, readonly=True)
            record = stores[path].run(run_id)
            if record is None:
                raise ConfigError(f"no run {run_id} in the run store {path}: see pscluster.runs()")
            workers = len((record["spec"] or {}).get("worker", []))
            label = f"{record['name']} ({record['mode']}, {workers} worker{'s' * (workers != 1)})"
            if any(label == seen.label for seen in compared):
                label += f" #{run_id}"
            series = stores[path].series(run_id, ["loss"], max_points=POINTS)
            last = float(series["time_last"].max()) if len(series) else 0.0
            recent = stores[path].series(run_id, ["loss"], x="time", start=last - speed.RECENT_S, max_points=POINTS)
            compared.append(figures.ComparedRun(label, series, recent, record["started"], record["ended"]))
    finally:
        for s in stores.values():
            s.close()
    return Comparison(figures.compare_figure(compared), figures.compare_table(compared))
