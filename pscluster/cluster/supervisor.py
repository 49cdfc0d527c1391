"""The supervisor: the one owner of a run while it trains.

It alone changes the run's spec, plan (its attempt included), workers and outcome, and records its events;
``Run`` is the user's read-only view of it. Everything that changes a run is a request to it: recovery (its
own monitor finds what was lost), scaling (``resize``), ``stop``, ``checkpoint`` and the side panel's actions
(which call ``Run.stop`` or ``Cluster.stop``). Changes of membership happen under ``membership``, so a
recovery and a scale see the spec before or after each other, never between. It reaches tasks through
``recovery.Tasks`` (the cluster: new engines, workers started on them, kills), never through a pid.

A monitor thread follows the workers, evaluates the parameters every ``eval_every`` global steps, commits the
checkpoints the ps tasks write and asks for more when they are due, replaces lost tasks (``recovery``), and
finalizes the run when the workers end: their summaries, the ps statistics, the final parameters. The workers'
losses go through the divergence rule (``metrics.divergence``) as they arrive; what it finds is recorded, and
stops or fails the run as ``plan.on_divergence`` says.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import re
import sqlite3
import threading
import time
import traceback
from dataclasses import asdict, replace
from typing import Callable

import torch

from ..errors import TrainingError
from ..metrics.collector import Collector
from ..metrics.divergence import Diverging, DivergenceWatch
from ..metrics.store import RunStore
from ..metrics.tensorboard import EventWriter, run_logdir
from ..runtime import checkpoint
from ..runtime.client import PSClient
from ..runtime.network import bind_in_range
from ..runtime.plan import TrainPlan, assemble, state_dict_of
from ..runtime.waiting import wait_until
from ..spec import ClusterSpec, TaskSpec
from . import recovery, run_summary, scaling
from .checkpoint_commits import CheckpointCoordinator
from .lease import Lease
from .worker_output import WorkerOutput

log = logging.getLogger("pscluster.supervisor")
# SQLite's primary result codes of a store that cannot take a write: SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL,
# SQLITE_CANTOPEN (a removed directory)
UNWRITABLE = frozenset({8, 10, 13, 14})

STORE_CHECK_S = 1.0  # how often the monitor checks that the run store's file is still where it was opened
RESULT_GRACE_S = 2.0  # how long a worker's ipyparallel result may trail its "done" event before the event stands in

Evaluator = Callable[[dict], dict]  # a state dict -> {"loss": ..., "accuracy": ...}


class Supervisor:
    """Owns run ``plan.run_id`` of ``store`` on the tasks of ``spec`` (see the module docstring).

    ``tasks``: the cluster (``recovery.Tasks``); None: nothing is replaced, a lost task fails the run.
    ``payload``: the shipped (model_fn, dataset, loss_fn), for the workers it starts. ``evaluator`` scores
    the parameters every ``eval_every`` global steps and at the end (into the run store); the store keeps the
    run's summary (``run_summary``) with its final status. The tasks' metrics
    arrive on ``metrics_host`` only: on ``metrics_port``, or a free port of ``metrics_ports``.
    """

    def __init__(self, spec: ClusterSpec, plan: TrainPlan, store: RunStore, *, tasks: recovery.Tasks | None = None,
                 checkpoints: CheckpointCoordinator | None = None, payload: bytes = b"",
                 evaluator: Evaluator | None = None, eval_every: int | None = None, metrics_port: int = 0,
                 metrics_host: str = "127.0.0.1", metrics_ports: tuple[int, int] | None = None):
        self.spec = spec
        self.plan = plan
        self.store = store
        self.name = store.run(plan.run_id)["name"]
        self.lease = Lease(store, plan.run_id, self)
        self.tasks = tasks
        self.payload = payload
        self.checkpoints = checkpoints or CheckpointCoordinator(store)
        self.evaluator = evaluator
        self.eval_every = eval_every or max(1, (plan.steps or 0) // 10)  # an evaluator comes with a step target
        self.evaluated: set[int] = set()  # the global steps evaluated
        if evaluator is not None and plan.checkpoint_dir:  # every ps writes a shard at each step to evaluate
            plan = replace(plan, eval_every=self.eval_every)
        self.membership = threading.Lock()  # held while workers are replaced, added or removed
        self.closed = False  # set (under membership) once the run ends: no member changes after that
        self.worker_results = []  # one per worker of the spec, by index
        self.retired_results = []  # of workers removed by scaling
        self.stop_requested = False
        self.started = store.run(plan.run_id)["started"]  # the run's one clock: the store's start, and end (_finish)
        self.logs: list[str] = []
        self.pending_logs: queue.Queue = queue.Queue()  # lines not yet printed by Run.wait
        self.output = WorkerOutput(self._log)  # what the workers print, among the logs
        self.latest_step = 0  # the latest global step a worker reported
        self.rates = run_summary.StoreRates(store, plan.run_id)  # steps/s from the rows the store holds
        self.divergence = DivergenceWatch()  # the workers' losses, in the order they arrive
        self.divergence.found = store.divergence(plan.run_id)  # an adopted run's, found by its first supervisor
        # the outcome, set once by _finish
        self.results: list[dict] | None = None
        self.ps_stats: list[dict] | None = None
        self.error: str | None = None  # why the run failed: each failed worker's whole traceback
        self.error_line: str | None = None  # the same in one line, with the last frame of each traceback
        self.failure: dict | None = None  # the same as the run store keeps it (``RunStore.set_status``)
        self.finished: float | None = None
        self.state_dict: dict[str, torch.Tensor] | None = None
        self.ended = threading.Event()
        self._workers_done: dict[str, tuple[float, dict]] = {}  # task: (when, summary) of its "done" event
        self._workers_left: dict[str, tuple] = {}  # task: (attempt, error, global step) of its "left" event
        self._steps_left: dict[tuple[str, int], int] = {}  # (task, attempt): the local steps it left that attempt with
        self.event_files = EventWriter(run_logdir(store.path, self.name, plan.run_id))
        self._tensorboard_failure_said = False
        self.collector = (Collector(self._on_batch, spec.key, host=metrics_host, port=metrics_port, run_id=plan.run_id,
                                    on_failure=self._collector_failed)
                          if metrics_port or not metrics_ports else
                          bind_in_range(lambda p: Collector(self._on_batch, spec.key, host=metrics_host, port=p,
                                                            run_id=plan.run_id, on_failure=self._collector_failed),
                                        metrics_ports))
        self.plan = replace(plan, metrics_address=self.collector.address)

    @property
    def id(self) -> int:
        return self.plan.run_id

    @property
    def status(self) -> str:
        if self.finished is None:
            return "training"
        if self.failure is not None:
            return "failed"
        return "stopped" if self.stop_requested else "finished"

    # --- the workers' metrics --------------------------------------------------------------
    def _on_batch(self, events: list[dict]) -> None:
        """The collector's callback: a batch of the workers' events recorded (the store and the event files skip
        a malformed event, and so does this; a store that cannot be written fails the run)."""
        try:
            self.store.add_batch(self.id, events)
        except sqlite3.Error as e:
            if getattr(e, "sqlite_errorcode", None) is None or e.sqlite_errorcode & 0xFF not in UNWRITABLE:
                raise  # not the store's fault: the collector counts the batch as unrecorded
            self._store_failed(e)
            return
        self.event_files.add_events(events)
        if self.event_files.failure is not None and not self._tensorboard_failure_said:
            self._tensorboard_failure_said = True  # the run trains on: said in its events and logs, once
            self.say("tensorboard_failed", f"TensorBoard files under {self.event_files.logdir} could not be written: "
                     f"{self.event_files.failure}; the run trains on without them",
                     {"folder": str(self.event_files.logdir), "error": self.event_files.failure})
        for event in events:
            kind, task = event.get("kind"), event.get("task")
            if not isinstance(task, str):
                continue
            if kind == "step" and isinstance(step := event.get("global_step"), int):
                self.latest_step = max(self.latest_step, step)
                if isinstance(loss := event.get("loss"), float) and (found := self.divergence.add(step, loss)):
                    self._diverged(found)
            elif kind == "done" and event.get("attempt", self.plan.attempt) == self.plan.attempt:
                summary = {k: v for k, v in event.items() if k not in ("kind", "task", "time", "attempt")}
                self._workers_done[task] = (time.monotonic(), summary)
            elif kind == "left":
                self._workers_left[task] = (event.get("attempt"), str(event.get("error")), event.get("global_step"))
                attempt, steps = event.get("attempt"), event.get("local_steps")
                if isinstance(attempt, int) and isinstance(steps, int):
                    self._steps_left[(task, attempt)] = steps
            elif kind == "log" and isinstance(line := event.get("line"), str):
                self._log(f"[{task}] {line}")
            elif kind == "checkpoint_failed" and isinstance(event.get("errno"), int) and self.failure is None:
                # the disk, not the run: end it now, while its committed checkpoints restore
                self._disk_failed(str(event.get("error")), _disk_fix(event["errno"]), task, "")

    def _diverged(self, found: Diverging) -> None:
        """The loss diverges (``found``): recorded, said, and per ``plan.on_divergence`` the run goes on (flag),
        is stopped by the monitor (stop), or fails (fail; the monitor stops its workers)."""
        self.say("diverging", found.line(), asdict(found))
        if self.plan.on_divergence == "fail" and self.failure is None:
            self._failed(f"{self.name} failed: {found.line()}: lower the learning rate (or clip with "
                         "max_grad_norm=...) and train again; on_divergence='flag' trains on", "controller", "")

    def _store_failed(self, e: sqlite3.Error) -> None:
        """The run store cannot be written (a full disk, a file turned read-only or removed): the run fails with
        that cause, once; its workers are told to stop by the monitor, rather than train unrecorded."""
        self._disk_failed(f"its run store {self.store.path} cannot be written ({e}, {e.sqlite_errorname})",
                          "free space there (or set PSCLUSTER_HOME to another disk)", "controller", _traceback(e))

    def _disk_failed(self, what: str, fix: str, task: str, traceback_text: str) -> None:
        """The run failed for a file it could not write (``what``), unless a cause came first: ``fix`` says what
        to do, and the run resumes from its latest checkpoint (which the fault left as it was)."""
        if self.failure is None:
            self._failed(f"{self.name} failed: {what}: {fix} and train again; it resumes from its latest checkpoint",
                         task, traceback_text)

    def _check_store(self) -> None:
        """A run store removed mid-run (its home directory deleted, the file replaced) fails the run: SQLite would
        go on recording it into a file nobody can read."""
        if (gone := self.store.gone()) is not None:
            self._disk_failed(f"its run store {self.store.path} was {gone} while it trained",
                              "put the store back or set PSCLUSTER_HOME,", "controller", "")

    def _collector_failed(self, e: Exception) -> None:
        """The collector's thread ended on ``e``: the workers' metrics, their "done" and their logs no longer
        arrive, so the run fails with it as the cause (its monitor stops the workers)."""
        if self.failure is None:
            self._failed(f"{self.name} lost its metrics collector: {one_line(e)}", "controller", _traceback(e))

    def _log(self, line: str) -> None:
        self.logs.append(line)
        self.pending_logs.put(line)

    def note(self, kind: str, task: str, detail: dict | None = None) -> None:
        """Record an event of this run (lost, replaced, restarting...) and show it with the logs."""
        self.store.add_event(self.id, task, kind, detail)
        self._log(f"[{task}] {kind.replace('_', ' ')}" + "".join(f", {k} {v}" for k, v in (detail or {}).items()))

    def say(self, kind: str, line: str, detail: dict) -> None:
        """Record the controller's event ``kind`` of this run with ``detail``, and show it with the logs as
        ``line`` (what a sentence says better than ``note``'s list: where the run starts from...)."""
        self.store.add_event(self.id, "controller", kind, detail)
        self._log(f"[controller] {line}")

    # --- the workers -----------------------------------------------------------------------
    def start(self, launch: Callable[["Supervisor"], list], *, adopted: bool = False) -> None:
        """Follow the workers ``launch(self)`` starts (one per worker of the spec, by index; ``adopted``: they
        train already, started by another process) until the run ends."""
        self.worker_results = list(launch(self))
        if not adopted:
            self.store.set_status(self.id, "training")
            self.store.add_event(self.id, "controller", "start", {"workers": len(self.worker_results)})
        threading.Thread(target=self._monitor, name=f"pscluster-{self.name}", daemon=True).start()

    def resize(self, new_spec: Callable[[], ClusterSpec], then: Callable[[ClusterSpec], None]) -> None:
        """Under the membership: take the workers of ``spec = new_spec()`` (more: the new ones, on new engines,
        join; fewer: the highest-numbered end), then ``then(spec)``. A run that has ended keeps its workers
        (``then`` still runs)."""
        with self.membership:
            spec = new_spec()
            if not self.closed and len(spec.workers) > len(self.spec.workers):
                scaling.grow(self, spec)
            elif not self.closed and len(spec.workers) < len(self.spec.workers):
                scaling.shrink(self, spec)
            then(spec)

    # --- membership: the changes recovery and scaling decide, made here under ``membership`` ---------
    def replace_task(self, task: TaskSpec) -> None:
        """``task`` (lost) on a new engine of the cluster, recorded."""
        self.spec = self.tasks.replace_task(task.role, task.index)
        new = self.spec.task(task.role, task.index)
        self.note("replaced", f"{task.role}:{task.index}", {"pid": new.pid, "engine": new.engine_id, "host": new.host})

    def launch_worker(self, index: int, *, join: bool) -> None:
        """Start worker ``index`` of the spec (``join``: into the attempt under way) and follow it."""
        result = self.tasks.launch_worker(self.spec, index, self, join=join)
        if index < len(self.worker_results):
            self.worker_results[index] = result
        else:
            self.worker_results.append(result)

    def restart(self) -> None:
        """A new attempt that restores the newest state there is, its workers started and followed instead of
        those of the last one."""
        self.plan = self.plan.replace(attempt=self.plan.attempt + 1, restore=True)
        self._workers_done.clear()
        self.worker_results = [self.tasks.launch_worker(self.spec, i, self) for i in range(len(self.spec.workers))]

    def take_workers(self, spec: ClusterSpec, replicas_to_aggregate: int) -> None:
        """``spec``, with another number of workers than the run's, as the run's (every ps told already)."""
        n = len(spec.workers)
        self.plan = self.plan.replace(num_workers=n, replicas_to_aggregate=replicas_to_aggregate)
        self.spec = spec
        self.store.set_spec(self.id, spec.public_dict())
        self.note("scaled", "controller", {"workers": n, "replicas_to_aggregate": replicas_to_aggregate})

    def retire_workers(self, count: int) -> None:
        """Keep the results of the workers past the first ``count`` apart (removed: they no longer end the run)."""
        self.retired_results += self.worker_results[count:]
        del self.worker_results[count:]

    def _monitor(self) -> None:
        """The monitor thread. Whatever it raises ends the run ``failed`` with that exception as the cause (the
        workers told to stop), and every ``wait()`` wakes: no failure of the supervisor itself is silent."""
        try:
            self._follow()
            self.output.relay(self.worker_results, final=True)
            self._finish()
        except Exception as e:
            self._end_failed(e)
        finally:
            self._release()

    def _follow(self) -> None:
        """Until every worker has ended: recovery, checkpoints, evaluations."""
        next_eval, next_check, next_store_check = self.eval_every, 0.0, 0.0
        while True:
            failed, ended = self._any_failed(), all(map(self._worker_ended, range(len(self.worker_results))))
            if self.tasks is not None and (failed or (not ended and time.monotonic() >= next_check)):
                # a failure may be a lost engine (seen by ipyparallel, or by workers of a lost ps)
                # a moment before its process is seen gone: give that a second
                if wait_until(self._recover, self.tasks.loss_grace_s if failed else 0):
                    continue
                next_check = time.monotonic() + recovery.HEALTH_S
            self.output.relay(self.worker_results)
            if ended:
                with self.membership:  # a worker added meanwhile keeps the run going
                    self.closed = all(map(self._worker_ended, range(len(self.worker_results))))
                if self.closed:
                    return
                continue
            if self.failure is None and time.monotonic() >= next_store_check:
                self._check_store()
                next_store_check = time.monotonic() + STORE_CHECK_S
            if failed or self.failure is not None:
                self.signal_stop()  # other workers must not wait on the failed one, nor train unrecorded
            elif self.divergence.found and self.plan.on_divergence == "stop" and not self.stop_requested:
                self.stop(reason=self.divergence.found.words())
            self.commit_checkpoints()
            if self.checkpoints.due() and self.plan.checkpoint_dir:
                self._request_checkpoint()
            if self.evaluator is not None and not self.plan.eval_every and self.latest_step >= next_eval:
                # no checkpoints to evaluate: the parameters near the step
                self._evaluate_live()
                next_eval = self.latest_step + self.eval_every
            time.sleep(0.05)

    def _end_failed(self, e: Exception) -> None:
        """The supervisor itself failed (finalizing with a ps gone, a store that cannot be written, a bug): the run
        ends ``failed`` with ``e`` as the cause, unless a cause came first; its workers are told to stop."""
        if isinstance(e, OSError):  # the disk (full, read-only, gone), not the run
            self._disk_failed(one_line(e), _disk_fix(e.errno), "controller", _traceback(e))
        elif self.failure is None:
            what = "could not be finalized" if self.closed else "lost its supervisor"
            self._failed(f"{self.name} {what}: {one_line(e)}", "controller", _traceback(e))
        self.finished = self.finished or time.time()
        if not self.closed:
            self.signal_stop()
        try:
            self.store.set_status(self.id, "failed", failure=self.failure, ended=self.finished)
        except Exception as store_error:  # the store is what failed (a full disk): the Run still says why
            log.warning("%s: its end could not be recorded in %s: %s", self.name, self.store.path,
                        one_line(store_error))

    def _release(self) -> None:
        """What the run holds, let go of one by one (each may fail on a full disk), then every ``wait()`` woken."""
        try:
            for release in (self.lease.release, self.event_files.close, self.collector.close):
                try:
                    release()
                except Exception as e:
                    log.warning("%s: %s", self.name, one_line(e))
        finally:
            self.ended.set()

    def _worker_ended(self, i: int) -> bool:
        """Whether worker ``i`` is over: its ipyparallel result is in, or its "done" event came ``RESULT_GRACE_S``
        ago without it (a controller or client that hostile traffic broke never delivers it)."""
        if self.worker_results[i].ready():
            return True
        done = self._workers_done.get(f"worker:{i}")
        return done is not None and time.monotonic() - done[0] > RESULT_GRACE_S

    def earlier_local_steps(self, i: int) -> int:
        """The local steps worker ``i`` took in the attempts before the current one (from its "left" events: a
        worker killed outright says nothing, and its replacement counts from 0)."""
        return sum(n for (task, attempt), n in self._steps_left.items()
                   if task == f"worker:{i}" and attempt < self.plan.attempt)

    def reported(self, i: int) -> bool:
        """Whether worker ``i`` has sent its "done" event (its summary) in the current attempt."""
        return f"worker:{i}" in self._workers_done

    def left(self, i: int) -> str | None:
        """Why worker ``i`` failed out of the current attempt (its "left" event), or None."""
        attempt, error, _ = self._workers_left.get(f"worker:{i}", (None, None, None))
        return error if attempt == self.plan.attempt else None

    def reported_summary(self, i: int) -> dict:
        """Worker ``i``'s summary as its "done" event reported it (JSON: staleness by string keys)."""
        summary = dict(self._workers_done[f"worker:{i}"][1], task=i)
        summary["staleness"] = {int(k): n for k, n in (summary.get("staleness") or {}).items()}
        return summary

    def _any_failed(self) -> bool:
        return any(ar.ready() and not ar.successful() for ar in self.worker_results)

    def _recover(self) -> bool:
        if self.stop_requested:
            return False
        with self.membership:
            recovered = recovery.recover(self, self.tasks)
        if recovered:
            self.tasks.record()  # the registry names the new workers' tasks, for a later attach
        return recovered

    # --- stop --------------------------------------------------------------------------------
    def stop(self, reason: str | None = None) -> None:
        """Ask every ps to end the run at the next global step (each on the same step, which the final checkpoint
        holds); the monitor finalizes it once the workers end. ``reason``, where the run stops itself: recorded and
        said."""
        self.stop_requested = True
        if reason is not None:
            self.say("stopping", f"stopping {self.name}: {reason}", {"reason": reason})
        try:  # every ps parks where it is, then the ones behind catch up with the pushes in flight
            with PSClient(self.spec, run_id=self.id, timeout=10.0) as client:
                client.stop(client.park())
        except Exception:  # a ps is gone: the workers end on their lost connections
            pass

    def signal_stop(self) -> None:
        """End the run at once on every ps that answers (a failed worker must not keep the others waiting)."""
        try:
            with PSClient(self.spec, run_id=self.id, timeout=10.0) as client:
                client.stop()
        except Exception:  # the ps tasks may be gone already; the run's error says why
            pass

    # --- checkpoints -------------------------------------------------------------------------
    def commit_checkpoints(self) -> list:
        """Commit the checkpoints the ps tasks have written; those of a step to evaluate are evaluated before any
        is pruned (``keep_checkpoints``)."""
        committed = self.checkpoints.commit(self.plan, len(self.spec.ps), prune=False)
        if self.evaluator is not None and self.plan.eval_every:
            self._evaluate_checkpoints(committed)
        self.checkpoints.prune(self.plan)
        return committed

    def latest_checkpoint_step(self) -> int | None:
        return self.checkpoints.latest_step(self.plan)

    def latest_checkpoint_path(self):
        step = self.latest_checkpoint_step()
        if step is None:
            raise TrainingError(f"{self.name} has no checkpoint yet: run.checkpoint() writes one")
        return checkpoint.manifest_path(self.plan.checkpoint_dir, step)

    def _request_checkpoint(self) -> int | None:
        try:
            return self.checkpoints.request(self.spec, self.plan)
        except Exception as e:  # the next one is due in checkpoint_secs; say why this one is missing
            self.note("checkpoint_failed", "controller", {"error": one_line(e)})
            return None

    def checkpoint(self, timeout: float):
        """A checkpoint now (at the next global step; the last one once the run is over): its manifest's path."""
        if self.ended.is_set():
            self.commit_checkpoints()
            return self.latest_checkpoint_path()
        began = time.monotonic()
        step = self.checkpoints.request(self.spec, self.plan, start_s=timeout)
        return self.checkpoints.wait_for(self.plan, step, timeout - (time.monotonic() - began), self.ended.is_set)

    # --- parameters and evaluation -----------------------------------------------------------
    def pull_parameters(self, timeout: float = 30.0) -> tuple[int, dict[str, torch.Tensor]]:
        """The global step and the parameters the ps tasks hold now, by parameter name (shards of a
        partitioned parameter put back together)."""
        with PSClient(self.spec, run_id=self.id, timeout=timeout) as client:
            reply = client.pull_all()
        if reply is None:
            raise TrainingError("the ps tasks no longer hold this run's variables: train again")
        return reply.step, state_dict_of(self.plan.state_keys, assemble(self.plan.variables, reply.messages))

    def read_ps_stats(self, timeout: float) -> list[dict] | None:
        try:
            with PSClient(self.spec, run_id=self.id, timeout=timeout) as client:
                return client.stats()
        except Exception:
            return None

    def _evaluate_checkpoints(self, committed) -> None:
        """Evaluate the checkpoints just committed whose step is a multiple of ``eval_every`` (each step once)."""
        for path in committed:
            ckpt = checkpoint.Checkpoint.load(path)
            if ckpt.step % self.eval_every == 0 and ckpt.step not in self.evaluated:
                self._record_evaluation(ckpt.step, ckpt.state_dict())

    def _evaluate_live(self) -> None:
        try:
            step, state = self.pull_parameters(timeout=10.0)
        except Exception:  # the run just ended or a ps is busy: the next evaluation will do
            return
        self._record_evaluation(step, state)

    def _record_evaluation(self, step: int, state: dict) -> None:
        self.evaluated.add(step)
        result = self.evaluator(state)
        self.store.add_evaluation(self.id, step, result["loss"], result["accuracy"])
        self.event_files.add_evaluation(step, result["loss"], result["accuracy"])

    # --- the end -----------------------------------------------------------------------------
    def _failed(self, cause: str, task: str, traceback_text: str) -> None:
        """The run failed: ``cause`` in one line, first seen on ``task``, with the whole ``traceback_text``; its
        step, until the task says where it failed, the latest one a worker reported (None before any)."""
        self.error_line, self.error = cause, traceback_text
        self.failure = {"cause": cause, "task": task, "step": self.latest_step or None, "traceback": traceback_text}

    def _finish(self) -> None:
        errors, tracebacks, results, first = [], [], [], None
        for i, ar in enumerate(self.worker_results):
            try:
                results.append(ar.get(0) if ar.ready() else self.reported_summary(i))
            except Exception as e:  # a RemoteError: its one-line form, and the whole remote traceback
                errors.append(f"worker {i} failed: {one_line(e)}{_last_frame(e)}")
                tracebacks.append(f"worker {i}:\n{_traceback(e)}")
                first = f"worker:{i}" if first is None else first
        results += [r.get(0) for r in self.retired_results if r.ready() and r.successful()]
        if errors:  # before ``finished``: ``status`` never reads "finished" on its way to "failed"
            self._failed("; ".join(errors) + ": fix the cause and train again", first, "\n".join(tracebacks))
        self.finished = time.time()
        self.commit_checkpoints()  # the final one
        # a worker's last metrics batch may still be in flight when its result arrives
        wait_until(lambda: len(self._workers_done) >= len(results), timeout=2.0)
        self.collector.close()
        attempt, _, step = self._workers_left.get(first, (None, None, None))
        if errors and attempt == self.plan.attempt and isinstance(step, int):  # where it failed, said on its way out
            self.failure["step"] = step
        self.ps_stats = self.read_ps_stats(timeout=10.0)
        if not errors:
            self.results = results
            step, self.state_dict = self.pull_parameters()
            if self.evaluator is not None and step not in self.evaluated:  # the end, once
                self._record_evaluation(step, self.state_dict)
        else:
            self.state_dict = self._last_state()
        self.store.set_status(self.id, self.status, run_summary.summary(self), failure=self.failure,
                              ended=self.finished)
        self.store.add_event(self.id, "controller", "end", {"status": self.status, "error": self.error_line,
                                                             "traceback": self.error})

    def _last_state(self) -> dict[str, torch.Tensor] | None:
        """What a failed run trained: the ps tasks' state (which a failing step never reached), else the latest
        checkpoint's, else None."""
        try:
            return self.pull_parameters(timeout=10.0)[1]
        except Exception:  # a ps is gone
            pass
        try:
            return checkpoint.Checkpoint.load(self.latest_checkpoint_path()).state_dict()
        except Exception:  # no checkpoint either
            return None


def _disk_fix(number: int | None) -> str:
    """What to do about a file the run could not write, by the error's errno ``number``."""
    if number in (errno.ENOSPC, errno.EDQUOT):
        return "free space there"
    if number in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "make it writable (or give another checkpoint_dir or PSCLUSTER_HOME)"
    if number == errno.ENOENT:
        return "it was removed while the run trained: put it back (or give another checkpoint_dir or PSCLUSTER_HOME)"
    return "fix its file system"


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


def one_line(e: BaseException) -> str:
    ename = getattr(e, "ename", type(e).__name__)
    evalue = getattr(e, "evalue", str(e))
    return f"{ename}: {str(evalue).strip().splitlines()[-1] if str(evalue).strip() else ''}"
