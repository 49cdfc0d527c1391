"""Adding and removing workers while a run trains (``cluster.scale(workers=n)``, ``%pscluster scale``).

``cluster.scale`` returns at once a ``ScaleRequest``: the new engines start in the background while the run
trains, then join it; ``.wait()`` gives the cluster's new spec. Added workers join with the current
parameters; every ps counts them from their first request. Removed workers are the highest-numbered ones
(never the chief): every ps answers their next request with STOPPED, so they end with their summary, then
their engines go. A run that ended meanwhile is left as it ended (nothing is recorded for it): the cluster
alone changes size.

In sync mode the number of gradients aggregated per step keeps the same number of backup workers:
it grows and shrinks with the workers (at least 1). A new worker draws its batches as worker ``i`` of
``n``; the others keep the data order they started with.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

from ..errors import RuntimeTimeout
from ..runtime.client import PSClient
from ..runtime.waiting import wait_until
from ..spec import ClusterSpec
from .recovery import RecoveringRun, Tasks

RETIRE_S = 30.0  # how long a removed worker gets to end at its next step before it is killed
RESIZE_TIMEOUT_S = 5.0  # a ps that does not answer is about to be lost: the recovery waits while this does
JOIN_TRIES = 3  # a run's ps lost while workers join it: tried again once it is recovered
JOIN_PAUSE_S = 1.0


class ScaledRun(RecoveringRun, Protocol):
    """What scaling needs of a run's owner (``supervisor.Supervisor``) besides what recovery does: the cluster's
    tasks (to kill a removed worker that does not end), taking a spec with another number of workers, and setting
    aside the results of those it removed."""

    tasks: Tasks

    def take_workers(self, spec: ClusterSpec, replicas_to_aggregate: int) -> None: ...

    def retire_workers(self, count: int) -> None: ...


def _resize(run: ScaledRun, spec: ClusterSpec) -> None:
    """Tell every ps the run's new worker count first (a ps lost meanwhile fails this before anything changed),
    then have the run take ``spec``."""
    n = len(spec.workers)
    replicas = max(1, run.plan.replicas_to_aggregate + n - run.plan.num_workers)
    with PSClient(run.spec, run_id=run.id, timeout=RESIZE_TIMEOUT_S) as client:
        client.resize(n, replicas)
    run.take_workers(spec, replicas)


def grow(run: ScaledRun, spec: ClusterSpec) -> None:
    """``spec`` has more workers than ``run``, the new ones on new engines: start them, joining the run. The
    caller (``Supervisor.resize``) holds ``run.membership``."""
    old = len(run.spec.workers)
    _resize(run, spec)
    for i in range(old, len(spec.workers)):
        run.launch_worker(i, join=True)


def shrink(run: ScaledRun, spec: ClusterSpec) -> None:
    """End the workers of ``run`` past those of ``spec`` at their next request (killed through ``run.tasks``, on
    whichever host, if they do not end within ``RETIRE_S``); their engines may go then. The caller
    (``Supervisor.resize``) holds ``run.membership``."""
    workers = len(spec.workers)
    removed = list(run.spec.workers[workers:])
    _resize(run, spec)
    results = run.worker_results[workers:]
    if not wait_until(lambda: all(r.ready() for r in results), RETIRE_S):
        for task, result in zip(removed, results):
            if not result.ready() and not run.tasks.lost(task):
                run.tasks.kill_task(task)
    run.retire_workers(workers)


class ScaleRequest:
    """A ``cluster.scale(workers=n)`` under way (``work`` runs in a thread of its own). ``wait()`` returns the
    cluster's spec once it is done, or raises what failed; ``done()`` says whether it is."""

    def __init__(self, workers: int, work: Callable[[], ClusterSpec]):
        self.workers = workers
        self._finished = threading.Event()
        self._spec: ClusterSpec | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(work,), name=f"pscluster-scale-{workers}", daemon=True).start()

    def _run(self, work: Callable[[], ClusterSpec]) -> None:
        try:
            self._spec = work()
        except BaseException as e:  # raised again by wait()
            self._error = e
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> ClusterSpec:
        if not self._finished.wait(timeout):
            raise RuntimeTimeout(f"scaling to {self.workers} workers is not done after {timeout:.0f}s: "
                                 "wait() again (new engines start in the background)")
        if self._error is not None:
            raise self._error
        return self._spec

    def __repr__(self) -> str:
        state = "done" if self.done() else "starting engines"
        return f"<ScaleRequest to {self.workers} workers: {state}>"
