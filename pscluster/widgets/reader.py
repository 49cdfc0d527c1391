"""What the live dashboard reads of its run at each refresh: the rows stored since the last read, as
numpy columns (no DataFrames: a refresh reads a few hundred rows several times a second), and the history
of the metric rows the store no longer holds raw (``history``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from ..metrics.store import ROLLED, RunStore
from .figure_specs import MAX_POINTS, Rows, size

TABLES = ("events", "metrics", "evaluations", "ps_metrics")
_JSON = ("waiting_for", "detail")
_TEXT = ("task", "kind")
_STEP_METRICS = "extra"  # of a metric row: its step_fn's own metrics, as JSON {name: value} (or NULL)
HISTORY_POINTS = 4 * MAX_POINTS  # per worker and gap: what the figures thin to MAX_POINTS anyway
_HISTORY_ROLLED = ("loss", "accuracy")  # the rolled-up metrics a history row has (with a step_fn's)


class RunReader:
    """Reads the rows of run ``run_id`` stored since its last read, table by table, with the store's row
    cursors.

    The store keeps a run's newest metric rows raw and the older ones only in rollups (``RunStore.series``).
    Where a worker's rows skip local steps the reader never saw (a run longer than the raw window when it is
    first read, or a reader that fell behind it), ``read`` gives their rollup buckets under ``history``: one
    row per bucket of at most ``HISTORY_POINTS`` per worker and gap, at the bucket's last time, global and
    local step, with the means of its loss, accuracy and step_fn metrics."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self._cursors = dict.fromkeys(TABLES, 0)
        self._last: dict[int, tuple[float, float]] | None = None  # each worker's last (global, local) step read

    def read(self, store: RunStore) -> dict[str, Rows]:
        """The new rows of each table that has some (``TABLES``), as columns: numbers as float arrays
        (NULL as NaN), JSON decoded, a metric row's own metrics as one column each (as
        ``RunStore.metrics`` has them); ``history``, when there is some, comes before ``metrics``."""
        new = {}
        for table in TABLES:
            names, rows = store.new_rows(table, self.run_id, self._cursors[table])
            if rows:
                self._cursors[table] = rows[-1][0]
                cells = np.array(rows, dtype=object)  # a column is a slice: 3x faster than zip(*rows) on 100k rows
                columns = {name: cells[:, i] for i, name in enumerate(names) if i}
                extra = columns.pop(_STEP_METRICS, None)
                new[table] = {name: _column(name, values) for name, values in columns.items()}
                if extra is not None:
                    new[table].update(_step_metrics(extra, taken=new[table]))
        history = self._history(store, new.get("metrics"))
        return {"history": history, **new} if history else new

    def _history(self, store: RunStore, metrics: Rows | None) -> Rows | None:
        """The rollup buckets of what each worker's new ``metrics`` rows skip, as rows (see the class)."""
        first_read, last = self._last is None, self._last or {}
        gaps = {}  # worker: (after this global step, before this one); None: open
        newest = None if metrics is None or not size(metrics) else float(np.max(metrics["global_step"]))
        workers = np.asarray(metrics["worker"]) if newest is not None else np.empty(0)
        for w in np.unique(workers).tolist():
            rows = workers == w
            first = int(np.argmax(rows))
            global_step, local_step = float(metrics["global_step"][first]), float(metrics["local_step"][first])
            after, seen = last.get(w, (None, 0.0))
            if local_step > seen + 1:
                gaps[w] = (after, global_step)
            i = len(rows) - 1 - int(np.argmax(rows[::-1]))
            last[w] = float(metrics["global_step"][i]), float(metrics["local_step"][i])
        if first_read and store.schema_version >= 5:  # workers whose every row is past the raw window
            for w in store.latest(self.run_id)["workers"]:
                if w not in last:
                    gaps[w] = (None, None if newest is None else newest + 1)
        self._last = last
        if not gaps or store.schema_version < 5:
            return None
        names = [*_HISTORY_ROLLED, *(n for n in store.series_names(self.run_id) if n not in ROLLED)]
        parts = []
        for w, (after, before) in sorted(gaps.items()):
            found = store.series(self.run_id, names, start=after, stop=before, max_points=HISTORY_POINTS, workers=[w])
            at = found["step_last"].to_numpy()  # where a history row goes: after what was read, before the new rows
            inside = (at > (-np.inf if after is None else after)) & (at < (np.inf if before is None else before))
            parts.append(found[inside])
        found = pd.concat(parts)
        if not len(found):
            return None
        columns = {"worker": found["worker"].to_numpy(dtype=float), "time": found["time_last"].to_numpy(dtype=float),
                   "local_step": found["local_last"].to_numpy(dtype=float),
                   "global_step": found["step_last"].to_numpy(dtype=float)}
        return columns | {name: found[f"{name}_mean"].to_numpy(dtype=float) for name in names}


def _column(name: str, values: tuple):
    if name in _JSON:
        return [json.loads(v) for v in values]
    return np.array(values, dtype=object if name in _TEXT else float)


def _step_metrics(texts: tuple, taken) -> dict[str, np.ndarray]:
    """The metrics of each row (JSON ``{name: value}`` or None) as one float column per name, NaN where a row
    has none; names ``taken`` by the store's own columns are left out, as ``RunStore.metrics`` does."""
    if not any(texts):
        return {}
    decoded = json.loads(f"[{','.join(t or 'null' for t in texts)}]")  # one parse for all the rows
    names = dict.fromkeys(name for d in decoded if d for name in d)
    return {name: np.array([d.get(name, math.nan) if d else math.nan for d in decoded], dtype=float)
            for name in names if name not in taken}
