"""The runtime side of tasks started without a notebook, from ``PSCLUSTER_CONFIG`` or ``TF_CONFIG`` (see
``task_config``; ``pscluster.train_from_environment`` puts these together with the chief's supervisor).

- ``serve_ps``: ``python -m pscluster.runtime``, a ps that serves run after run until SIGTERM/SIGINT.
- ``serve_run``: a ps that serves one run, and returns once its supervisor (the chief's) has closed it,
  ``PS_QUIET_S`` after its end without a request, or ``NO_RUN_S`` without a run and without a request (started
  again with nobody left); it ends the process (status 1, one line) once the run's owner lets its lease on the ps
  lapse (the chief is gone: ``ParameterServer.owner_lost``).
- The run's plan (``plan.training_plan``) every task derives alike from the same arguments (placement is a
  pure function of the model), so no coordinator hands it out; ``check_options`` checks its optimizer options
  as ``train()`` does (the chief, at once; another task only while it waits for a run: see ``started_run``).
- ``join_run``: a worker other than the chief: it learns the run's id, attempt, metrics address and checkpoint
  folder from the ps tasks (``started_run``) once the chief has started the run there, then trains; it
  follows the run to a new one (a chief started again) or a new attempt (a lost ps recovered).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import replace

import torch

from ..errors import ConfigError, PeerLost, RunOver, RuntimeTimeout, StaleTask
from ..spec import ClusterSpec, TaskSpec
from ..task_config import from_environment
from .client import PSClient
from .optim import check
from .plan import TrainPlan
from .ps import ParameterServer
from .seeding import build_model
from .worker import run_worker

PS_QUIET_S = 60.0
# a ps holding no run ends after this long without a request (its job gone, the ps started again by hand): as
# long as a worker waits for its chief's run (request_timeout's default) and a chief's supervisor for its lost ps,
# both asking every 0.2 s; only a lone chief slower to its first training call leaves a fresh ps unasked that long
NO_RUN_S = 120.0
DISCOVER_POLL_S = 0.2
# a task waiting this long for the chief's run checks the run's optimizer options itself: an error there is what
# stops the chief (the same script, the same arguments), said on every task; a task whose run starts sooner
# builds no optimizer (whose first one costs about 1.5 s of CPU: torch._dynamo)
CHECK_OPTIONS_AFTER_S = 3.0


def serve_ps() -> None:
    """Serve the ps task named in the environment until SIGTERM/SIGINT or a SHUTDOWN message."""
    spec, task = from_environment()
    if task.role != "ps":
        raise ConfigError(f"{task.name} is a worker: run it from your script with train_from_environment()")
    _serve(spec, task, idle_s=None)


def serve_run(spec: ClusterSpec, task: TaskSpec, *, idle_s: float = NO_RUN_S) -> dict:
    """Serve ps ``task`` for one run: ``{"task": index, "role": "ps", "global_step": its last step}``. A ps that
    holds no run and hears from nobody for ``idle_s`` seconds ends, saying so (global step None). Raises
    SystemExit (status 1, one line naming the run) once the run's owner has let its lease lapse."""
    return {"task": task.index, "role": "ps", "global_step": _serve(spec, task, idle_s=idle_s)}


def _serve(spec: ClusterSpec, task: TaskSpec, *, idle_s: float | None) -> int | None:
    """Serve ``task`` until SIGTERM/SIGINT, a SHUTDOWN message, or (with ``idle_s``, one run) the end of the run
    it serves, ``idle_s`` seconds without a run and without a request, or its owner lost (SystemExit); the run's
    last global step, if it had one."""
    one_run = idle_s is not None
    server = ParameterServer(spec.key, index=task.index, host=task.host, port=task.port, encrypt=spec.encrypt).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    owner_lost = None
    while not done.is_set() and server.running and not (one_run and server.done_serving(PS_QUIET_S)):
        if one_run and (owner_lost := server.owner_lost) is not None:
            break
        if one_run and server.run is None and time.monotonic() - server.last_request > idle_s:
            print(f"ps {task.index} served no run and heard from nobody for {idle_s:g}s: ending (start the whole "
                  "job again)", file=sys.stderr, flush=True)
            break
        done.wait(0.2)
    server.shutdown()
    if owner_lost is not None:
        raise SystemExit(f"ps {task.index} ends: {owner_lost} (start the whole job again: it resumes from its "
                         "latest checkpoint)")
    return server.run.step if server.run is not None else None


def check_options(plan: TrainPlan, model: torch.nn.Module) -> None:
    """What torch refuses of ``plan``'s optimizer, its options and schedule for ``model`` (built as the plan
    says; only read): a one-line ConfigError, as at ``train()`` (``optim.check``)."""
    check(model, plan.optimizer_spec, steps=plan.steps)


def join_run(spec: ClusterSpec, index: int, plan: TrainPlan, model_fn, dataset, loss_fn, *, step_fn=None,
             collate_fn=None, log=print) -> dict:
    """Train as worker ``index`` (not the chief) in the run the chief starts on the ps tasks: its summary once the
    run is over. The worker follows the run wherever it goes: a chief started again starts a new run (from the
    latest checkpoint), a lost ps a new attempt of the same run (recovery), and the worker joins it."""
    after = None  # (run id, attempt) this worker trained in last
    while True:
        # once a run has started, the chief's check passed its options
        unchecked = None if after else lambda: check_options(plan, build_model(model_fn, plan.seed))
        run = started_run(spec, plan.request_timeout, after=after, waiting=unchecked)
        joined = replace(plan, run_id=run["run_id"], attempt=run["attempt"], metrics_address=run["metrics_address"],
                         checkpoint_dir=run["checkpoint_dir"])
        after = (joined.run_id, joined.attempt)
        try:
            summary = run_worker(spec, index, joined, model_fn, dataset, loss_fn, step_fn=step_fn,
                                 collate_fn=collate_fn, log=log)
        except RunOver:
            note = f"run {joined.run_id} was started again by its chief: joining the new one"
        except (PeerLost, StaleTask) as e:  # a ps lost: the chief starts the run's next attempt
            note = f"run {joined.run_id} lost a ps ({type(e).__name__}): joining its next attempt"
        else:
            if summary["global_step"] >= joined.steps or _ended(spec, after, joined.request_timeout):
                if not summary["local_steps"] and log is not None:
                    log(reached_already(joined.run_id, joined.steps))
                return summary
            note = f"run {joined.run_id} stopped attempt {joined.attempt}: joining the next"
        if log is not None:
            log(note)


def reached_already(run_id: int, steps: int) -> str:
    """What a task of a job started again after it finished says: nothing was left to train."""
    return f"run {run_id}: the target step {steps} is reached already (its latest checkpoint): nothing to train"


def _ended(spec: ClusterSpec, attempt: tuple[int, int], timeout: float) -> bool:
    """After attempt ``(run id, attempt)`` stopped short of its target: True once its supervisor has closed the
    run (or every ps task is gone), False once a ps holds another attempt or run. A ps gone while the others
    still hold the attempt was lost: its recovery starts the next attempt."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [s[0] for s in (held_runs(spec, only=[i]) for i in range(len(spec.ps))) if s is not None]
        if not held or any(s.get("finalized") for s in held):
            return True
        if any((s.get("run_id"), s.get("attempt")) != attempt for s in held):
            return False
        time.sleep(DISCOVER_POLL_S)
    return True


def _at_target(held: dict) -> bool:
    """Whether the run a ps holds (its STATS) is at its target step: a job started again after it finished,
    whose chief restored that step. Its workers join it and end at once."""
    return isinstance(held.get("steps"), int) and held.get("step", 0) >= held["steps"]


def held_runs(spec: ClusterSpec, *, only: list[int] | None = None, timeout: float = 10.0) -> list[dict] | None:
    """What every ps (``only``: these) says of the run it holds (its STATS), asked as no worker; None when one
    does not answer within ``timeout`` s."""
    try:
        with PSClient(spec, run_id=1, timeout=timeout, only=only) as client:
            return client.stats()
    except (RuntimeTimeout, PeerLost):
        return None


def started_run(spec: ClusterSpec, timeout: float, *, after: tuple[int, int] | None = None,
                waiting=None) -> dict:
    """The run every ps holds and has not ended (its id, attempt, metrics address and checkpoint folder), once
    the chief has started it (``after``: a run or attempt other than that ``(run id, attempt)``); RuntimeTimeout
    after ``timeout`` s without one. ``waiting()`` is called once when none has started within
    ``CHECK_OPTIONS_AFTER_S`` (what it raises, this raises). It asks as no worker: a recovery fences off the
    sessions of the workers of the failed attempt, not those of their questions."""
    began = time.monotonic()
    deadline = began + timeout

    def still_waiting() -> None:
        nonlocal waiting
        if waiting is not None and time.monotonic() - began >= CHECK_OPTIONS_AFTER_S:
            waiting, check_now = None, waiting
            check_now()

    while True:
        try:
            with PSClient(spec, run_id=1, timeout=timeout) as client:
                while True:
                    held = client.stats()
                    ids = {(s.get("run_id"), s.get("attempt")) for s in held}
                    if (len(ids) == 1 and None not in next(iter(ids)) and ids != {after}
                            and not any(s.get("stopped") and not _at_target(s) for s in held)):
                        return held[0]
                    if time.monotonic() > deadline:
                        break
                    still_waiting()
                    time.sleep(DISCOVER_POLL_S)
        except PeerLost:  # a ps lost, and not started again yet
            if time.monotonic() > deadline:
                break
            still_waiting()
            time.sleep(DISCOVER_POLL_S)
    raise RuntimeTimeout(f"the chief started no run on the ps tasks within {timeout:.0f}s: start the chief's task "
                         "(TF's chief, or worker 0) with the same script, and every ps task")
