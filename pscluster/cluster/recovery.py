"""Recovery of tasks lost during a run, without the user doing anything.

Detection: a task whose engine is gone (checked every ``HEALTH_S`` seconds by the run's monitor): a local
engine whose process ended, or any engine that missed the controller's heartbeats for
``launchers.HEARTBEAT_DEADLINE_S`` (a hung process, a dead host, a cut link); the workers notice a lost ps by
its dropped connection. A lost task is killed first, wherever it runs, so a hung one cannot wake into the run;
where that fails (its host unreachable) it is fenced off: a lost worker's sessions are refused by every ps
(``protocol.Sessions.fence``), a lost ps belongs to a finished attempt that nobody talks to. Then:

- a lost worker: every ps stops waiting for it (sync aggregates the gradients of the live workers, SSP
  measures the slowest live one), a new engine takes its place and joins with the current parameters;
- a lost ps: the other ps tasks stop the run (each writes its shard), the workers end (each leaves its copy
  of the parameters), a new engine takes the lost ps's place, and the run starts again as a new attempt whose
  chief restores the newest state there is onto every ps: the checkpoint assembled from those shards and
  copies (``runtime.rescue``: every ps of one step a few steps back, a ps from a copy with its optimizer state of
  its own state copy, a few steps older), or the latest committed checkpoint when that is as new.
"""

from __future__ import annotations

from typing import Protocol

from ..runtime import checkpoint
from ..runtime.client import PSClient
from ..runtime.plan import TrainPlan
from ..runtime.waiting import wait_until
from ..spec import ClusterSpec, TaskSpec
from .checkpoint_commits import CheckpointCoordinator

HEALTH_S = 0.1
WORKERS_END_S = 10.0  # how long the workers of a failed attempt get to end before they are killed


class RecoveringRun(Protocol):
    """What recovery needs of a run's owner (``supervisor.Supervisor``): its tasks, plan, workers' results (one
    per worker by index) and checkpoints, to read; recording events; and the changes it decides, which the owner
    makes: a task on a new engine, a worker started again, a new attempt and its workers."""

    spec: ClusterSpec
    plan: TrainPlan
    worker_results: list
    checkpoints: CheckpointCoordinator

    @property
    def id(self) -> int: ...

    def note(self, kind: str, task: str, detail: dict | None = None) -> None: ...

    def commit_checkpoints(self) -> list: ...

    def replace_task(self, task: TaskSpec) -> None: ...

    def launch_worker(self, index: int, *, join: bool) -> None: ...

    def left(self, index: int) -> str | None:
        """Why worker ``index`` failed out of the current attempt (its "left" event), or None."""

    def restart(self) -> None: ...


class Tasks(Protocol):
    """What recovery needs of the cluster: new engines for lost tasks, and workers started on them."""

    def replace_task(self, role: str, index: int) -> ClusterSpec: ...

    def launch_worker(self, spec: ClusterSpec, index: int, run: RecoveringRun, *, join: bool = False): ...

    def record(self) -> None: ...

    def lost(self, task: TaskSpec) -> bool:
        """Whether the engine of ``task`` is gone."""

    def kill_task(self, task: TaskSpec) -> None:
        """SIGKILL the process of ``task`` (wherever it runs)."""

    @property
    def loss_grace_s(self) -> float:
        """How long after a failed task its engine may still look alive (the time to miss heartbeats)."""


def lost_tasks(spec: ClusterSpec, tasks: Tasks) -> list[TaskSpec]:
    """The tasks whose engine is gone."""
    return [t for t in (*spec.ps, *spec.workers) if tasks.lost(t)]


def recover(run: RecoveringRun, tasks: Tasks) -> bool:
    """Replace what ``run`` lost since the last check; False when nothing was lost."""
    lost = lost_tasks(run.spec, tasks)
    if not lost:
        return False
    for t in lost:
        run.note("lost", f"{t.role}:{t.index}", {"pid": t.pid, "engine": t.engine_id, "host": t.host})
        try:
            tasks.kill_task(t)
        except Exception:  # dead already, or its host unreachable: fenced off below
            pass
    lost_ps = [t for t in lost if t.role == "ps"]
    lost_workers = [t for t in lost if t.role == "worker"]
    if lost_ps:
        _restart_from_checkpoint(run, tasks, lost_ps, lost_workers)
    else:
        _replace_workers(run, tasks, lost_workers)
    return True


def _replace_workers(run: RecoveringRun, tasks: Tasks, lost: list[TaskSpec]) -> None:
    try:
        with PSClient(run.spec, run_id=run.id, timeout=10.0) as client:
            client.lost_workers([t.index for t in lost])
    except Exception as e:  # the ps tasks answer again at the next check, or are lost themselves
        run.note("recovery_failed", "controller", {"error": f"{type(e).__name__}: {e}"})
    for t in lost:
        result = run.worker_results[t.index]
        if result.ready() and result.successful():
            continue  # it had finished its part
        run.replace_task(t)
        run.launch_worker(t.index, join=True)


def _restart_from_checkpoint(run: RecoveringRun, tasks: Tasks, lost_ps: list[TaskSpec],
                             lost_workers: list[TaskSpec]) -> None:
    survivors = [t.index for t in run.spec.ps if t not in lost_ps]
    # the workers still end if this fails, on their lost ps connection
    _tell_survivors(run, survivors, lambda client: client.stop(attempt=run.plan.attempt))
    gone = {t.index for t in lost_workers}
    live = [(i, r) for i, r in enumerate(run.worker_results) if i not in gone]
    # out of the attempt: its result came, or (often sooner) its "left" event; its engine runs the next call after
    if not wait_until(lambda: all(r.ready() or run.left(i) is not None for i, r in live), WORKERS_END_S):
        for i, r in live:  # a worker that does not end is killed and replaced too
            if not (r.ready() or run.left(i) is not None):
                task = run.spec.task("worker", i)
                try:
                    tasks.kill_task(task)
                except Exception:  # gone already, or its host unreachable
                    pass
                lost_workers.append(task)
    # a worker of the failed attempt that comes back (hung, unreachable) is refused; if this fails, its sessions
    # end with the attempt's run state anyway
    _tell_survivors(run, survivors, lambda client: client.lost_workers(list(range(len(run.spec.workers)))))
    run.commit_checkpoints()  # shards of the failed attempt that all ps had written
    assembled = run.checkpoints.rescue(run.plan, len(run.spec.ps))
    for t in [*lost_ps, *lost_workers]:
        run.replace_task(t)
    detail = {"attempt": run.plan.attempt + 1}
    if assembled is not None:  # newer than any committed checkpoint, each of its sources read back just now
        detail.update(from_step=assembled.step, sources=[s.to_dict() for s in assembled.sources])
    else:
        detail.update(from_step=_restorable_step(run))
    run.note("restarting", "controller", detail)
    run.restart()


def _tell_survivors(run: RecoveringRun, survivors: list[int], request) -> None:
    """``request(client)`` to the surviving ps tasks, on a best-effort basis (one may be lost too)."""
    if not survivors:
        return
    try:
        with PSClient(run.spec, run_id=run.id, timeout=10.0, only=survivors) as client:
            request(client)
    except Exception:
        pass


def _restorable_step(run: RecoveringRun) -> int | None:
    """The step of the newest checkpoint that passes its checks, where the chief will restore from (None: from
    the initial values); each refused one is recorded and set aside, as the chief would."""
    if not run.plan.checkpoint_dir:
        return None
    found = checkpoint.latest(run.plan.checkpoint_dir,
                              on_refused=lambda error: run.note("checkpoint_refused", "controller", {"error": error}))
    return None if found is None else found.step
