"""The tasks of a script's cluster, as its chief's supervisor follows them and recovery treats them
(``recovery.Tasks``). The chief's own worker is a thread of the chief's process; every other task is a process
that the user or a scheduler starts, which nothing here can start, kill or replace.

- A worker's handle: the chief's thread (``ChiefWorker``), or another worker's events (``PeerWorker``): "done"
  (its summary), "left" (it failed out of the attempt).
- A lost ps: once a worker has failed (the workers notice a dead or hung ps within the data plane's heartbeat
  timeout), a ps that does not answer, or answers without holding the run's current attempt (a fresh
  process). Recovery (``recovery.recover``) then waits up to ``REPLACE_S`` for it to answer again at its
  address, started again with the same config, and starts the run's next attempt from the newest state there
  is (the chief's thread restores it); the other workers rejoin that attempt by themselves
  (``runtime.standalone.join_run``). A ps not started again in time fails the run; the job started again
  resumes from its latest checkpoint.
- Nothing is killed: a task of a failed attempt that wakes is refused by its attempt number.
- The run's lease is held on its ps tasks too, while it trains: a ps whose chief is gone ends by itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import TrainingError
from ..runtime import standalone
from ..runtime.plan import TrainPlan
from ..spec import ClusterSpec, TaskSpec
from .lease import hold_ps_tasks
from .supervisor import Supervisor

PEER_END_S = 10.0  # how long after the chief's end another worker's summary may still arrive
REPLACE_S = 120.0  # how long a lost ps may take to be started again
PROBE_S = 2.0  # how long a ps may take to answer whether it holds the run


class ChiefWorker:
    """The chief's own worker, in a thread of this process, as the supervisor follows a worker (ipyparallel's
    ``ready``, ``successful``, ``get``)."""

    def __init__(self, train: Callable[[], dict]):
        self._result: Future = Future()
        self.ended_at: float | None = None
        threading.Thread(target=self._run, args=(train,), name="pscluster-chief", daemon=True).start()

    def _run(self, train) -> None:
        try:
            self._result.set_result(train())
        except BaseException as e:  # noqa: BLE001 - the supervisor reports it as the run's error
            self._result.set_exception(e)
        self.ended_at = time.monotonic()

    def ready(self) -> bool:
        return self._result.done()

    def successful(self) -> bool:
        return self._result.done() and self._result.exception() is None

    def get(self, timeout: float | None = None):
        return self._result.result(timeout)


class PeerWorker:
    """Worker ``index``, a process (or thread) of its own, followed by its events in the current attempt: ended with
    its summary ("done"), failed ("left"), or failed for having sent neither ``PEER_END_S`` after the ``chief``'s end
    (None: no such deadline)."""

    def __init__(self, index: int, chief: ChiefWorker | None, supervisor: Supervisor):
        self.index, self._chief, self._supervisor = index, chief, supervisor

    def ready(self) -> bool:
        ended = self._chief.ended_at if self._chief is not None else None
        return (self._supervisor.reported(self.index) or self._supervisor.left(self.index) is not None
                or (ended is not None and time.monotonic() - ended > PEER_END_S))

    def successful(self) -> bool:
        return self._supervisor.reported(self.index) and self._supervisor.left(self.index) is None

    def get(self, timeout: float | None = None):
        if self.successful():
            return self._supervisor.reported_summary(self.index)
        error = self._supervisor.left(self.index)
        raise TrainingError(f"worker {self.index} failed: {error}" if error else
                            f"worker {self.index} sent no summary within {PEER_END_S:.0f}s of the chief's end: "
                            "see its own output")


class ScriptTasks:
    """``recovery.Tasks`` for a script's cluster (see the module docstring). ``train_chief(plan, join)``
    trains the chief's worker for ``plan``, in the thread it is called in."""

    # none: ``lost`` asks the ps tasks themselves, which a worker that failed on a lost one saw go already (no
    # engine heartbeats to miss first, as a notebook's cluster has); a failed worker's run ends without a wait
    loss_grace_s = 0.0

    def __init__(self, train_chief: Callable[[TrainPlan, bool], dict]):
        self._train_chief = train_chief
        self._chief: ChiefWorker | None = None
        self._run: Supervisor | None = None

    def launch_worker(self, spec: ClusterSpec, index: int, run: Supervisor, *, join: bool = False):
        """Worker ``index``'s handle in ``run``'s current attempt: the chief's thread starts (call index 0
        first); another worker's process joins the attempt by itself. The first call holds the run's lease on its
        ps tasks until it ends (``lease.hold_ps_tasks``)."""
        if self._run is None:
            hold_ps_tasks(run.spec, run.id, run.lease.owner, run.ended)
        self._run = run
        if index == 0:
            plan = run.plan
            self._chief = ChiefWorker(lambda: self._train_chief(plan, join))
            return self._chief
        return PeerWorker(index, self._chief, run)

    def lost(self, task: TaskSpec) -> bool:
        if task.role != "ps" or self._run is None:
            return False  # another worker's process is its scheduler's to watch
        if not any(r.ready() and not r.successful() for r in self._run.worker_results):
            return False  # no worker saw a ps go: nothing to ask the ps tasks
        held = self._stats(task)
        return held is None or (held.get("run_id"), held.get("attempt")) != (self._run.id, self._run.plan.attempt)

    def replace_task(self, role: str, index: int) -> ClusterSpec:
        """Wait for lost ps ``index`` to answer again at its address; a worker needs nothing (it rejoins)."""
        spec = self._run.spec
        if role != "ps":
            return spec
        task = spec.task("ps", index)
        self._run.note("waiting", f"ps:{index}", {"for": f"ps {index} started again at {task.host}:{task.port}"})
        deadline = time.monotonic() + REPLACE_S
        while self._stats(task) is None:
            if time.monotonic() > deadline:
                raise TrainingError(f"ps {index} at {task.host}:{task.port} was lost and not started again within "
                                    f"{REPLACE_S:.0f}s: start it (the same script and config), or the whole job, "
                                    "which resumes from its latest checkpoint")
            time.sleep(0.2)
        return spec

    def kill_task(self, task: TaskSpec) -> None:
        """Nothing: a script's tasks are its scheduler's; a lost one that wakes is refused by its attempt."""

    def record(self) -> None:
        """Nothing: a script's cluster has no registry entry."""

    def _stats(self, task: TaskSpec) -> dict | None:
        """What ps ``task`` says of the run it holds, or None when it does not answer."""
        held = standalone.held_runs(self._run.spec, only=[task.index], timeout=PROBE_S)
        return held and held[0]
