"""Run: the user's handle on one training run, a read-only view of its ``Supervisor``.

The supervisor trains it in the background and alone changes it; the handle waits for it, asks it to stop or
checkpoint, and reads what it trained: the final parameters (so nothing trained is lost when the cluster stops
afterwards), the run store's metrics and events, the dashboard.
"""

from __future__ import annotations

import html
import queue
import sys
import threading
import time

import pandas as pd
import torch

from ..errors import RuntimeTimeout, TrainingError
from ..metrics import epochs, speed
from ..runtime import checkpoint
from ..runtime.plan import TrainPlan
from ..spec import ClusterSpec
from . import run_summary, user_traceback
from .model_code import ModelCode
from .progress import StepProgress
from .supervisor import Supervisor

DASHBOARD_END_S = 10.0  # the most wait() waits for a dashboard it displayed to show the run's end


class Run:
    """A training run on a cluster. ``cluster.train(...)`` returns one; it trains in the background.

    A handle on the ``supervisor`` that follows the run (see ``run_start``, which starts both): it reads what the
    supervisor and the run store hold, and asks the supervisor to stop or checkpoint. ``code``: the model, loss,
    step and collate functions, with which ``model()`` and ``evaluate()`` build the trained model in this process.
    """

    def __init__(self, supervisor: Supervisor, code: ModelCode = ModelCode()):
        self.supervisor = supervisor
        self.store = supervisor.store
        self.name = supervisor.name
        self._code = code
        self._dashboards = []  # those run.dashboard() displayed: wait() returns once they show the end
        self._displays: list[threading.Thread] = []  # each shows this run's end in an output that showed it live

    @property
    def id(self) -> int:
        """The run's id in the run store (also its id on the data plane)."""
        return self.supervisor.id

    @property
    def spec(self) -> ClusterSpec:
        """The tasks the run trains on now (a replaced or added task changes it)."""
        return self.supervisor.spec

    @property
    def plan(self) -> TrainPlan:
        """The run's plan now (its attempt, worker count...)."""
        return self.supervisor.plan

    @property
    def logs(self) -> list[str]:
        """The workers' log lines and the run's events, in the order they arrived."""
        return self.supervisor.logs

    @property
    def results(self) -> list[dict] | None:
        """Each worker's summary once the run finished."""
        return self.supervisor.results

    @property
    def ps_stats(self) -> list[dict] | None:
        """Each ps task's statistics once the run is over."""
        return self.supervisor.ps_stats

    @property
    def error(self) -> str | None:
        """Why the run failed: each failed worker's whole traceback."""
        return self.supervisor.error

    @property
    def error_line(self) -> str | None:
        """Why the run failed, in one line."""
        return self.supervisor.error_line

    @property
    def failure(self) -> dict | None:
        """Why the run failed, as the run store keeps it: ``cause`` (``error_line``), ``task`` (the first task
        that failed), ``step`` (the global step it failed at) and ``traceback`` (``error``); None unless it failed."""
        return self.supervisor.failure

    @property
    def started(self) -> float:
        return self.supervisor.started

    @property
    def finished(self) -> float | None:
        return self.supervisor.finished

    def latest_checkpoint_step(self) -> int | None:
        """The global step of the run's newest committed checkpoint (None: none yet)."""
        return self.supervisor.latest_checkpoint_step()

    def export(self, path):
        """Write the parameters of the run's latest checkpoint as a plain ``state_dict`` file, which
        ``torch.load`` reads without pscluster; returns its path."""
        return checkpoint.export_state_dict(checkpoint.Checkpoint.load(self.supervisor.latest_checkpoint_path()),
                                            path)

    # --- state --------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def done(self) -> bool:
        return self.supervisor.ended.is_set()

    @property
    def global_step(self) -> int:
        """The global step: final once done (from ps 0), else the latest one a worker reported."""
        if self.ps_stats is not None:
            return self.ps_stats[0].get("step", 0)
        return self.supervisor.latest_step

    @property
    def local_steps(self) -> list[int] | None:
        """Each worker's local steps once the run is over, over every attempt of the run (a lost ps restarts it)."""
        return run_summary.local_steps(self.supervisor)

    @property
    def wall_s(self) -> float:
        return run_summary.wall_s(self.supervisor)

    # --- control -------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, *, verbose: bool = True, progress: bool = False) -> "Run":
        """Block until training ends and the dashboards ``dashboard()`` displayed show its end, printing each
        worker's progress lines and printed lines as they arrive; ``progress=True`` adds a progress bar of the global
        step. A failed run raises a ``TrainingError``: the user's error first (``user_traceback.training_error``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = None
        if progress:
            bar = StepProgress(self.plan.steps, self.name)
        try:
            while not self.supervisor.ended.wait(0.1):
                self._print_pending(verbose, bar)
                if bar is not None:
                    bar.update(self.supervisor.latest_step, self.rates().run(live=True))
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeTimeout(f"{self.name} still training after {timeout:.0f}s: "
                                         "call run.wait() again, or run.stop() to end it")
            if bar is not None:
                bar.update(self.global_step, self.rates().run(live=False), force=True)
            for view in [*self._dashboards, *self._displays]:  # else its final update lands in a later cell's output
                view.join(DASHBOARD_END_S if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            self._print_pending(verbose, bar)
            if bar is not None:
                bar.close()
        if self.failure is not None:
            raise user_traceback.training_error(self._failures(), self.error_line)
        return self

    def _failures(self) -> list[tuple[int, BaseException]]:
        """(worker index, its error) of each failed worker of the spec, by index."""
        failed = []
        for i, result in enumerate(self.supervisor.worker_results):
            if result.ready() and not result.successful():
                try:
                    result.get(0)
                except Exception as e:  # its ipyparallel RemoteError, or why it was lost
                    failed.append((i, e))
        return failed

    def stop(self, timeout: float = 30.0) -> "Run":
        """End training cleanly at the next global step (every ps on the same step, which the final checkpoint
        holds) and wait for it; stops at once if that takes longer than ``timeout`` s."""
        if not self.done:
            self.supervisor.stop()
            try:
                self.wait(timeout=timeout, verbose=False)
            except RuntimeTimeout:
                self.supervisor.signal_stop()
                self.wait(timeout=self.plan.request_timeout, verbose=False)
        return self

    def checkpoint(self, timeout: float = 60.0):
        """Write a checkpoint now (at the next global step; the last one once the run is over) and
        return its manifest's path."""
        return self.supervisor.checkpoint(timeout)

    def _print_pending(self, verbose: bool, bar=None) -> None:
        while True:
            try:
                line = self.supervisor.pending_logs.get_nowait()
            except queue.Empty:
                return
            if verbose and bar is not None:
                bar.write(line)
            elif verbose:
                print(line, file=sys.stdout, flush=True)

    # --- results ------------------------------------------------------------------------
    def state_dict(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """The trained model's ``state_dict()`` (once the run is over: waits for it, ``timeout`` seconds at most,
        see ``wait``): parameters, buffers, every key of a tied parameter; ``model.load_state_dict(run.state_dict())``
        takes it as it is (strict). A failed run gives its last parameters (from the ps tasks, or its latest
        checkpoint)."""
        if self.supervisor.state_dict is None and self.failure is None:
            self.wait(timeout)
        if self.supervisor.state_dict is None:
            raise TrainingError(f"{self.name} failed and neither its ps tasks nor a checkpoint hold its parameters: "
                                f"{self.error_line}")
        return dict(self.supervisor.state_dict)

    def model(self, timeout: float | None = None) -> torch.nn.Module:
        """A model built by ``model_fn`` in this process, holding the trained state (loaded strictly; waits for the
        run's end as ``state_dict`` does)."""
        return self._code.model(self.state_dict(timeout), self.name)

    def evaluate(self, dataset, *, batch_size: int = 1024, timeout: float | None = None) -> dict:
        """``{"loss": ..., "accuracy": ...}`` of the trained model on ``dataset`` (waits for the run's end as
        ``state_dict`` does)."""
        return self._code.evaluate(self.model(timeout), dataset, batch_size=batch_size)

    def dashboard(self) -> None:
        """Display this run's dashboard: live while it trains, the final figures once it is over.

        (It returns nothing, so that a cell ending with it does not display it twice.)
        """
        from ..widgets import show

        self._dashboards.append(show(self.store.path, self.id))

    def metrics(self) -> pd.DataFrame:
        """Per-step worker metrics from the run store: one row per reported step per worker
        (worker, time, local_step, global_step, loss, accuracy, compute_s, wait_s, comm_s, bytes, staleness)."""
        return self.store.metrics(self.id)

    def evaluations(self) -> pd.DataFrame:
        """The evaluations of ``test_dataset`` from the run store, one row per evaluated global step (global_step,
        time, loss, accuracy): at every multiple of ``eval_every`` and at the end, each step once."""
        return self.store.evaluations(self.id)

    def events(self) -> pd.DataFrame:
        """The run's events from the run store (time, task, kind, detail): start, lost, replaced,
        restarting, restored, checkpoint, end..."""
        return self.store.events(self.id)

    def staleness(self) -> dict[int, int]:
        """Histogram of push staleness, counted by ps 0 (async runs)."""
        return run_summary.staleness(self.supervisor)

    def rates(self) -> speed.RunRates:
        """The run's steps/s (global and each worker's, by ``speed.rate``) and the span of its reported steps,
        from the metric rows the run store holds so far."""
        return self.supervisor.rates.now()

    def summary(self) -> dict:
        """The run as plain data (for reports): mode, sizes, steps, speed, times (``run_summary.summary``)."""
        return run_summary.summary(self.supervisor)

    @property
    def status(self) -> str:
        """training, finished, failed or stopped."""
        return self.supervisor.status

    def __repr__(self) -> str:
        progress = epochs.progress(self.summary()["global_step"], self.plan.steps, self.store.epochs(self.id))
        found = self.store.divergence(self.id)
        diverging = "" if found is None else f", {found.words()}"
        return f"<Run {self.name} {self.mode} {self.status}{diverging}: {progress}, local steps {self.local_steps}>"

    def _repr_html_(self) -> str:
        """Its summary as a table (and a failed run's cause); while it trains, one line that says so."""
        if not self.done:
            return (f"<div>{html.escape(self.name)} is training ({html.escape(self.mode)}, {len(self.spec.ps)} ps, "
                    f"{len(self.spec.workers)} workers): its summary shows here when it ends</div>")
        s = self.summary()
        if self.failure is not None:
            s["cause"] = self.failure["cause"]
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                       f"<td style='text-align:left'>{html.escape(_fmt(v))}</td></tr>"
                       for k, v in s.items() if k != "staleness" or v)
        return f"<table>{rows}</table>"

    def _ipython_display_(self) -> None:
        """Displayed (a cell's value, ``display(run)``): ``_repr_html_``, shown again when a run that trains ends,
        so that an output never keeps a snapshot of a run that went on."""
        from IPython.display import display

        def bundle() -> dict:
            return {"text/html": self._repr_html_(), "text/plain": repr(self)}

        handle = display(bundle(), raw=True, display_id=True)
        if not self.done:
            def show_end():
                self.supervisor.ended.wait()
                handle.update(bundle(), raw=True)

            self._displays.append(threading.Thread(target=show_end, name=f"pscluster-{self.name}-display",
                                                   daemon=True))
            self._displays[-1].start()


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
