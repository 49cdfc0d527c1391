"""What a run is, as plain data: its summary (``summary``), which its handle shows and its row keeps once it ended,
and the figures it is made of (``local_steps``, ``staleness``, ``StoreRates``), read from the run's supervisor and
the run store. The supervisor holds the one ``StoreRates`` of its run; nothing here writes."""

from __future__ import annotations

import math
import threading
import time

from ..metrics import speed
from ..metrics.store import RunStore
from ..runtime.policies import policy_for


class StoreRates:
    """A run's steps/s (global and each worker's, by ``speed.rate``) and the span of its reported steps, from the
    metric rows the run store holds so far: each call reads the rows added since the last."""

    def __init__(self, store: RunStore, run_id: int):
        self._store, self._run_id = store, run_id
        self._rates, self._row = speed.RunRates(), 0
        self._lock = threading.Lock()

    def now(self) -> speed.RunRates:
        with self._lock:
            new = self._store.metrics(self._run_id, after_row=self._row)
            if len(new):
                self._rates.add(new)
                self._row = int(new["row"].max())
            return self._rates


def local_steps(supervisor) -> list[int] | None:
    """Each worker's local steps once the run is over, over every attempt of the run (a lost ps restarts it)."""
    if supervisor.results is None:
        return None
    return [r["local_steps"] + supervisor.earlier_local_steps(r["task"]) for r in supervisor.results]


def staleness(supervisor) -> dict[int, int]:
    """Histogram of push staleness, counted by ps 0 (async runs)."""
    stats = supervisor.ps_stats or supervisor.read_ps_stats(5.0) or [{}]
    return {int(k): v for k, v in stats[0].get("staleness", {}).items()}


def wall_s(supervisor) -> float:
    return (supervisor.finished or time.time()) - supervisor.started


def summary(supervisor) -> dict:
    """The run as plain data (for reports): mode, sizes, steps, speed, times; the options only its mode reads.

    ``steps_per_s`` (global) and ``worker_steps_per_s`` (local, by worker index) by ``speed.rate``: over the last
    ``speed.RECENT_S`` seconds while the run trains, over all its rows once it ended; None where there is no rate.
    ``wall_s``, ``startup_s`` (to the first reported step) and ``training_s`` (from the first reported step to the
    last) by ``speed.phases``."""
    plan, spec, stats = supervisor.plan, supervisor.spec, supervisor.ps_stats or [{}]
    samples = sum(r["samples"] for r in supervisor.results or [])
    rates, live, policy = supervisor.rates.now(), supervisor.finished is None, policy_for(plan)
    wall, done = wall_s(supervisor), supervisor.ended.is_set()
    return {"name": supervisor.name, "run_id": plan.run_id, "mode": plan.mode, "ps": len(spec.ps),
            "workers": len(spec.workers),
            "replicas_to_aggregate": plan.replicas_to_aggregate if "replicas_to_aggregate" in policy.options else None,
            "steps": plan.steps, "global_step": stats[0].get("step"), "local_steps": local_steps(supervisor),
            "dropped_stale": stats[0].get("dropped_stale"), "late": stats[0].get("late"),
            "staleness": staleness(supervisor) if policy.counts_staleness else None,
            "samples_per_sec": samples / wall if done and wall > 0 else None,
            "steps_per_s": _number(rates.run(live=live)),
            "worker_steps_per_s": {w: _number(r) for w, r in rates.workers(live=live).items()},
            **speed.phases(supervisor.started, supervisor.finished, rates.span(), time.time()),
            "status": supervisor.status}


def _number(v: float) -> float | None:
    """``v``, or None for NaN (a summary is JSON)."""
    return None if math.isnan(v) else v
