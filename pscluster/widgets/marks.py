"""A run's events as vertical marks on the convergence plot: where a task was lost, where it was replaced,
where the ps tasks restored a checkpoint (a rollback) and where checkpoints were written."""

from __future__ import annotations

import math

import numpy as np

from .series import Decimated
from .figure_specs import MAX_POINTS, Rows, size

# event kind: legend name, line color and dash, whether the mark carries a label
KINDS = {
    "lost": ("task lost", "#d62728", "dash", True),
    "replaced": ("task replaced", "#2ca02c", "dash", True),
    "restored": ("restored from a checkpoint", "#1f77b4", "solid", True),
    "checkpoint": ("checkpoint", "#999999", "dot", False),
}


class Marks:
    """The marks of a run's events, kept up to date from its new events and metric rows.

    Checkpoint and restore events carry their global step. A lost or replaced task is marked at the
    global step of the last metric row reported at or before the event; until rows from after the event
    have arrived, that step is provisional and computed again."""

    def __init__(self):
        self._events: list[tuple[float, str, str, int | None]] = []  # time, kind, task, step if known
        self._timeline = Decimated("time", "step", cap=4 * MAX_POINTS)  # global step against time
        self._latest = -math.inf  # the latest metric row's time
        self._shapes: list[dict] | None = []  # None: to build again

    def add_events(self, events: Rows) -> None:
        """New rows of the run's events (columns ``time``, ``task``, ``kind``, ``detail`` as a dict)."""
        for t, task, kind, detail in zip(events["time"], events["task"], events["kind"], events["detail"]):
            if kind in KINDS:
                step = detail.get("step") if kind in ("checkpoint", "restored") else None
                self._events.append((float(t), kind, task, None if step is None else int(step)))
                self._shapes = None

    def add_metrics(self, metrics: Rows) -> None:
        """New metric rows (columns ``time`` and ``global_step``)."""
        if not size(metrics):
            return
        times = np.maximum.accumulate(np.append(self._latest, metrics["time"]))[1:]  # for a sorted search
        self._timeline.extend(time=times, step=metrics["global_step"])
        if any(step is None and t >= self._latest for t, _, _, step in self._events):
            self._shapes = None
        self._latest = float(times[-1])

    def _step_at(self, t: float) -> int:
        i = np.searchsorted(self._timeline["time"], t, side="right") - 1
        return int(self._timeline["step"][i]) if i >= 0 else 0

    def shapes(self) -> list[dict]:
        """The marks as plotly layout shapes: vertical lines across both plots, one legend entry per kind."""
        if self._shapes is None:
            self._shapes, named = [], set()
            for t, kind, task, step in self._events:
                name, color, dash, labelled = KINDS[kind]
                x = self._step_at(t) if step is None else step
                label = f"restored step {step}" if kind == "restored" else f"{task} {kind}"
                self._shapes.append(dict(
                    type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=1, layer="below",
                    line=dict(color=color, width=1, dash=dash), name=name, legendgroup=kind,
                    showlegend=kind not in named, label=dict(text=label if labelled else "", font=dict(size=9),
                                                             textposition="end")))
                named.add(kind)
        return self._shapes
