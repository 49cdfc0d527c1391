"""Run: the controller's handle on one training run.

Workers train in ipyparallel tasks; their metric events arrive through a
Collector and go to the run store; when they finish, the run keeps the final
parameters, so nothing trained is lost when the cluster stops afterwards.
"""

from __future__ import annotations

import html
import math
import os
import queue
import re
import traceback
import sys
import threading
import time

import pandas as pd
import torch

from ..errors import RuntimeTimeout, TrainingError
from ..metrics import speed
from ..metrics.collector import Collector
from ..metrics.store import RunStore
from ..runtime import checkpoint
from ..runtime.client import PSClient
from ..runtime.evaluation import evaluate
from ..runtime.network import bind_in_range
from ..runtime.plan import TrainPlan, assemble, state_dict_of
from ..runtime.ps import wait_until
from ..runtime.worker import build_model
from ..spec import ClusterSpec
from . import recovery
from .checkpoint_commits import CheckpointCoordinator
from .progress import StepProgress

RESULT_GRACE_S = 2.0  # how long a worker's ipyparallel result may trail its "done" event before the event stands in


class Run:
    """A training run on a cluster. ``cluster.train(...)`` returns one; it trains in the background.

    A monitor thread follows the workers, evaluates the model on ``test_dataset`` every
    ``eval_every`` global steps (into the run store), commits the checkpoints the ps tasks write,
    replaces lost tasks (with ``tasks``, the cluster; see ``recovery``), and finalizes the run when
    the workers end.
    """

    def __init__(self, spec: ClusterSpec, plan: TrainPlan, model_fn, loss_fn, store: RunStore, *, step_fn=None,
                 collate_fn=None,
                 test_dataset=None, eval_every: int | None = None, tasks: recovery.Tasks | None = None,
                 checkpoints: CheckpointCoordinator | None = None, payload: bytes = b"", metrics_port: int = 0,
                 metrics_host: str = "127.0.0.1", metrics_ports: tuple[int, int] | None = None):
        self.spec = spec
        self.plan = plan
        self.store = store
        self.name = store.run(plan.run_id)["name"]
        self.logs: list[str] = []
        self.results: list[dict] | None = None
        self.ps_stats: list[dict] | None = None
        self.error: str | None = None  # why the run failed: each failed worker's whole traceback
        self.error_line: str | None = None  # the same in one line, with the last frame of each traceback
        self._model_fn = model_fn
        self._loss_fn = loss_fn
        self._step_fn = step_fn
        self._collate_fn = collate_fn
        self._state_dict: dict[str, torch.Tensor] | None = None
        self._pending_logs: queue.Queue = queue.Queue()
        self.worker_results = []  # one per worker of the spec, by index
        self.retired_results = []  # of workers removed by scaling
        self.membership = threading.Lock()  # held while workers are replaced, added or removed
        self.closed = False  # set (under membership) once the run ends: no member changes after that
        self._stop_requested = False
        self._test_dataset = test_dataset
        self.eval_every = eval_every or max(1, plan.steps // 10)
        self._latest_step = 0
        self._rates, self._rates_row = speed.RunRates(), 0  # from the store's metric rows up to that row
        self._rates_lock = threading.Lock()
        self._done = threading.Event()
        self.started = time.time()
        self.finished: float | None = None
        self._workers_done: dict[str, tuple[float, dict]] = {}  # task: (when, summary) of its "done" event
        self.tasks = tasks
        self.payload = payload  # the shipped (model_fn, dataset, loss_fn), for replacement workers
        self.checkpoints = checkpoints or CheckpointCoordinator(store)
        # the tasks' metrics arrive on metrics_host only: on metrics_port, or a free port (of metrics_ports)
        self.collector = (Collector(self._on_batch, spec.key, host=metrics_host, port=metrics_port)
                          if metrics_port or not metrics_ports else
                          bind_in_range(lambda p: Collector(self._on_batch, spec.key, host=metrics_host, port=p),
                                        metrics_ports))

    @classmethod
    def adopt(cls, spec: ClusterSpec, plan: TrainPlan, store: RunStore, worker_results, *, tasks: recovery.Tasks,
              payload: bytes) -> "Run":
        """Follow a run that another process started (on a detached cluster) and trains still: its metrics are
        received again at the address its tasks send to, and it is finalized here. Its model and loss
        functions stay on the engines (``state_dict()`` works, ``model()`` does not)."""
        host, port = plan.metrics_address[len("tcp://"):].rsplit(":", 1) if plan.metrics_address else ("127.0.0.1", 0)
        run = cls(spec, plan, None, None, store, tasks=tasks, payload=payload, metrics_port=int(port),
                  metrics_host=host)
        run.started = store.run(plan.run_id)["started"]
        run.note("adopted", "controller", {"pid": os.getpid()})
        run._attach(worker_results, adopted=True)
        return run

    @property
    def id(self) -> int:
        """The run's id in the run store (also its id on the data plane)."""
        return self.plan.run_id

    def _on_batch(self, events: list[dict]) -> None:
        self.store.add_batch(self.id, events)
        for event in events:
            if event.get("kind") == "step":
                self._latest_step = max(self._latest_step, event.get("global_step", 0))
            elif event.get("kind") == "done":
                summary = {k: v for k, v in event.items() if k not in ("kind", "task", "time")}
                self._workers_done[event.get("task")] = (time.monotonic(), summary)
            elif event.get("kind") == "log":
                line = f"[{event['task']}] {event['line']}"
                self.logs.append(line)
                self._pending_logs.put(line)

    def _attach(self, async_results, *, adopted: bool = False) -> None:
        self.worker_results = list(async_results)
        if not adopted:
            self.store.set_status(self.id, "training")
            self.store.add_event(self.id, "controller", "start", {"workers": len(self.worker_results)})
        threading.Thread(target=self._monitor, name=f"pscluster-{self.name}", daemon=True).start()

    def _monitor(self) -> None:
        next_eval, next_check = self.eval_every, 0.0
        try:
            while True:
                failed, ended = self._any_failed(), all(map(self._worker_ended, range(len(self.worker_results))))
                if self.tasks is not None and (failed or (not ended and time.monotonic() >= next_check)):
                    # a failure may be a lost engine (seen by ipyparallel, or by workers of a lost ps)
                    # a moment before its process is seen gone: give that a second
                    if wait_until(self._recover, self.tasks.loss_grace_s if failed else 0):
                        continue
                    next_check = time.monotonic() + recovery.HEALTH_S
                if ended:
                    with self.membership:  # a worker added meanwhile keeps the run going
                        self.closed = all(map(self._worker_ended, range(len(self.worker_results))))
                    if self.closed:
                        break
                    continue
                if failed:
                    self._signal_stop()  # other workers must not wait on the failed one
                self.commit_checkpoints()
                if self.checkpoints.due() and self.plan.checkpoint_dir:
                    self._request_checkpoint()
                if self._test_dataset is not None and self._latest_step >= next_eval:
                    self._evaluate_live()
                    next_eval = self._latest_step + self.eval_every
                time.sleep(0.05)
            self._finish()
        except Exception as e:  # finalizing failed (ps gone...): the run still ends, with the reason
            self.error_line = self.error_line or f"{self.name} could not be finalized: {_one_line(e)}"
            self.error = self.error or self.error_line
            self.finished = self.finished or time.time()
            self.store.set_status(self.id, "failed")
        finally:
            self._done.set()

    def _worker_ended(self, i: int) -> bool:
        """Whether worker ``i`` is over: its ipyparallel result is in, or its "done" event came ``RESULT_GRACE_S``
        ago without it (a controller or client that hostile traffic broke never delivers it)."""
        if self.worker_results[i].ready():
            return True
        done = self._workers_done.get(f"worker:{i}")
        return done is not None and time.monotonic() - done[0] > RESULT_GRACE_S

    def _reported_summary(self, i: int) -> dict:
        """Worker ``i``'s summary as its "done" event reported it (JSON: staleness by string keys)."""
        summary = dict(self._workers_done[f"worker:{i}"][1], task=i)
        summary["staleness"] = {int(k): n for k, n in (summary.get("staleness") or {}).items()}
        return summary

    def _any_failed(self) -> bool:
        return any(ar.ready() and not ar.successful() for ar in self.worker_results)

    def _recover(self) -> bool:
        if self._stop_requested:
            return False
        with self.membership:
            recovered = recovery.recover(self, self.tasks)
        if recovered:
            self.tasks.record()  # the registry names the new workers' tasks, for a later attach
        return recovered

    def _request_checkpoint(self) -> int | None:
        try:
            return self.checkpoints.request(self.spec, self.plan)
        except Exception as e:  # the next one is due in checkpoint_secs; say why this one is missing
            self.note("checkpoint_failed", "controller", {"error": _one_line(e)})
            return None

    def _latest_checkpoint_path(self):
        step = self.latest_checkpoint_step()
        if step is None:
            raise TrainingError(f"{self.name} has no checkpoint yet: run.checkpoint() writes one")
        return checkpoint.manifest_path(self.plan.checkpoint_dir, step)

    def export(self, path):
        """Write the parameters of the run's latest checkpoint as a plain ``state_dict`` file, which
        ``torch.load`` reads without pscluster; returns its path."""
        return checkpoint.export_state_dict(checkpoint.Checkpoint.load(self._latest_checkpoint_path()), path)

    # --- used by recovery ------------------------------------------------------------------
    def note(self, kind: str, task: str, detail: dict | None = None) -> None:
        """Record an event of this run (lost, replaced, restarting...) and show it with the logs."""
        self.store.add_event(self.id, task, kind, detail)
        line = f"[{task}] {kind.replace('_', ' ')}" + "".join(f", {k} {v}" for k, v in (detail or {}).items())
        self.logs.append(line)
        self._pending_logs.put(line)

    def commit_checkpoints(self) -> list:
        return self.checkpoints.commit(self.plan, len(self.spec.ps))

    def latest_checkpoint_step(self) -> int | None:
        return self.checkpoints.latest_step(self.plan)

    def restart(self, async_results) -> None:
        """Follow the workers of a new attempt instead of those of the last one."""
        self.worker_results = list(async_results)
        self._workers_done.clear()

    def _evaluate_live(self) -> None:
        try:
            step, state = self._pull_parameters(timeout=10.0)
        except Exception:  # the run just ended or a ps is busy: the next evaluation will do
            return
        self._record_evaluation(step, state)

    def _record_evaluation(self, step: int, state: dict) -> None:
        model = build_model(self._model_fn, self.plan.seed)
        model.load_state_dict(state)
        result = evaluate(model, self._test_dataset, self._loss_fn, step_fn=self._step_fn,
                          collate_fn=self._collate_fn)
        self.store.add_evaluation(self.id, step, result["loss"], result["accuracy"])

    # --- state --------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def global_step(self) -> int:
        """The global step: final once done (from ps 0), else the latest one a worker reported."""
        if self.ps_stats is not None:
            return self.ps_stats[0].get("step", 0)
        return self._latest_step

    @property
    def local_steps(self) -> list[int] | None:
        return None if self.results is None else [r["local_steps"] for r in self.results]

    @property
    def wall_s(self) -> float:
        return (self.finished or time.time()) - self.started

    # --- control -------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, *, verbose: bool = True, progress: bool = False) -> "Run":
        """Block until training ends, printing each worker's progress lines as they arrive;
        ``progress=True`` adds a progress bar of the global step."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = None
        if progress:
            bar = StepProgress(self.plan.steps, self.name)
        try:
            while not self._done.wait(0.1):
                self._print_pending(verbose, bar)
                if bar is not None:
                    bar.update(self._latest_step, self.rates().run(live=True))
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeTimeout(f"{self.name} still training after {timeout:.0f}s: "
                                         "call run.wait() again, or run.stop() to end it")
            if bar is not None:
                bar.update(self.global_step, self.rates().run(live=False), force=True)
        finally:
            self._print_pending(verbose, bar)
            if bar is not None:
                bar.close()
        if self.error:
            raise TrainingError(self.error_line)
        return self

    def stop(self, timeout: float = 30.0) -> "Run":
        """End training cleanly at the next global step (every ps on the same step, which the final checkpoint
        holds) and wait for it; stops at once if that takes longer than ``timeout`` s."""
        if not self.done:
            self._stop_requested = True
            try:  # every ps parks where it is, then the ones behind catch up with the pushes in flight
                with PSClient(self.spec, run_id=self.id, timeout=10.0) as client:
                    client.stop(client.park())
            except Exception:  # a ps is gone: the wait below ends the others
                pass
            try:
                self.wait(timeout=timeout, verbose=False)
            except RuntimeTimeout:
                self._signal_stop()
                self.wait(timeout=self.plan.request_timeout, verbose=False)
        return self

    def _signal_stop(self) -> None:
        try:
            with PSClient(self.spec, run_id=self.id, timeout=10.0) as client:
                client.stop()
        except Exception:  # the ps tasks may be gone already; wait() reports the real error
            pass

    def checkpoint(self, timeout: float = 60.0):
        """Write a checkpoint now (at the next global step; the last one once the run is over) and
        return its manifest's path."""
        if self.done:
            self.commit_checkpoints()
            return self._latest_checkpoint_path()
        step = self.checkpoints.request(self.spec, self.plan)
        return self.checkpoints.wait_for(self.plan, step, timeout, lambda: self.done)

    def _print_pending(self, verbose: bool, bar=None) -> None:
        while True:
            try:
                line = self._pending_logs.get_nowait()
            except queue.Empty:
                return
            if verbose and bar is not None:
                bar.write(line)
            elif verbose:
                print(line, file=sys.stdout, flush=True)

    def _read_ps_stats(self, timeout: float) -> list[dict] | None:
        try:
            with PSClient(self.spec, run_id=self.id, timeout=timeout) as client:
                return client.stats()
        except Exception:
            return None

    def _finish(self) -> None:
        errors, tracebacks, results = [], [], []
        for i, ar in enumerate(self.worker_results):
            try:
                results.append(ar.get(0) if ar.ready() else self._reported_summary(i))
            except Exception as e:  # a RemoteError: its one-line form, and the whole remote traceback
                errors.append(f"worker {i} failed: {_one_line(e)}{_last_frame(e)}")
                tracebacks.append(f"worker {i}:\n{_traceback(e)}")
        results += [r.get(0) for r in self.retired_results if r.ready() and r.successful()]
        if errors:  # before ``finished``: ``status`` never reads "finished" on its way to "failed"
            self.error_line = "; ".join(errors) + ": fix the cause and train again"
            self.error = "\n".join(tracebacks)
        self.finished = time.time()
        self.commit_checkpoints()  # the final one
        # a worker's last metrics batch may still be in flight when its result arrives
        wait_until(lambda: len(self._workers_done) >= len(results), timeout=2.0)
        self.collector.close()
        self.ps_stats = self._read_ps_stats(timeout=10.0)
        if not errors:
            self.results = results
            step, self._state_dict = self._pull_parameters()
            if self._test_dataset is not None:
                self._record_evaluation(step, self._state_dict)
        else:
            self._state_dict = self._last_state()
        self.store.set_status(self.id, self.status, self.summary())
        self.store.add_event(self.id, "controller", "end", {"status": self.status, "error": self.error_line,
                                                             "traceback": self.error})

    def _last_state(self) -> dict[str, torch.Tensor] | None:
        """What a failed run trained: the ps tasks' state (which a failing step never reached), else the latest
        checkpoint's, else None."""
        try:
            return self._pull_parameters(timeout=10.0)[1]
        except Exception:  # a ps is gone
            pass
        try:
            return checkpoint.Checkpoint.load(self._latest_checkpoint_path()).state_dict()
        except Exception:  # no checkpoint either
            return None

    def _pull_parameters(self, timeout: float = 30.0) -> tuple[int, dict[str, torch.Tensor]]:
        """The global step and the parameters the ps tasks hold now, by parameter name (shards of a
        partitioned parameter put back together)."""
        with PSClient(self.spec, run_id=self.id, timeout=timeout) as client:
            reply = client.pull_all()
        if reply is None:
            raise TrainingError("the ps tasks no longer hold this run's variables: train again")
        return reply.step, state_dict_of(self.plan.state_keys, assemble(self.plan.variables, reply.messages))

    # --- results ------------------------------------------------------------------------
    def state_dict(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """The trained model's ``state_dict()`` (once the run is over: waits for it, ``timeout`` seconds at most,
        see ``wait``): parameters, buffers, every key of a tied parameter; ``model.load_state_dict(run.state_dict())``
        takes it as it is (strict). A failed run gives its last parameters (from the ps tasks, or its latest
        checkpoint)."""
        if self._state_dict is None and not self.error:
            self.wait(timeout)
        if self._state_dict is None:
            raise TrainingError(f"{self.name} failed and neither its ps tasks nor a checkpoint hold its parameters: "
                                f"{self.error_line}")
        return dict(self._state_dict)

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

        show(self.store.path, self.id)

    def metrics(self) -> pd.DataFrame:
        """Per-step worker metrics from the run store: one row per reported step per worker
        (worker, time, local_step, global_step, loss, accuracy, compute_s, wait_s, comm_s, bytes, staleness)."""
        return self.store.metrics(self.id)

    def events(self) -> pd.DataFrame:
        """The run's events from the run store (time, task, kind, detail): start, lost, replaced,
        restarting, restored, checkpoint, end..."""
        return self.store.events(self.id)

    def staleness(self) -> dict[int, int]:
        """Histogram of push staleness, counted by ps 0 (async runs)."""
        stats = self.ps_stats or self._read_ps_stats(5.0) or [{}]
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
                "staleness": self.staleness() if self.mode == "async" else None,
                "samples_per_sec": samples / self.wall_s if self.done and self.wall_s > 0 else None,
                "steps_per_s": _number(rates.run(live=live)),
                "worker_steps_per_s": {w: _number(r) for w, r in rates.workers(live=live).items()},
                **speed.phases(self.started, self.finished, rates.span(), time.time()), "status": self.status}

    @property
    def status(self) -> str:
        if self.finished is None:
            return "training"
        if self.error:
            return "failed"
        return "stopped" if self._stop_requested else "finished"

    def __repr__(self) -> str:
        return (f"<Run {self.name} {self.mode} {self.status}: global step {self.summary()['global_step']}"
                f"/{self.plan.steps}, local steps {self.local_steps}>")

    def _repr_html_(self) -> str:
        s = self.summary()
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                       f"<td style='text-align:left'>{html.escape(_fmt(v))}</td></tr>"
                       for k, v in s.items() if k != "staleness" or v)
        return f"<table>{rows}</table>"


def _number(v: float) -> float | None:
    """``v``, or None for NaN (a summary is JSON)."""
    return None if math.isnan(v) else v


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _traceback(e: BaseException) -> str:
    """The whole traceback of a worker's exception (ipyparallel's RemoteError carries the remote one), without
    terminal colours."""
    text = getattr(e, "traceback", None) or "".join(traceback.format_exception(e))
    return re.sub(r"\x1b\[[0-9;]*m", "", str(text))


def _last_frame(e: BaseException) -> str:
    """`` (at file.py:12 in forward)``: where the innermost frame of the traceback of ``e`` was, or ''."""
    # Python's 'File "x.py", line 12, in f' or IPython's (ipyparallel's) 'File /x.py:12, in f(args)'
    frames = re.findall(r'File "([^"]+)", line (\d+), in ([^\s(]+)|File ([^\s,]+):(\d+), in ([^\s(]+)', _traceback(e))
    if not frames:
        return ""
    file, line, function = [a or b for a, b in zip(frames[-1][:3], frames[-1][3:])]
    return f" (at {os.path.basename(file)}:{line} in {function})"


def _one_line(e: BaseException) -> str:
    ename = getattr(e, "ename", type(e).__name__)
    evalue = getattr(e, "evalue", str(e))
    return f"{ename}: {str(evalue).strip().splitlines()[-1] if str(evalue).strip() else ''}"


