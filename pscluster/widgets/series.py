"""Growing series for live figures: a point buffer that thins its old points, a moving average that goes
on from where it stopped. Both give the same numbers whether the values come all at once (a finished
run, a report) or a few at a time (a refresh of the live dashboard)."""

from __future__ import annotations

import math

import numpy as np

from .figure_specs import MAX_POINTS


class Decimated:
    """The points of a growing series (float columns by name), at most about ``cap`` of them: every
    ``stride``-th point, and always the newest. The stride doubles whenever more than ``cap`` points would
    be kept, so the series keeps its shape at a bounded size and the same points are kept however the
    points arrive."""

    def __init__(self, *names: str, cap: int = MAX_POINTS):
        self.cap, self.stride, self.count = cap, 1, 0
        self._kept = {name: np.empty(0) for name in names}
        self._newest: dict[str, float] = {}  # the newest point, when it is not one of the kept ones

    def extend(self, **columns) -> None:
        """Append points: one array per column, all of the same length."""
        n = len(next(iter(columns.values())))
        if not n:
            return
        on_stride = slice((-self.count) % self.stride, None, self.stride)
        for name, values in columns.items():
            self._kept[name] = np.concatenate([self._kept[name], np.asarray(values, dtype=float)[on_stride]])
        self.count += n
        while self._kept_count() > self.cap:
            self.stride *= 2
            self._kept = {k: v[::2] for k, v in self._kept.items()}
        last = (self.count - 1) % self.stride != 0
        self._newest = {k: float(np.asarray(v)[-1]) for k, v in columns.items()} if last else {}

    def add(self, name: str) -> None:
        """A new column, NaN at the points so far: a value first reported after them."""
        self._kept[name] = np.full(self._kept_count(), np.nan)
        if self._newest:
            self._newest[name] = math.nan

    def _kept_count(self) -> int:
        return len(next(iter(self._kept.values())))

    def __getitem__(self, name: str) -> np.ndarray:
        kept = self._kept[name]
        return np.append(kept, self._newest[name]) if self._newest else kept.copy()

    def __len__(self) -> int:
        return self._kept_count() + bool(self._newest)


class Ewm:
    """Exponential moving average over ``span`` points, NaNs skipped: pandas'
    ``Series.ewm(span=span, min_periods=1).mean()`` of all the values given so far, chunk by chunk."""

    def __init__(self, span: int):
        self.decay = 1 - 2 / (span + 1)
        self._sum = self._weight = 0.0  # decayed sum of the values and of their weights

    def update(self, values) -> np.ndarray:
        """The averages at each of ``values``, which follow the values given before."""
        out = np.empty(len(values))
        total, weight, decay = self._sum, self._weight, self.decay
        for i, x in enumerate(np.asarray(values, dtype=float).tolist()):
            total, weight = total * decay, weight * decay
            if not math.isnan(x):
                total, weight = total + x, weight + 1
            out[i] = total / weight if weight else math.nan
        self._sum, self._weight = total, weight
        return out
