"""``pscluster.init()``: the user's own loop in a script, every task of the cluster running the same script, as with
TF's ``MonitoredTrainingSession`` or ``torchrun``. The cluster and this process's task come from ``TF_CONFIG`` or
``PSCLUSTER_CONFIG`` (``task_config``); ``pscluster launch`` sets them for a local cluster.

    ctx = pscluster.init(mode="sync", steps=1000)    # a ps task serves here and never returns
    model = ctx.model(Net())
    optimizer = ctx.optimizer(torch.optim.Adam(model.parameters()))
    for x, y in ctx.shard(train_set, batch_size=64):
        ...; optimizer.step()
        if ctx.should_stop():
            break

- A ps task serves the run and ends the process once the chief has finalized it (TF's ``server.join()``).
- Each worker makes the run's plan from the modules and the optimizers its script registers (as ``Cluster.run``'s
  chief hands them to the kernel), at its loop's first training call (``context.FirstCallContext``): the first
  forward of a registered module once an optimizer is registered, a batch of ``ctx.shard``, ``ctx.global_step``,
  ``should_stop()`` or a step. The chief records the run in the run store and runs its ``Supervisor`` (metrics,
  checkpoints, the end), as ``train_from_environment``'s chief does; the other workers join the run the chief
  started on the ps tasks.
- The run ends for this worker at the first ``should_stop()`` that is true, or when the script ends; the chief
  then waits for the run's end and finalizes it (``ctx.run``), before the interpreter's shutdown begins.
- The process's exit status is the run's: the chief's is 1 when its run failed, any worker's when its own part
  failed. A ``RunEnded`` that escapes the script (a step after the run's end) is the loop's normal end: one line
  says why the run ended, and the status is the run's. Any other exception that escapes the script fails this
  worker's part of the run with it (the chief's: the run).
- SIGTERM (a scheduler's preemption, ``kill``) to the chief stops its run as ``Run.stop()`` does (status
  ``stopped``, the final checkpoint, the other workers released), and the chief then ends by that signal.

A lost worker process is its scheduler's to start again (``pscluster launch`` does): it joins the run. A lost ps
started again (``pscluster launch`` does; a TF_CONFIG job's scheduler must) is recovered as a notebook's is: every
worker's step that saw it go is left out, and the loop goes on in place, in the run's next attempt, from the newest
state there is; the user's code sees nothing. A ps not started again in time fails the run, and the job started
again resumes from its latest checkpoint.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its shutdown hook first, so that ours runs before it: see _at_exit
import os
import queue
import signal
import sys
import threading
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import zmq

from .. import environ
from ..errors import ConfigError, RunEnded, RuntimeTimeout, TrainingError
from ..metrics.store import RunStore
from ..runtime import standalone
from ..runtime.context import FirstCallContext, WorkerContext, loop_plan, settings_plan
from ..runtime.options import OPTIONS, SCRIPT, START, RunOptions
from ..runtime.plan import TrainPlan
from ..task_config import from_environment
from .run import Run
from .run_start import start_run
from .script_run import close_run
from .script_tasks import ScriptTasks
from .supervisor import one_line

SEND_S = 2.0  # how long a process ended by _exit waits for ZeroMQ to send what it holds
ATTEMPT_POLL_S = 0.2  # how often the chief, its ps lost, looks for the next attempt or the run's end


def init(*, store: str | os.PathLike | None = None, log=print, **options) -> "ScriptContext":
    """This process's part of the run (see the module): a ps task serves and exits; a worker gets its context.
    ``options``: the run's, as ``Cluster.run`` takes them (``options.names("script")``: ``mode``, ``steps``,
    ``seed``, ``placement``, the checkpoint options, ``name`` (default: the script's file name)...), over those
    typed on ``pscluster launch``'s command line, over the defaults; ``store`` and ``log`` (where this worker
    prints its progress lines; None: silent) as ``train_from_environment``'s. A worker's process ends as the
    module says (its exit status, ``RunEnded``)."""
    launched = environ.launch_options()
    given = RunOptions.take(SCRIPT, {**launched, **options}, caller="pscluster.init()")
    spec, task = from_environment()
    overridden = [name for name in launched if name in options and options[name] != launched[name]]
    if overridden and task.is_chief and log is not None:
        log(f"pscluster.init({', '.join(f'{name}={options[name]!r}' for name in overridden)}) overrides pscluster "
            f"launch's {', '.join(_flag(name, launched[name]) for name in overridden)}")
    if task.role == "ps":  # status 1: it served no run (a chief that never came), which launch starts again
        sys.exit(0 if standalone.serve_run(spec, task)["global_step"] is not None else 1)
    if task.role != "worker":
        raise ConfigError(f"a {task.role} task with pscluster.init(): evaluate in the loop on the chief "
                          "(if ctx.is_chief: ...), and leave the evaluator out of the cluster")
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("script")
    started = given.of(START)
    return ScriptContext(spec, task.index, given, started.replace(name=started.name or script.stem or "script"),
                         store=store, log=log, code=script.read_text() if script.is_file() else None)


def _flag(name: str, value) -> str:
    """Option ``name`` as typed on the command line: ``--seed 3``, ``--no-restore``."""
    flag = OPTIONS[name].flag_name
    return flag if isinstance(value, bool) else f"{flag} {value}"


class ScriptContext(FirstCallContext):
    """A script's worker context: its plan is made at the loop's first training call (a registered module's first
    forward once an optimizer is registered, a batch of ``ctx.shard``, ``ctx.global_step``...), from every module
    and optimizer registered by then. One a process: made, it takes the process's exit hook (``_at_exit``), its
    hook of uncaught exceptions (``_excepthook``) and, on the chief, SIGTERM (``_terminate``)."""

    def __init__(self, spec, index: int, options: RunOptions, started: RunOptions, *, store, log, code: str | None):
        """``options``: the run's (its variables and optimizer come at ``ctx.optimizer()``); ``started``: those read
        at its start (``options.START``), its name given."""
        self._run_options = options
        super().__init__(spec, index, settings_plan(options, num_workers=len(spec.workers)), self._planned_run,
                         log=log)
        self._run_record = dict(started=started, store=store, code=code)
        self.run: Run | None = None  # the chief's, once the run started
        self._outcome: Future = Future()  # this worker's summary (the chief's supervisor follows it)
        self._finishing = False
        self._attempts: queue.Queue = queue.Queue()  # the chief: the plans of the attempts after the first
        self._loop_error: BaseException | None = None  # what escaped the script (``_excepthook``)
        self._terminated = False  # the chief: SIGTERM came, and stopped its run (``_terminate``)
        # the interpreter's own shutdown hooks run after the main module: ours before concurrent.futures' (which
        # refuses new work from then on: the run's final checkpoint needs it), as threading calls them in reverse
        threading._register_atexit(self._at_exit)
        sys.excepthook = self._excepthook(sys.excepthook)
        if self._task.is_chief and threading.current_thread() is threading.main_thread():  # which alone takes signals
            signal.signal(signal.SIGTERM, self._terminate)

    def _planned_run(self, model, modules, optimizers) -> TrainPlan:
        """The run's plan, from what the loop registered: the chief starts the run; another worker joins the one
        the chief started on the ps tasks."""
        plan = loop_plan(model, modules, optimizers, self._run_options, num_ps=len(self._spec.ps),
                         num_workers=len(self._spec.workers))
        if self._task.is_chief:
            return self._start_run(plan)
        held = standalone.started_run(self._spec, plan.request_timeout)
        return replace(plan, run_id=held["run_id"], attempt=held["attempt"], metrics_address=held["metrics_address"],
                       checkpoint_dir=held["checkpoint_dir"])

    def _start_run(self, plan: TrainPlan) -> TrainPlan:
        """The chief: the run of ``plan`` in the run store, its supervisor following this loop and the other
        workers; the run's plan."""
        record = self._run_record
        runs = RunStore(record["store"])
        tasks = ScriptTasks(self._chief_worker)
        spec = self._spec
        # the notices go to this worker's log too: the chief follows its run silently
        self.run = start_run(runs, spec, plan, record["started"], cluster=spec.name, scripted=True,
                             code=record["code"], log=self._log, model_fn=self._modules.model, loss_fn=None,
                             tasks=tasks, metrics_host=self._task.host, metrics_port=self._task.port,
                             launch=lambda run: [tasks.launch_worker(spec, t.index, run) for t in spec.workers])
        return self.run.plan

    def _chief_worker(self, plan: TrainPlan, join: bool) -> dict:
        """What the supervisor follows as the chief's worker: this script's loop, in the main thread. A later
        attempt (a lost ps recovered) is the same loop, which joins it in place (``_rejoin``)."""
        if plan.attempt > 0:
            self._attempts.put(plan)
        return self._outcome.result()

    def _rejoin(self, lost: Exception) -> None:
        """A ps was lost during a step: this worker's copy of its values, for the recovery, then the run's next
        attempt joined in place, the loop going on from the values it restores (the step it was taking is left
        out; the user's code sees nothing). The chief's supervisor recovers the run once the ps is started again
        (``script_tasks``); the other workers find the next attempt on the ps tasks. ``lost`` is raised when the
        run does not go on."""
        if self._early is not None or self._loop_overlap is not None:
            raise lost  # overlap's gradient hooks were set for one attempt: the job resumes from its checkpoint
        self.failed(lost)
        step = self._reply.step
        plan = self._chief_next_attempt(lost) if self._task.is_chief else self._next_attempt_on_ps()
        if plan is None:
            raise lost
        if self._log is not None:
            self._log(f"a ps was lost at global step {step} ({type(lost).__name__}): joining attempt "
                      f"{plan.attempt} of run {plan.run_id}")
        self._leave_attempt()
        self._plan = plan
        WorkerContext._start(self)

    def _chief_next_attempt(self, lost: Exception) -> TrainPlan | None:
        """The chief's worker of this attempt fails with ``lost`` (its supervisor's recovery begins); the plan of
        the next attempt, or None when the run ended instead."""
        failed, self._outcome = self._outcome, Future()  # the next attempt's worker follows the new one
        failed.set_exception(lost)
        while not self.run.supervisor.ended.is_set():
            try:
                return self._attempts.get(timeout=ATTEMPT_POLL_S)
            except queue.Empty:
                pass
        return None

    def _next_attempt_on_ps(self) -> TrainPlan | None:
        """Another worker: the plan of the attempt the chief starts next on the ps tasks, or None."""
        try:
            held = standalone.started_run(self._spec, self._plan.request_timeout,
                                          after=(self._plan.run_id, self._plan.attempt))
        except RuntimeTimeout:
            return None
        return replace(self._plan, run_id=held["run_id"], attempt=held["attempt"],
                       metrics_address=held["metrics_address"], checkpoint_dir=held["checkpoint_dir"])

    def should_stop(self) -> bool:
        stop = super().should_stop()
        if stop and not self._finishing:
            self._finish()
        return stop

    def _finish(self) -> None:
        """This worker's end: its summary (or the error that escaped the script); the chief waits for the run's
        end and finalizes it (TrainingError when the run failed)."""
        self._finishing = True  # finish() asks should_stop() again
        if self._loop_error is not None:
            error = self._loop_error
            if not isinstance(error, Exception):  # Ctrl-C: the supervisor takes a worker's Exception as its failure
                error = TrainingError(f"worker {self.worker_index} was interrupted ({type(error).__name__})")
            self.failed(error)
            self._outcome.set_exception(error)
        else:
            try:
                self._outcome.set_result(super().finish())
            except BaseException as e:
                self._outcome.set_exception(e)
                raise
        if self.run is not None:
            try:
                self.run.wait(verbose=False)
            finally:
                close_run(self._spec, self.run.id)

    def _failure(self) -> str | None:
        """End this worker's part of the run (the chief: the run), if the loop did not; what failed, or None."""
        try:
            if self._reply is not None and not self._finishing:
                self._finish()
        except Exception as e:
            return one_line(e)
        finally:
            self.close()
        if self.run is not None and self.run.status == "failed":
            return self.run.error_line
        error = self._outcome.exception() if self._outcome.done() else None
        return one_line(error) if error is not None else None

    def _terminate(self, *_) -> None:
        """The chief's SIGTERM handler: the run stopped, as ``Run.stop()`` does; the loop ends at its next
        ``should_stop()`` or step, and the process by SIGTERM once the run is finalized (``_exit``). Before the run
        started, the process ends by SIGTERM now."""
        if self.run is None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        elif not self._terminated:
            self._terminated = True
            threading.Thread(target=self.run.supervisor.stop, name="pscluster-sigterm", daemon=True).start()

    def _at_exit(self) -> None:
        """The script's end (``threading._shutdown``, while every thread and concurrent.futures still work):
        the run's end, and this process's exit status, 1 if it failed (by SIGTERM after it came)."""
        failure = self._failure()
        if self._terminated:
            _exit(1, f"pscluster: SIGTERM: run {self.run.id} {self.run.status}" + (f": {failure}" if failure else ""),
                  by=signal.SIGTERM)
        if failure is not None and self._loop_error is None:  # an exception that escaped exits 1 already
            _exit(1, f"pscluster: {failure}")

    def _excepthook(self, previous):
        """``sys.excepthook``: a ``RunEnded`` is the loop's normal end (one line, the run's exit status); any
        other exception fails this worker's part of the run, shown by the ``previous`` hook."""
        def hook(kind, error, tb):
            if not issubclass(kind, RunEnded):
                self._loop_error = error
                previous(kind, error, tb)
                return
            failure = self._failure()
            _exit(1 if failure else 0, f"pscluster: worker {self.worker_index}: {error}" +
                  (f"; {failure}" if failure else ""), by=signal.SIGTERM if self._terminated else None)

        return hook


def _exit(status: int, line: str, *, by: signal.Signals | None = None) -> None:
    """Say ``line`` and end the process with ``status`` now (past the interpreter's own exit status, which a
    hook cannot change), or ``by`` that signal, once ZeroMQ has sent what the closed sockets hold (this worker's
    summary), for up to ``SEND_S``."""
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sent = threading.Thread(target=zmq.Context.instance().term, daemon=True)
    sent.start()
    sent.join(SEND_S)
    if by is not None:
        signal.signal(by, signal.SIG_DFL)
        signal.raise_signal(by)
    os._exit(status)
