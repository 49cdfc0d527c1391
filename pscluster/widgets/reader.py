"""What the live dashboard reads of its run at each refresh: the rows stored since the last read, as
numpy columns (no DataFrames: a refresh reads a few hundred rows several times a second)."""

from __future__ import annotations

import json

import numpy as np

from ..metrics.store import RunStore
from .specs import Rows

TABLES = ("events", "metrics", "evaluations", "ps_metrics")
_JSON = ("waiting_for", "detail")
_TEXT = ("task", "kind")


class RunReader:
    """Reads the rows of run ``run_id`` stored since its last read, table by table, with the store's row
    cursors."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self._cursors = dict.fromkeys(TABLES, 0)

    def read(self, store: RunStore) -> dict[str, Rows]:
        """The new rows of each table that has some (``TABLES``), as columns: numbers as float arrays
        (NULL as NaN), JSON decoded."""
        new = {}
        for table in TABLES:
            names, rows = store.new_rows(table, self.run_id, self._cursors[table])
            if rows:
                self._cursors[table] = rows[-1][0]
                new[table] = {name: _column(name, values) for name, values in zip(names[1:], list(zip(*rows))[1:])}
        return new


def _column(name: str, values: tuple):
    if name in _JSON:
        return [json.loads(v) for v in values]
    return np.array(values, dtype=object if name in _TEXT else float)
