"""What the live dashboard reads of its run at each refresh: the rows stored since the last read, as
numpy columns (no DataFrames: a refresh reads a few hundred rows several times a second)."""

from __future__ import annotations

import json
import math

import numpy as np

from ..metrics.store import RunStore
from .specs import Rows

TABLES = ("events", "metrics", "evaluations", "ps_metrics")
_JSON = ("waiting_for", "detail")
_TEXT = ("task", "kind")
_STEP_METRICS = "extra"  # of a metric row: its step_fn's own metrics, as JSON {name: value} (or NULL)


class RunReader:
    """Reads the rows of run ``run_id`` stored since its last read, table by table, with the store's row
    cursors."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self._cursors = dict.fromkeys(TABLES, 0)

    def read(self, store: RunStore) -> dict[str, Rows]:
        """The new rows of each table that has some (``TABLES``), as columns: numbers as float arrays
        (NULL as NaN), JSON decoded, a metric row's own metrics as one column each (as
        ``RunStore.metrics`` has them)."""
        new = {}
        for table in TABLES:
            names, rows = store.new_rows(table, self.run_id, self._cursors[table])
            if rows:
                self._cursors[table] = rows[-1][0]
                columns = dict(zip(names[1:], list(zip(*rows))[1:]))
                extra = columns.pop(_STEP_METRICS, None)
                new[table] = {name: _column(name, values) for name, values in columns.items()}
                if extra is not None:
                    new[table].update(_step_metrics(extra, taken=new[table]))
        return new


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
