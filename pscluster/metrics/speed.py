"""The one definition of steps per second, used by every number pscluster shows.

A counter's rate is its increase over the time that increase took, between the first and the last of its
reported rows: a worker's ``local_step`` gives the worker's steps/s, the run's ``global_step`` the run's.
While the run trains, the rows are those of its last ``RECENT_S`` seconds (what it does now); once it
ended, all of them (its training time: from its first reported step to its last, startup excluded). The
roles table, the speed chart's title, the progress bar, the side panel, ``Run.summary()`` and
``pscluster.compare`` all give this number, through ``rate`` on all the rows or ``RunRates`` fed a few
rows at a time (the same number: it keeps what ``rate`` reads).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

RECENT_S = 5.0  # a live run's rates: over this many seconds, up to its latest row


def rate(times, counts, *, live: bool, latest: float | None = None, recent_s: float = RECENT_S) -> float:
    """Steps per second of one counter from its rows (``times`` in seconds, ``counts`` its values, in any
    order): ``live``, over the rows of the last ``recent_s`` seconds up to ``latest`` (default: the newest
    row); else over all of them. NaN with fewer than two rows there or no time between them: a counter that
    stalled or was lost shows no rate rather than an old one."""
    t, c = np.asarray(times, dtype=float), np.asarray(counts, dtype=float)
    if live and len(t):
        keep = t >= (t.max() if latest is None else latest) - recent_s
        t, c = t[keep], c[keep]
    if len(t) < 2:
        return math.nan
    span = t.max() - t.min()
    return float((c.max() - c.min()) / span) if span > 0 else math.nan


def over_time(times, counts, recent_s: float = RECENT_S, *, since=None) -> np.ndarray:
    """One counter's steps/s at each of its rows (``times`` ascending), by the rule of ``rate`` on the rows of
    the ``recent_s`` seconds up to that row (fewer at its start): the rise of the count from the first of them
    per second. NaN where no earlier row is in the window. ``since`` (per row, optional): a row's window starts
    no later than that time (a bucket's first row, for a bucket wider than ``recent_s``). The speed charts:
    the notebook's dashboard and the side panel's run view."""
    t, c = np.asarray(times, dtype=float), np.asarray(counts, dtype=float)
    start = t - recent_s if since is None else np.minimum(t - recent_s, np.asarray(since, dtype=float))
    back = np.searchsorted(t, start)
    with np.errstate(divide="ignore", invalid="ignore"):
        rates = (c - c[back]) / (t - t[back])
    return np.where(np.isfinite(rates), rates, np.nan)


class _Counter:
    """What ``rate`` needs of one counter's rows: the extremes of all of them (first and last time, lowest and
    highest count, as two rows), and the rows of the last ``recent_s`` seconds up to the run's latest row."""

    def __init__(self):
        self.extremes = np.empty((0, 2))  # (time, count) rows
        self.recent = np.empty((0, 2))

    def add(self, t: np.ndarray, c: np.ndarray, since: float) -> None:
        rows = np.concatenate([self.extremes, np.column_stack([t, c])])
        self.extremes = np.array([rows.min(axis=0), rows.max(axis=0)])
        self.recent = np.concatenate([self.recent, np.column_stack([t, c])])
        self.recent = self.recent[self.recent[:, 0] >= since]

    def rate(self, *, live: bool, latest: float, recent_s: float) -> float:
        rows = self.recent if live else self.extremes
        return rate(rows[:, 0], rows[:, 1], live=live, latest=latest, recent_s=recent_s)


class RunRates:
    """The run's global steps/s and each worker's local steps/s by ``rate``, from metric rows (columns
    ``worker``, ``time``, ``local_step``, ``global_step``: a run-store frame, its new rows as numpy columns,
    or the collector's step events as columns) given a few at a time; ``latest`` is the run's newest row
    of any worker, so a worker that stalled has no live rate. Also the run's first and last reported times
    (``span``)."""

    def __init__(self, recent_s: float = RECENT_S):
        self.recent_s = recent_s
        self.latest = -math.inf
        self._run = _Counter()
        self._workers: dict[int, _Counter] = {}

    def add(self, metrics: Mapping) -> None:
        """Take new metric rows (a worker's in the order it reported them)."""
        t = np.asarray(metrics["time"], dtype=float)
        if not len(t):
            return
        self.latest = max(self.latest, float(t.max()))
        since = self.latest - self.recent_s
        self._run.add(t, np.asarray(metrics["global_step"], dtype=float), since)
        workers, local = np.asarray(metrics["worker"]), np.asarray(metrics["local_step"], dtype=float)
        for w in np.unique(workers):
            rows = workers == w
            self._workers.setdefault(int(w), _Counter()).add(t[rows], local[rows], since)
        for counter in self._workers.values():  # one that reported nothing new ages too
            counter.recent = counter.recent[counter.recent[:, 0] >= since]

    def run(self, *, live: bool) -> float:
        """The run's global steps/s."""
        return self._run.rate(live=live, latest=self.latest, recent_s=self.recent_s)

    def workers(self, *, live: bool) -> dict[int, float]:
        """Each worker's local steps/s, by worker index."""
        return {w: c.rate(live=live, latest=self.latest, recent_s=self.recent_s)
                for w, c in sorted(self._workers.items())}

    def span(self) -> tuple[float, float] | None:
        """The time of the run's first reported step and of its last; None before any."""
        times = self._run.extremes[:, 0]
        return (float(times[0]), float(times[1])) if len(times) else None


def of(metrics: Mapping, recent_s: float = RECENT_S) -> RunRates:
    """``RunRates`` of all of ``metrics`` at once."""
    rates = RunRates(recent_s)
    rates.add(metrics)
    return rates


def of_buckets(*frames) -> RunRates:
    """``RunRates`` of ``RunStore.series`` frames (None or empty: skipped; of either axis, raw rows or rollup
    buckets, overlapping or not): exact, as a bucket keeps the first and last time, global and local step of
    its rows."""
    rates = RunRates()
    for f in frames:
        for end in ("first", "last") if f is not None and len(f) else ():
            rates.add({"worker": f["worker"].to_numpy(), "time": f[f"time_{end}"], "local_step": f[f"local_{end}"],
                       "global_step": f[f"step_{end}"]})
    return rates


def phases(started: float, ended: float | None, span: tuple[float, float] | None,
           now: float | None = None) -> dict:
    """A run's times in seconds: ``wall_s`` (from its start to its end, as ``RunStore.runs()`` gives it; while
    it trains, to ``now``, or None without it), ``startup_s`` (from its start to its first reported step)
    and ``training_s`` (from its first reported step to its last); those two None before a step was
    reported. ``span``: ``RunRates.span()``."""
    wall = ended - started if ended is not None else None if now is None else now - started
    first, last = span or (None, None)
    return {"wall_s": wall, "startup_s": None if span is None else first - started,
            "training_s": None if span is None else last - first}
