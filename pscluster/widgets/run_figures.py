"""The figures of one run, by name, as both views draw them: the notebook's dashboard and the side panel.

``RunFigures`` holds the panels a run has (its mode decides between the sync and the async ones) and the
placement figure. The dashboard feeds it the run store's new rows at each refresh; the side panel's server
(``pscluster.labserver``) reads a run in one go (``read``) and serves the same specs as JSON
(``live.figure_json``), which the panel draws with plotly.js as they come. A chart added here shows in both.
"""

from __future__ import annotations

import pandas as pd

from ..footprint import optimizer_slot_names
from ..metrics.store import RunStore
from . import figures, panels, ps_panels
from .figure_specs import Spec, no_data, rows
from .reader import RunReader
from .task_table import FINAL


class RunFigures:
    """The figures of the run of ``record`` (a run-store record): ``placement`` first, then its panels' in the
    order the dashboard shows them (``names``)."""

    def __init__(self, record: dict):
        started = record["started"]
        self.panels = {"speed": panels.Speed(start=started, live=record["status"] not in FINAL),
                       "convergence": panels.Convergence()}
        if (record["config"] or {}).get("aggregates_steps"):
            self.panels["waiting"] = ps_panels.Waiting(_tasks(record, "worker"), start=started)
        else:
            self.panels["staleness"] = panels.Staleness()
        self.panels["ps_load"] = ps_panels.PsLoad(start=started)
        self.panels["traffic"] = ps_panels.Traffic(num_ps=_tasks(record, "ps"))
        self.placement: Spec = no_data("placement")
        self.slots: list[str] = []  # the optimizer's slots a ps keeps beside each trained variable

    @property
    def names(self) -> list[str]:
        return ["placement", *self.panels]

    def place(self, placement: pd.DataFrame, record: dict) -> Spec:
        """The placement figure of the run's ``placement`` (``RunStore.placement``), recorded once."""
        config = record["config"] or {}
        self.slots = optimizer_slot_names(config.get("optimizer", "sgd"), config.get("optimizer_kwargs") or {})
        self.placement = figures.placement_spec(placement, len(self.slots), num_ps=_tasks(record, "ps"))
        return self.placement

    def feed(self, new: panels.Tables, record: dict) -> set[str]:
        """Feed the panels the new rows (``RunReader.read``) of the run now at ``record``; the names of the
        figures they changed."""
        if "waiting" in self.panels:
            self.panels["waiting"].num_workers = _tasks(record, "worker")  # workers come and go with scaling
        self.panels["speed"].live = record["status"] not in FINAL  # its rates: lately while it trains, then of all
        return {name for name, panel in self.panels.items() if panel.feed(new)}

    def spec(self, name: str) -> Spec:
        return self.placement if name == "placement" else self.panels[name].spec()

    def specs(self) -> dict[str, Spec]:
        """Every figure by name, in the order of ``names``."""
        return {name: self.spec(name) for name in self.names}


def _tasks(record: dict, role: str) -> int:
    """How many tasks of ``role`` (ps, worker) the run's cluster spec has (none for a run recorded without one)."""
    return len((record["spec"] or {}).get(role, []))


class FollowedRun:
    """The figures of run ``run_id`` kept up to date from its store: each ``update`` reads only the rows stored
    since the last one (``RunReader``), as the dashboard's refresh does, and gives the same figures as one read of
    them all."""

    def __init__(self, run_id: int):
        self.run_id = run_id
        self.figures: RunFigures | None = None
        self._reader = RunReader(run_id)
        self._placed = False  # the placement is recorded once, when training starts

    def update(self, store: RunStore) -> RunFigures | None:
        """The figures after what ``store`` holds now; None when it has no such run."""
        record = store.run(self.run_id)  # first: once it says the run is over, the rows read after it are complete
        if record is None:
            return None
        new = self._reader.read(store)
        if self.figures is None:
            self.figures = RunFigures(record)
        if not self._placed:
            placement = store.placement(self.run_id)
            if len(placement):
                self.figures.place(placement, record)
                new["placement"], self._placed = rows(placement), True  # for the traffic each ps should carry
        self.figures.feed(new, record)
        return self.figures


def read(store: RunStore, run_id: int) -> RunFigures | None:
    """The figures of run ``run_id`` of ``store`` as its dashboard draws them after one refresh: every row the
    store holds of it (its oldest as their rollups); None when there is no such run."""
    return FollowedRun(run_id).update(store)
