"""Any run of the run store, from any process: a script's run (``train_from_environment``), one another kernel
trains, or one long over. ``pscluster.open_run(...)`` gives a ``StoredRun``, which reads the store only: its
dashboard is live while the run trains, wherever the run's supervisor lives.
"""

from __future__ import annotations

import numbers
import time

import pandas as pd

from .errors import ConfigError, RuntimeTimeout
from .metrics.store import RunStore

FINAL = ("finished", "failed", "stopped")
WAIT_POLL_S = 0.5


class StoredRun:
    """Run ``run_id`` of ``store``, read from the store on each call (see the module docstring)."""

    def __init__(self, store: RunStore, run_id: int):
        self.store = store
        self.id = run_id

    @property
    def record(self) -> dict:
        """The run's row: name, cluster, mode, status, started, ended, config, spec, summary."""
        return self.store.run(self.id)

    @property
    def name(self) -> str:
        return self.record["name"]

    @property
    def status(self) -> str:
        return self.record["status"]

    def dashboard(self) -> None:
        """Display the run's dashboard: live while it trains, the final figures once it is over."""
        from .widgets import show

        show(self.store.path, self.id)

    def metrics(self) -> pd.DataFrame:
        """Per-step worker metrics, as ``Run.metrics()``."""
        return self.store.metrics(self.id)

    def evaluations(self) -> pd.DataFrame:
        """The run's evaluations (global_step, time, loss, accuracy), the evaluator task's included."""
        return self.store.evaluations(self.id)

    def events(self) -> pd.DataFrame:
        """The run's events (time, task, kind, detail), as ``Run.events()``."""
        return self.store.events(self.id)

    def summary(self) -> dict | None:
        """The summary its supervisor stored at the end (as ``Run.summary()``); None while it trains."""
        return self.record["summary"]

    def wait(self, timeout: float | None = None) -> StoredRun:
        """Return once the run has ended (finished, failed or stopped); RuntimeTimeout after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status not in FINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeTimeout(f"run {self.id} ({self.name}) is still {self.status} after {timeout:.0f}s")
            time.sleep(WAIT_POLL_S)
        return self

    def __repr__(self) -> str:
        return f"<pscluster StoredRun {self.id} {self.name!r} ({self.status}) in {self.store.path}>"


def open_run(run: int | str | None = None, *, store=None) -> StoredRun:
    """A run of the run store (``store``: a path or RunStore, default ``$PSCLUSTER_HOME/runs.sqlite``): ``run``
    is a run id, a run name (its newest run of that name, e.g. a script's file name) or None (the newest
    run)."""
    runs = store if isinstance(store, RunStore) else RunStore(store, readonly=True)
    table = runs.runs()  # newest first
    if isinstance(run, numbers.Integral) and not isinstance(run, bool):
        found = table[table["id"] == int(run)]
    elif isinstance(run, str):
        found = table[table["name"] == run]
    elif run is None:
        found = table
    else:
        raise ConfigError(f"open_run({run!r}): give a run id, a run name or nothing (the newest run)")
    if found.empty:
        names = ", ".join(dict.fromkeys(table["name"].head(5)))
        raise ConfigError(f"no run {run!r} in the run store {runs.path}"
                          + (f" (its newest: {names}): see pscluster.runs()" if names else ": it holds no run yet"))
    return StoredRun(runs, int(found["id"].iloc[0]))
