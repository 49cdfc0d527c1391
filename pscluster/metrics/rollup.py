"""Rollups of per-step metrics: per worker and bucket, the count, sum, min, max and last value of every metric.

Two axes, each a ladder of ``LEVELS`` resolutions: level k's buckets are ``Ladder.width * BASE**k`` wide (global
steps: 64, 256, ... 64 * 4**9 = 16.8M; seconds: 0.25, 1, 4, ... 0.25 * 4**9 = 18 hours). Bucket ``b`` of a level
holds a worker's rows with x in [b * width, (b + 1) * width). Below the top, a level keeps only the buckets of the
newest ``KEEP`` bucket widths of each worker; the top level keeps every bucket. A worker's run therefore costs, per
axis, at most ``KEEP`` bucket rows per level below the top, and ``length / top width`` at the top: about
``KEEP * log4(length / (width * KEEP)) + 4/3 KEEP`` rows in all, so ten times more steps add at most ``2 * KEEP``,
until the top level grows (by one bucket per 16.8M global steps, or per 18 hours).

This module is the math alone, on numpy arrays (``Buckets``), and the frame of a series; ``store`` keeps the buckets
in SQLite and reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd

BASE = 4  # a level's buckets are BASE times wider than the level below
LEVELS = 10
KEEP = 2048  # bucket widths a level below the top keeps per worker: the finest level that covers a whole run has
#              KEEP / BASE to KEEP buckets of it
SPAN = ("time", "step", "local", "row")  # what a bucket records the first and last of (row: the raw row's rowid)
STATS = ("n", "sum", "min", "max", "last")  # per metric: values seen (not NaN), their sum, min, max, the last one
FRAME_SPAN = ("worker", "x", "x_end", "time_first", "time_last", "step_first", "step_last", "local_first",
              "local_last", "count")  # the columns of a series frame before its metrics'


@dataclass(frozen=True)
class Ladder:
    """The resolutions of one axis: ``x`` the raw column bucketed (global_step or time), ``code`` its number in the
    store, ``width`` the finest bucket width; ``unit``: the finest width of buckets made from raw rows at query time."""

    x: str
    code: int
    width: float
    unit: float

    @property
    def column(self) -> int:
        """Where x is in a bucket's ``lo``/``hi``."""
        return SPAN.index("time" if self.x == "time" else "step")

    def width_of(self, level: int) -> float:
        return self.width * BASE ** level

    def keys(self, x: np.ndarray) -> np.ndarray:
        """The bucket numbers of values ``x`` at level 0."""
        return np.floor(x / self.width).astype(np.int64)


LADDERS = {"step": Ladder("global_step", 0, 64, 1), "time": Ladder("time", 1, 0.25, 0.25 / 64)}
TOP = LEVELS - 1


@dataclass
class Buckets:
    """Consecutive buckets, sorted by worker then bucket: g buckets of m metrics.

    ``lo``/``hi``: (g, 4) the least and greatest time, global step, local step and rowid of each bucket's rows (see
    ``SPAN``); ``n`` (g, m) how many values each metric has, ``sum`` their sum (0 without values), ``min``, ``max``,
    ``last`` (NaN without values)."""

    worker: np.ndarray
    bucket: np.ndarray
    count: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    n: np.ndarray
    sum: np.ndarray
    min: np.ndarray
    max: np.ndarray
    last: np.ndarray

    def __len__(self) -> int:
        return len(self.bucket)

    def renumbered(self, keys: np.ndarray) -> Buckets:
        return Buckets(self.worker, keys, self.count, self.lo, self.hi, self.n, self.sum, self.min, self.max, self.last)

    def take(self, index) -> Buckets:
        return Buckets(*(getattr(self, f.name)[index] for f in fields(self)))


def empty(metrics: int) -> Buckets:
    """No buckets, of ``metrics`` metrics."""
    return from_rows(np.zeros(0, np.int64), np.zeros((0, len(SPAN))), np.zeros((0, metrics)))


def concat(parts: Sequence[Buckets]) -> Buckets:
    """The buckets of ``parts``, one after the other."""
    return Buckets(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Buckets)))


def from_rows(worker: np.ndarray, span: np.ndarray, values: np.ndarray) -> Buckets:
    """Each raw row as a bucket of one row: ``span`` (n, 4) its time, global step, local step and rowid; ``values``
    (n, m) its metrics, NaN where it has none. The ``bucket`` numbers are 0 until ``combine`` gives them."""
    has = ~np.isnan(values)
    return Buckets(worker.astype(np.int64), np.zeros(len(worker), np.int64), np.ones(len(worker), np.int64),
                   span, span, has.astype(np.int64), np.where(has, values, 0.0), values, values, values)


def combine(b: Buckets, keys: np.ndarray) -> Buckets:
    """Merge the consecutive buckets of a worker that have the same key into one bucket numbered by it (``keys`` must
    not decrease within a worker): counts add, min of mins, max of maxes, the last of the last bucket with a value."""
    new = np.ones(len(keys), bool)
    new[1:] = (b.worker[1:] != b.worker[:-1]) | (keys[1:] != keys[:-1])
    if new.all():
        return b.renumbered(keys)
    starts = np.flatnonzero(new)
    position = np.where(b.n > 0, np.arange(len(keys))[:, None], -1)
    last_at = np.maximum.reduceat(position, starts, axis=0)
    last = np.take_along_axis(b.last, np.maximum(last_at, 0), axis=0)
    last[last_at < 0] = np.nan
    return Buckets(b.worker[starts], keys[starts], np.add.reduceat(b.count, starts),
                   np.fmin.reduceat(b.lo, starts, axis=0), np.fmax.reduceat(b.hi, starts, axis=0),
                   np.add.reduceat(b.n, starts, axis=0), np.add.reduceat(b.sum, starts, axis=0),
                   np.fmin.reduceat(b.min, starts, axis=0), np.fmax.reduceat(b.max, starts, axis=0), last)


def levels(rows: Buckets, ladder: Ladder):
    """The buckets of raw ``rows`` (``from_rows``) at every level of ``ladder``, finest first: (level, Buckets)."""
    x = rows.lo[:, ladder.column]
    in_order = (np.diff(rows.worker) > 0) | ((np.diff(rows.worker) == 0) & (np.diff(x) >= 0))
    if not (in_order.all() and not np.isnan(x).any()):  # sorting is skipped for a batch of one worker in order
        keep = np.flatnonzero(~np.isnan(x))
        order = keep[np.lexsort((x[keep], rows.worker[keep]))]
        rows, x = rows.take(order), x[order]
    workers = 1 + np.count_nonzero(rows.worker[1:] != rows.worker[:-1]) if len(rows) else 0
    buckets = combine(rows, ladder.keys(x))
    for level in range(LEVELS):
        if level:  # one bucket per worker stays one bucket per worker at the levels above
            keys = buckets.bucket // BASE
            buckets = buckets.renumbered(keys) if len(buckets) == workers else combine(buckets, keys)
        yield level, buckets


def decimate(b: Buckets, width: float, max_points: int) -> tuple[Buckets, int]:
    """Merge adjacent buckets of width ``width`` (sorted, numbered by ``floor(x / width)``) into groups of a whole
    number of buckets, the same for every worker, so that no worker has more than ``max_points``; returns the groups
    (numbered by ``floor(x / (width * factor))``) and the factor."""
    if not len(b):
        return b, 1
    factor = 1
    if _most_per_worker(b.worker, b.bucket) > max_points:
        factor = max(2, -(-(int(b.bucket.max() - b.bucket.min()) + 1) // max_points))
        while _most_per_worker(b.worker, b.bucket // factor) > max_points:
            factor += 1
    return (combine(b, b.bucket // factor) if factor > 1 else b), factor


def _most_per_worker(worker: np.ndarray, keys: np.ndarray) -> int:
    distinct = np.ones(len(keys), bool)
    distinct[1:] = (worker[1:] != worker[:-1]) | (keys[1:] != keys[:-1])
    return int(np.bincount(np.unique(worker, return_inverse=True)[1], weights=distinct).max())


def select(raw: Buckets, ladder: Ladder, start, stop, workers) -> Buckets:
    """Raw rows (``from_rows``) of ``workers`` (None: all) with x in [start, stop), sorted by worker then x."""
    x = raw.lo[:, ladder.column]
    keep = np.ones(len(raw), bool) if workers is None else np.isin(raw.worker, list(workers))
    keep &= (x >= (-np.inf if start is None else start)) & (x < (np.inf if stop is None else stop))
    index = np.flatnonzero(keep)
    return raw.take(index[np.lexsort((x[index], raw.worker[index]))])


def from_raw(raw: Buckets, ladder: Ladder, start, stop, max_points: int, workers) -> tuple[Buckets, float, tuple]:
    """A series of raw rows (``from_rows``) of ``workers`` in [start, stop) along ``ladder``: them when no worker has
    more than ``max_points``, else buckets of them as ``decimate`` merges them, a whole number of ``ladder.unit`` wide.
    Returns what ``frame`` takes first: the rows or buckets, their width (0: raw rows), and the range."""
    raw = select(raw, ladder, start, stop, workers)
    if not len(raw) or np.unique(raw.worker, return_counts=True)[1].max() <= max_points:
        return raw, 0, (start, stop)
    units = np.floor(raw.lo[:, ladder.column] / ladder.unit).astype(np.int64)
    b, factor = decimate(combine(raw, units), ladder.unit, max_points)
    return b, ladder.unit * factor, (start, stop)


def frame(b: Buckets, resolution: float, clip: tuple, names: list[str], ladder: Ladder) -> pd.DataFrame:
    """The frame ``RunStore.series`` returns of buckets ``b`` of width ``resolution`` (0: raw rows), their bounds
    clipped to ``clip`` (start, stop; None: open): a bucket at either end of a range holds only the rows read."""
    step = ladder.x == "global_step"
    x = b.bucket * resolution if resolution else b.lo[:, ladder.column]
    x, x_end = np.clip(x, clip[0], None), np.clip(x + resolution, None, clip[1])
    data = {"worker": b.worker, "x": x.astype(np.int64) if step else x,
            "x_end": x_end.astype(np.int64) if step else x_end}
    for i, c in enumerate(("time", "step", "local")):
        first, last = b.lo[:, i], b.hi[:, i]
        data[f"{c}_first"], data[f"{c}_last"] = (first, last) if c == "time" else (first.astype(np.int64),
                                                                                   last.astype(np.int64))
    data["count"] = b.count
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = b.sum / b.n
    for j, name in enumerate(names):
        data.update({f"{name}_mean": mean[:, j], f"{name}_min": b.min[:, j], f"{name}_max": b.max[:, j],
                     f"{name}_last": b.last[:, j]})
    df = pd.DataFrame(data)
    df.attrs["resolution"] = resolution
    return df
