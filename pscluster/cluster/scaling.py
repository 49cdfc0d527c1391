"""Adding and removing workers while a run trains (``cluster.scale(workers=n)``, ``%pscluster scale``).

Added workers start on new engines and join with the current parameters; every ps counts them from
their first request. Removed workers are the highest-numbered ones (never the chief): every ps answers
their next request with STOPPED, so they end with their summary, then their engines go.

In sync mode the number of gradients aggregated per step keeps the same number of backup workers:
it grows and shrinks with the workers (at least 1). A new worker draws its batches as worker ``i`` of
``n``; the others keep the data order they started with.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..runtime.client import PSClient
from ..runtime.ps import wait_until
from ..spec import ClusterSpec, TaskSpec

if TYPE_CHECKING:
    from .recovery import Tasks
    from .run import Run

RETIRE_S = 30.0  # how long a removed worker gets to end at its next step before it is killed


def _resize(run: "Run", spec: ClusterSpec) -> None:
    n = len(spec.workers)
    replicas = max(1, run.plan.replicas_to_aggregate + n - run.plan.num_workers)
    run.plan = replace(run.plan, num_workers=n, replicas_to_aggregate=replicas)
    with PSClient(run.spec, run_id=run.id, timeout=10.0) as client:
        client.resize(n, replicas)
    run.spec = spec
    run.store.set_spec(run.id, spec.public_dict())
    run.note("scaled", "controller", {"workers": n, "replicas_to_aggregate": replicas})


def grow(run: "Run", tasks: "Tasks", spec: ClusterSpec) -> None:
    """``spec`` has more workers than ``run``, the new ones on new engines: start them, joining the run."""
    with run.membership:
        old = len(run.spec.workers)
        _resize(run, spec)
        for i in range(old, len(spec.workers)):
            run.worker_results.append(tasks.launch_worker(spec, i, run, join=True))


def shrink(run: "Run", tasks: "Tasks", workers: int) -> list[TaskSpec]:
    """End workers ``workers``.. of ``run`` at their next request (killed through ``tasks``, on whichever host,
    if they do not end within ``RETIRE_S``); returns their tasks, whose engines the caller may now stop."""
    with run.membership:
        removed = list(run.spec.workers[workers:])
        _resize(run, replace(run.spec, workers=run.spec.workers[:workers]))
        results = run.worker_results[workers:]
        if not wait_until(lambda: all(r.ready() for r in results), RETIRE_S):
            for task, result in zip(removed, results):
                if not result.ready() and not tasks.lost(task):
                    tasks.kill_task(task)
        run.retired_results += results
        del run.worker_results[workers:]
        return removed
