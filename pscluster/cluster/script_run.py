"""``train_from_environment``: training from a script, every task of the cluster running the same one, as
with TF's Estimator and ``MonitoredTrainingSession``. The cluster and this process's task come from
``TF_CONFIG`` or ``PSCLUSTER_CONFIG`` (``task_config``).

- A ps task serves the run, and returns once the chief has finalized it (``runtime.standalone.serve_run``).
- The chief (TF's ``chief``, else worker 0) trains and runs the run's ``Supervisor``, as a notebook's kernel
  does: the run goes into the run store (``pscluster.runs()``, ``compare()``, the side panel and
  ``run.dashboard()`` in a notebook see it while it trains), every task's metric events come to its collector
  (on the chief's address and port as the config lists them), it commits the checkpoints the ps tasks write,
  evaluates ``test_dataset``, and starts from the latest checkpoint in ``checkpoint_dir`` when there is one:
  the whole job started again resumes where it stopped (the run it continues, whose chief died, is marked
  ``failed``). It returns the ``Run``. SIGTERM (what a scheduler sends to preempt a job) stops the run as
  ``Run.stop()`` does, status ``stopped`` with its final checkpoint, releases the workers, and then ends the
  chief by that signal.
- Any other worker learns the run from the ps tasks once the chief has started it there, trains, and returns
  its summary (``runtime.standalone.join_run``).
- The evaluator, when the cluster lists one, evaluates ``test_dataset`` on each checkpoint the run commits
  (``script_evaluator``); the chief then evaluates nothing itself.

The tasks of a script are processes the user (or a scheduler) starts, which nothing here can start again
(``script_tasks``): a ps lost and started again (same config) is recovered as a notebook's lost ps is, from
the newest state there is, and the workers rejoin the run's next attempt; a ps not started again fails the
run, and starting the job again resumes it from its latest checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from ..metrics.store import RunStore
from ..runtime import standalone
from ..runtime.steps import check_loss
from ..runtime.client import PSClient
from ..runtime.data import first_batch
from ..runtime.options import START, TRAIN_SCRIPT, keywords
from ..runtime.plan import training_plan
from ..runtime.steps import check_step
from ..runtime.worker import run_worker
from ..task_config import from_environment
from .run import Run
from .run_start import start_run
from .script_evaluator import evaluate_checkpoints
from .script_tasks import ScriptTasks


@keywords(TRAIN_SCRIPT)
def train_from_environment(model_fn, dataset, loss_fn=None, *, step_fn=None, store: str | os.PathLike | None = None,
                           test_dataset=None, param_groups=None, scheduler=None, scheduler_options: dict | None = None,
                           collate_fn=None, log=print, **keywords):
    """Run this process's task of the cluster in ``TF_CONFIG`` / ``PSCLUSTER_CONFIG``: the chief returns the
    ``Run`` (as ``Cluster.train(...).wait()`` does), another worker its summary, a ps task
    ``{"task", "role": "ps", "global_step"}``, the evaluator ``{"task", "role": "evaluator", "run_id",
    "evaluated": [steps]}``. Every task is given the same arguments.

    ``name``: the run's name in the run store (default: the script's file name, e.g. ``estimator``);
    ``store``: the run store (default ``$PSCLUSTER_HOME/runs.sqlite``). ``checkpoint_dir`` (default
    ``checkpoints/<name>`` beside the run store): where the ps tasks write their shards, and where the chief
    looks for the latest checkpoint to start from (``restore=False``: start from scratch). ``test_dataset``: what
    the evaluator task evaluates each checkpoint on, or without one the chief every ``eval_every`` global steps
    and at the end; ``checkpoint_secs``, ``keep_checkpoints`` and the other options (``optimizer``, ``mode``,
    ``steps``, ``batch_size``, ``checkpoint_every``...) as in ``Cluster.train``. ``log``: where a worker prints
    its progress lines (the chief prints every worker's); None: silent."""
    spec, task = from_environment()
    if task.role == "ps":
        return standalone.serve_run(spec, task)
    check_loss(loss_fn, step_fn)
    plan, options, dataset, collate_fn, model = training_plan(
        model_fn, dataset, keywords, entry=TRAIN_SCRIPT, of=train_from_environment, num_ps=len(spec.ps),
        num_workers=len(spec.workers), param_groups=param_groups, scheduler=scheduler,
        scheduler_options=scheduler_options, collate_fn=collate_fn)
    if task.role == "evaluator":
        return evaluate_checkpoints(spec, plan, model_fn, test_dataset, loss_fn, step_fn=step_fn,
                                    collate_fn=collate_fn, store=store, log=log)
    if not task.is_chief:
        return standalone.join_run(spec, task.index, plan, model_fn, dataset, loss_fn, step_fn=step_fn,
                                   collate_fn=collate_fn, log=log)
    standalone.check_options(plan, model)
    example_batch = first_batch(dataset, 2, collate_fn)
    check_step(model, loss_fn, step_fn, example_batch)
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("script")
    started = options.of(START)
    started = started.replace(name=started.name or script.stem or "script")
    runs = RunStore(store)
    tasks = ScriptTasks(lambda plan, join: run_worker(spec, 0, plan, model_fn, dataset, loss_fn, step_fn=step_fn,
                                                      collate_fn=collate_fn, join=join))
    run = start_run(runs, spec, plan, started, cluster=spec.name, scripted=True,
                    code=script.read_text() if script.is_file() else None,
                    launch=lambda supervisor: [tasks.launch_worker(spec, t.index, supervisor) for t in spec.workers],
                    model_fn=model_fn, loss_fn=loss_fn, step_fn=step_fn, collate_fn=collate_fn,
                    test_dataset=None if spec.evaluator else test_dataset, tasks=tasks,
                    metrics_host=task.host, metrics_port=task.port, example_batch=example_batch)
    with _stopped_on_sigterm(run):
        try:
            run.wait(verbose=log is not None)
        finally:
            close_run(spec, run.id)
    if log is not None and run.status == "finished" and not any(run.local_steps):
        log(standalone.reached_already(run.id, plan.steps))
    return run


@contextlib.contextmanager
def _stopped_on_sigterm(run: Run):
    """While the chief follows ``run``: SIGTERM (a scheduler's preemption, ``scancel``, ``kill``) stops the run
    cleanly, as ``Run.stop()`` does (the final checkpoint, status ``stopped``, every worker released), and then
    ends this process by the same signal, through the handler that was there before."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may take signals
        yield
        return
    terminated = threading.Event()

    def stop(*_):
        if not terminated.is_set():
            terminated.set()
            threading.Thread(target=run.supervisor.stop, name="pscluster-sigterm", daemon=True).start()

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        if terminated.is_set():
            signal.raise_signal(signal.SIGTERM)


def close_run(spec, run_id: int) -> None:
    """Tell the ps tasks the run is finalized: a ps serving this one run ends."""
    try:
        with PSClient(spec, run_id=run_id, timeout=10.0) as client:
            client.close_run()
    except Exception:  # a ps gone already: nothing to end
        pass
