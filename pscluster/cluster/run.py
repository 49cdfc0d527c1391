"""Run: the user's handle on one training run, a read-only view of its ``Supervisor``.

The supervisor trains it in the background and alone changes it; the handle waits for it, asks it to stop or
checkpoint, and reads what it trained: the final parameters (so nothing trained is lost when the cluster stops
afterwards), the run store's metrics and events, the dashboard.
"""

from __future__ import annotations

import html
import math
import os
import queue
import sys
import threading
import time

import pandas as pd
import torch

from ..errors import RuntimeTimeout, TrainingError
from ..metrics import epochs, speed
from ..metrics.store import RunStore
from ..runtime import checkpoint
from ..runtime.evaluation import evaluate
from ..runtime.plan import TrainPlan
from ..runtime.policies import policy_for
from ..runtime.steps import traceable_inputs
from ..runtime.seeding import build_model
from ..spec import ClusterSpec
from . import recovery, user_traceback
from .checkpoint_commits import CheckpointCoordinator
from .progress import StepProgress
from .supervisor import Supervisor

DASHBOARD_END_S = 10.0  # the most wait() waits for a dashboard it displayed to show the run's end


class Run:
    """A training run on a cluster. ``cluster.train(...)`` returns one; it trains in the background.

    Its ``supervisor`` follows the workers, evaluates the model on ``test_dataset``
    at every multiple of ``eval_every`` global steps, exactly (from the checkpoints the ps tasks write there), and
    at the end (into the run store: ``evaluations()``), commits the checkpoints the ps tasks write,
    replaces lost tasks (with ``tasks``, the cluster; see ``recovery``), and finalizes the run when the
    workers end. ``example_batch``: a batch of the dataset, on which the model's graph is traced for
    TensorBoard. The rest of the arguments are the supervisor's.
    """

    def __init__(self, spec: ClusterSpec, plan: TrainPlan, model_fn, loss_fn, store: RunStore, *, step_fn=None,
                 collate_fn=None, test_dataset=None, eval_every: int | None = None,
                 tasks: recovery.Tasks | None = None, checkpoints: CheckpointCoordinator | None = None,
                 payload: bytes = b"", metrics_port: int = 0, metrics_host: str = "127.0.0.1",
                 metrics_ports: tuple[int, int] | None = None, example_batch=None):
        self.store = store
        self._model_fn = model_fn
        self._loss_fn = loss_fn
        self._step_fn = step_fn
        self._collate_fn = collate_fn
        self._rates, self._rates_row = speed.RunRates(), 0  # from the store's metric rows up to that row
        self._rates_lock = threading.Lock()
        self._dashboards = []  # those run.dashboard() displayed: wait() returns once they show the end
        self._displays: list[threading.Thread] = []  # each shows this run's end in an output that showed it live
        evaluator = None if test_dataset is None else lambda state: self._evaluate_state(state, test_dataset)
        self.supervisor = Supervisor(spec, plan, store, tasks=tasks, checkpoints=checkpoints, payload=payload,
                                     evaluator=evaluator, eval_every=eval_every, summarize=self.summary,
                                     metrics_port=metrics_port, metrics_host=metrics_host,
                                     metrics_ports=metrics_ports)
        self.name = self.supervisor.name
        inputs = traceable_inputs(example_batch, step_fn)
        if inputs is not None:
            self.supervisor.event_files.trace_graph(build_model(model_fn, plan.seed), inputs)

    @classmethod
    def adopt(cls, spec: ClusterSpec, plan: TrainPlan, store: RunStore, worker_results, *, tasks: recovery.Tasks,
              payload: bytes) -> "Run":
        """Follow a run that another process started (on a detached cluster) and trains still: its metrics are
        received again at the address its tasks send to, and it is finalized here. Its model and loss
        functions stay on the engines (``state_dict()`` works, ``model()`` does not)."""
        host, port = plan.metrics_address[len("tcp://"):].rsplit(":", 1) if plan.metrics_address else ("127.0.0.1", 0)
        run = cls(spec, plan, None, None, store, tasks=tasks, payload=payload, metrics_port=int(port),
                  metrics_host=host)
        run.supervisor.note("adopted", "controller", {"pid": os.getpid()})
        run.supervisor.start(lambda _: worker_results, adopted=True)
        return run

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

    def _evaluate_state(self, state: dict, dataset) -> dict:
        model = build_model(self._model_fn, self.plan.seed)
        model.load_state_dict(state)
        return evaluate(model, dataset, self._loss_fn, step_fn=self._step_fn, collate_fn=self._collate_fn)

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
        return None if self.results is None else [r["local_steps"] + self.supervisor.earlier_local_steps(r["task"])
                                                  for r in self.results]

    @property
    def wall_s(self) -> float:
        return (self.finished or time.time()) - self.started

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
        if self._model_fn is None:
            raise TrainingError(f"{self.name} was started by another process, whose model_fn this one does not "
                                "have: build the model and load run.state_dict() into it")
        model = build_model(self._model_fn, self.plan.seed)
        model.load_state_dict(self.state_dict(timeout))
        return model

    def evaluate(self, dataset, *, batch_size: int = 1024, timeout: float | None = None) -> dict:
        """``{"loss": ..., "accuracy": ...}`` of the trained model on ``dataset`` (waits for the run's end as
        ``state_dict`` does)."""
        return evaluate(self.model(timeout), dataset, self._loss_fn, step_fn=self._step_fn, batch_size=batch_size,
                        collate_fn=self._collate_fn)

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
        stats = self.ps_stats or self.supervisor.read_ps_stats(5.0) or [{}]
        return {int(k): v for k, v in stats[0].get("staleness", {}).items()}

    def rates(self) -> speed.RunRates:
        """The run's steps/s (global and each worker's, by ``speed.rate``) and the span of its reported steps,
        from the metric rows the run store holds so far."""
        with self._rates_lock:
            new = self.store.metrics(self.id, after_row=self._rates_row)
            if len(new):
                self._rates.add(new)
                self._rates_row = int(new["row"].max())
            return self._rates

    def summary(self) -> dict:
        """The run as plain data (for reports): mode, sizes, steps, speed, times.

        ``steps_per_s`` (global) and ``worker_steps_per_s`` (local, by worker index) by ``speed.rate``: over
        the last ``speed.RECENT_S`` seconds while the run trains, over all its rows once it ended; None
        where there is no rate. ``wall_s``, ``startup_s`` (to the first reported step) and ``training_s``
        (from the first reported step to the last) by ``speed.phases``."""
        results = self.results or []
        samples = sum(r["samples"] for r in results)
        stats = self.ps_stats or [{}]
        rates, live = self.rates(), self.finished is None
        return {"name": self.name, "run_id": self.plan.run_id, "mode": self.mode,
                "ps": len(self.spec.ps), "workers": len(self.spec.workers),
                "replicas_to_aggregate": self.plan.replicas_to_aggregate, "steps": self.plan.steps,
                "global_step": stats[0].get("step"), "local_steps": self.local_steps,
                "dropped_stale": stats[0].get("dropped_stale"), "late": stats[0].get("late"),
                "staleness": self.staleness() if policy_for(self.mode).counts_staleness else None,
                "samples_per_sec": samples / self.wall_s if self.done and self.wall_s > 0 else None,
                "steps_per_s": _number(rates.run(live=live)),
                "worker_steps_per_s": {w: _number(r) for w, r in rates.workers(live=live).items()},
                **speed.phases(self.started, self.finished, rates.span(), time.time()), "status": self.status}

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


def _number(v: float) -> float | None:
    """``v``, or None for NaN (a summary is JSON)."""
    return None if math.isnan(v) else v


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
