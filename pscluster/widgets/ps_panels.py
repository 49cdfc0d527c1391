"""The dashboard's ps panels, kept up to date from the ps samples new since the last refresh (as in
``panels``): who a sync step waits for, the load of each ps task, its share of the traffic."""

from __future__ import annotations

import math

import numpy as np

from .panels import Tables, groups
from .series import Decimated
from .figure_specs import Rows, Spec, color, columns, no_data, size, spec

PS_SAMPLE_S = 0.5  # how often each ps task samples its counters


class Waiting:
    """Sync training: which workers the current step still waits for, as a worker × time heat strip over
    the last ``last_s`` seconds (seconds since ``start``, default: the first sample).

    A cell is lit when a ps sample in that ``PS_SAMPLE_S`` slot waited for the worker (the legend at the
    right says so); the title names the workers the latest samples wait for and counts the stale
    gradients dropped so far."""

    TITLE = "sync: waiting for workers"

    def __init__(self, num_workers: int, *, last_s: float = 30.0, start: float | None = None):
        self.num_workers, self.last_s, self.start = num_workers, last_s, start
        self._recent: list[tuple[float, list[int]]] = []  # (time, workers waited for) of the last last_s seconds
        self._latest: dict[int, tuple[float, int, int, list[int]]] = {}  # ps: time, step, dropped, waiting for

    def feed(self, new: Tables) -> bool:
        """Take the new samples of the ps tasks; whether any came."""
        if "ps_metrics" not in new:
            return False
        ps_metrics = new["ps_metrics"]
        if self.start is None:
            self.start = float(ps_metrics["time"].min())
        for ps, t, step, dropped, waiting in zip(ps_metrics["ps"], ps_metrics["time"], ps_metrics["step"],
                                                 ps_metrics["dropped_stale"], ps_metrics["waiting_for"]):
            self._recent.append((float(t), waiting))
            if t >= self._latest.get(int(ps), (-math.inf,))[0]:
                self._latest[int(ps)] = float(t), int(step), int(dropped), waiting
        newest = max(t for t, _ in self._recent)
        self._recent = [(t, w) for t, w in self._recent if t > newest - self.last_s]
        return True

    def spec(self) -> Spec:
        """The figure of the rows so far, as plain data."""
        if not self._latest:
            return no_data(self.TITLE)
        waiting: dict[int, set] = {}
        for t, workers in self._recent:
            waiting.setdefault(int((t - self.start) // PS_SAMPLE_S), set()).update(workers)
        slots = sorted(waiting)
        latest = self._latest.values()
        who = ", ".join(f"worker {w}" for w in sorted(set().union(*(w for *_, w in latest)))) or "nobody"
        # A stale gradient is dropped by every ps it reaches: the largest counter counts each once.
        dropped, step = max(d for _, _, d, _ in latest), max(s for _, s, _, _ in latest)
        workers = range(max([self.num_workers, *[w + 1 for s in waiting.values() for w in s]]))
        heat = dict(type="heatmap", x=np.array(slots, dtype=float) * PS_SAMPLE_S, y=[f"worker {w}" for w in workers],
                    z=[[int(w in waiting[s]) for s in slots] for w in workers], zmin=0, zmax=1,
                    colorscale=[[0, "#eeeeee"], [0.5, "#eeeeee"], [0.5, "#ef553b"], [1, "#ef553b"]],
                    colorbar=dict(tickvals=[0.25, 0.75], ticktext=["not waited for", "waited for"],
                                  thickness=12, len=0.6, outlinewidth=0),
                    xgap=1, ygap=3, name="waiting for", hovertemplate="%{y} at %{x:.1f} s: %{z}<extra></extra>")
        return spec(f"sync: step {step} waits for {who} · {dropped} stale gradients dropped", [heat],
                    xaxis=dict(title_text="time (s)"), yaxis=dict(autorange="reversed"))


class PsLoad:
    """Bytes/s (left) and requests/s (pushes + pulls; right) of each ps task over time (seconds since
    ``start``, default: the first sample), from the differences of its cumulative counters between
    samples; NaN where a counter goes down (a restarted ps)."""

    TITLE = "ps load: bytes/s and requests/s per ps"

    def __init__(self, *, start: float | None = None):
        self.start = start
        self._ps: dict[int, tuple[Decimated, np.ndarray]] = {}  # points, last sample (time, bytes, requests)

    def feed(self, new: Tables) -> bool:
        """Take the new samples of the ps tasks; whether any came."""
        ps_metrics = new.get("ps_metrics", {})
        if self.start is None and size(ps_metrics):
            self.start = float(ps_metrics["time"].min())
        for ps, rows in groups(ps_metrics, "ps"):
            samples = np.column_stack([ps_metrics["time"][rows],
                                       ps_metrics["bytes_in"][rows] + ps_metrics["bytes_out"][rows],
                                       ps_metrics["pushes"][rows] + ps_metrics["pulls"][rows]]).astype(float)
            points, last = self._ps.get(ps) or (Decimated("t", "bytes", "requests"), samples[:0])
            samples = np.concatenate([last, samples])
            with np.errstate(divide="ignore", invalid="ignore"):
                rates = np.diff(samples[:, 1:], axis=0) / np.diff(samples[:, :1], axis=0)
            rates[rates < 0] = np.nan
            points.extend(t=samples[1:, 0], bytes=rates[:, 0], requests=rates[:, 1])
            self._ps[ps] = points, samples[-1:]
        return bool(size(ps_metrics))

    def spec(self) -> Spec:
        """The figure of the rows so far, as plain data."""
        traces = []
        for ps, (points, _) in sorted(self._ps.items()):
            if len(points):
                t = points["t"] - self.start
                for axes, y in ((("x", "y"), points["bytes"]), (("x2", "y2"), points["requests"])):
                    traces.append(dict(type="scatter", mode="lines", xaxis=axes[0], yaxis=axes[1], x=t, y=y,
                                       name=f"ps {ps}", legendgroup=f"ps {ps}", showlegend=axes[0] == "x",
                                       line_color=color(ps)))
        if not traces:
            return no_data(self.TITLE)
        return spec(self.TITLE, traces, **columns(
            left=dict(title_text="bytes/s", ticksuffix="B", rangemode="tozero", x=dict(title_text="time (s)")),
            right=dict(title_text="requests/s", rangemode="tozero", x=dict(title_text="time (s)"))))


class Traffic:
    """Share of the traffic each ps task carries: predicted from the placement next to measured.

    Predicted: the ps task's share of the dense variables' bytes (every step pulls and pushes all of a
    dense variable, so traffic follows bytes). Sparse variables move only the rows a batch touches, which
    placement cannot predict: they are left out of the prediction and named in the title. Measured: the
    ps task's share of all bytes in + out so far (the sum of the rises of its cumulative counters; a
    restarted ps counts from 0 again, and what it moved before its first sample after the restart is
    lost), sparse included. ``num_ps`` also shows ps tasks that hold nothing."""

    TITLE = "share of traffic per ps: predicted (from placement) vs measured (bytes in+out so far)"

    def __init__(self, *, num_ps: int | None = None):
        self.num_ps = num_ps or 0
        self._held, self._placed, self._sparse = np.zeros(0), 0, ""  # from the placement, once it is known
        self._moved: dict[int, float] = {}  # ps: bytes moved so far
        self._last: dict[int, float] = {}  # ps: its counters' last total

    def feed(self, new: Tables) -> bool:
        """Take the placement (once known) and the new samples of the ps tasks; whether any came."""
        if size(new.get("placement", {})):
            self._place(new["placement"])
        ps_metrics = new.get("ps_metrics", {})
        for ps, rows in groups(ps_metrics, "ps"):
            total = ps_metrics["bytes_in"][rows].astype(float) + ps_metrics["bytes_out"][rows]
            rises = np.diff(total, prepend=self._last.get(ps, 0.0))
            self._moved[ps] = self._moved.get(ps, 0.0) + float(np.clip(rises, 0, None).sum())
            self._last[ps] = float(total[-1])
        return bool(new.keys() & {"placement", "ps_metrics"})

    def _place(self, placement: Rows) -> None:
        sparse = np.asarray(placement["sparse"], dtype=bool) if "sparse" in placement else \
            np.zeros(size(placement), bool)
        self._held = np.bincount(np.asarray(placement["ps"][~sparse], dtype=int),
                                 weights=np.asarray(placement["bytes"][~sparse], dtype=float))
        names = list(dict.fromkeys(v.split("/part_")[0] for v in placement["variable"][sparse]))
        self._sparse = "" if not names else \
            f" · sparse, moved by touched rows only (not predicted): {', '.join(names[:3])}" + \
            (f" and {len(names) - 3} more" if len(names) > 3 else "")
        self._placed = int(np.max(placement["ps"])) + 1

    def spec(self) -> Spec:
        """The figure of the rows so far, as plain data."""
        if not self._placed and not self._moved:
            return no_data(self.TITLE)
        num_ps = max(self.num_ps, self._placed, max(self._moved, default=-1) + 1)
        x = [f"ps:{i}" for i in range(num_ps)]
        predicted = np.zeros(num_ps)
        predicted[:len(self._held)] = self._held
        measured = np.zeros(num_ps)
        for ps, moved in self._moved.items():
            measured[ps] = moved
        traces = []
        for name, values, bar_color, what in (
                ("predicted (dense variable bytes)", predicted, "#b6bcfb", "bytes held"),
                ("measured (bytes in + out so far)", measured, "#636efa", "bytes moved")):
            total = values.sum()
            share = values / total * 100 if total > 0 else np.full(num_ps, np.nan)
            traces.append(dict(type="bar", x=x, y=share, name=name, marker_color=bar_color,
                               hovertext=[f"{what}: {v:,.0f}" for v in values], hoverinfo="text+y+name"))
        return spec(self.TITLE + self._sparse, traces, barmode="group",
                    xaxis=dict(categoryorder="array", categoryarray=x),
                    yaxis=dict(title_text="share of bytes (%)", rangemode="tozero", ticksuffix="%"))
