"""PlacementPlan: where a model's variables would live on the ps tasks, before any training.

``Cluster.plan(model_fn, placement="greedy", partition={"embedding": 2}, optimizer="adam")`` returns one;
it needs no running cluster. It displays like ``pscluster.compare``: a table of bytes per ps, the TF-style
placement lines and a figure of predicted bytes per ps (optimizer state included), as a widget in
JupyterLab and as static HTML in an nbconvert report. ``compare_placements`` tabulates several plans.
A view: it reads the shards handed to it (objects with ``variable``, ``shape``, ``nbytes``, ``ps``...), never
the runtime.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd

from ..errors import ConfigError
from ..footprint import format_bytes, optimizer_slot_names
from ..metrics.store import placement_frame
from . import figures
from .dashboard import FigureView

TABLE_COLUMNS = ["ps", "variables", "parameters", "bytes", "optimizer bytes", "total bytes", "share (%)"]
BYTE_COLUMNS = ("bytes", "optimizer bytes", "total bytes")


class PlacementPlan(FigureView):
    """The predicted placement of a model's variables on ``num_ps`` ps tasks.

    ``shards``: the VariableSpecs (whole variables, and shards of partitioned ones), in model order.
    ``table``: one row per ps task: ``variables`` (variables and shards it holds), ``parameters``
    (elements), ``bytes`` (the variables), ``optimizer bytes`` (the optimizer state the ps keeps next to
    them: ``slots`` parameter-sized tensors each), ``total bytes`` and ``share (%)`` of the total.
    ``lines``: the TF-style lines (``emb.weight/part_1: /job:ps/task:1 (rows 500-999, 125.0 KB)``), with the
    optimizer slots kept beside each trained variable (``fc1.weight/exp_avg: /job:ps/task:0``).
    ``figure``: bytes per ps stacked by variable, optimizer state included. ``label``: the placement's name.
    """

    def __init__(self, shards, num_ps: int, *, optimizer: str = "sgd", optimizer_kwargs: dict | None = None,
                 label: str = ""):
        self.shards = tuple(shards)
        self.num_ps = num_ps
        self.optimizer = optimizer
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.slot_names = optimizer_slot_names(optimizer, self.optimizer_kwargs)
        self.slots = len(self.slot_names)
        self.label = label
        self.frame = placement_frame(self.shards)  # as the run store keeps a run's placement
        self.table = _table(self.shards, num_ps, self.slots)
        self.lines = figures.placement_lines(self.frame, self.slot_names)
        self.figure = figures.placement_figure(self.frame, self.slots, num_ps=num_ps)

    @property
    def bytes_per_ps(self) -> list[int]:
        """Total bytes (variables + optimizer state) each ps task would hold."""
        return [int(b) for b in self.table["total bytes"]]

    @property
    def imbalance(self) -> float:
        """The most loaded ps task's bytes over the mean: 1.0 is a perfect balance."""
        loads = self.bytes_per_ps
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else math.nan

    def summary(self) -> str:
        loads = self.bytes_per_ps
        busiest = int(np.argmax(loads))
        return (f"{self.label + ': ' if self.label else ''}{len(self.shards)} variables/shards on {self.num_ps} "
                f"ps, {self.optimizer} ({self.slots} optimizer slot{'s' * (self.slots != 1)}): "
                f"{format_bytes(sum(loads))} in all, at most {format_bytes(loads[busiest])} on ps:{busiest}, "
                f"imbalance {self.imbalance:.2f} (max / mean)")

    def __repr__(self) -> str:
        return "\n".join([f"<PlacementPlan {self.summary()}>", *self.lines])

    def _head_html(self) -> str:
        shown = self.table.assign(**{c: self.table[c].map(format_bytes) for c in BYTE_COLUMNS})
        return (f"<b>{html.escape(self.summary())}</b>{figures.table_html(shown, digits=1)}"
                f"<pre style='font-size: 12px'>{html.escape(chr(10).join(self.lines))}</pre>")


def _table(shards, num_ps: int, slots: int) -> pd.DataFrame:
    rows = [[ps, 0, 0, 0] for ps in range(num_ps)]
    for v in shards:
        row = rows[v.ps]
        row[1] += 1
        row[2] += math.prod(v.shape)
        row[3] += v.nbytes
    table = pd.DataFrame(rows, columns=TABLE_COLUMNS[:4])
    trained = [0] * num_ps  # only trained variables have optimizer state
    for v in shards:
        trained[v.ps] += v.nbytes if getattr(v, "kind", "param") == "param" else 0
    table["optimizer bytes"] = pd.Series(trained) * slots
    table["total bytes"] = table["bytes"] + table["optimizer bytes"]
    total = table["total bytes"].sum()
    table["share (%)"] = table["total bytes"] / total * 100 if total else math.nan
    return table


def compare_placements(plans: Mapping[str, PlacementPlan] | Iterable[PlacementPlan]) -> pd.DataFrame:
    """One row per plan (``{label: plan}``, or plans labelled by their ``label``): the most and least bytes
    a ps task holds (optimizer state included), the mean, and the imbalance (max / mean; 1.0 is even)."""
    pairs = list(plans.items()) if isinstance(plans, Mapping) else [(p.label, p) for p in plans]
    if not pairs or not all(isinstance(p, PlacementPlan) for _, p in pairs):
        raise ConfigError("compare_placements takes PlacementPlans (from Cluster.plan), e.g. "
                          "{'round-robin': cluster.plan(model), 'greedy': cluster.plan(model, placement='greedy')}")
    rows = []
    for label, plan in pairs:
        loads = plan.bytes_per_ps
        rows.append([label, plan.num_ps, max(loads), min(loads), sum(loads) / len(loads), plan.imbalance])
    return pd.DataFrame(rows, columns=["placement", "ps", "max bytes per ps", "min bytes per ps",
                                       "mean bytes per ps", "imbalance (max/mean)"])


def placement_label(placement, partition) -> str:
    """A short name for a placement: ``greedy``, ``explicit`` or a function's name, with the partition."""
    if isinstance(placement, str):
        label = placement.replace("-", "_").lower()
    elif isinstance(placement, Mapping):
        label = "explicit"
    else:
        label = getattr(placement, "__name__", type(placement).__name__)
    if partition:
        label += " + " + ", ".join(f"{k}={getattr(v, 'shards', None) or v}" for k, v in dict(partition).items())
    return label
