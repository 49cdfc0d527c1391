"""A run's events as TensorBoard event files, beside its run store: ``tensorboard/<run name>-<id>/<task>/``.

One folder per task, so TensorBoard draws the workers (and the ps tasks) of a run as curves of one chart:

- ``worker_<i>``: ``loss``, ``accuracy`` and each of a ``step_fn``'s metrics (``metrics/<name>``) of its steps,
  at most one step per ``POINT_S`` (a chart has no use for more: a fast worker's every step would cost the
  kernel a core) and its last step; its ``steps_per_s`` once a second, and the ``staleness`` of every applied
  gradient as a histogram every ``HISTOGRAM_STEPS`` of its steps; the ``epoch`` of its ``ctx.shard`` loader as each
  one begins; all against the global step.
- ``ps_<i>``: ``lr``, ``updates_per_s``, ``waiting_for`` (workers a sync step waits on), ``bytes_in_per_s`` and
  ``bytes_out_per_s``, as the ps reports them.
- ``eval``: ``loss`` and ``accuracy`` of each evaluation of the test dataset.
- the model's graph, in ``worker_0``, where torch can trace it (``add_graph``).

``tensorboard --logdir <store folder>/tensorboard`` shows every run; ``%pscluster tensorboard`` starts it.
The writer never fails a run: an event it cannot write is counted in ``errors``.
"""

from __future__ import annotations

import math
import re
import threading
import warnings
from collections import defaultdict
from pathlib import Path

HISTOGRAM_STEPS = 100
RATE_S = 1.0  # how often a task's rates are written
POINT_S = 0.05  # the shortest time between two charted steps of a worker


def run_logdir(store_path: str | Path, name: str, run_id: int) -> Path:
    """Where run ``run_id`` (named ``name``) of the run store at ``store_path`` writes its event files:
    ``<name>-<id>``, or ``run-<id>`` for a run of that default name."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return Path(store_path).parent / "tensorboard" / (safe if safe == f"run-{run_id}" else f"{safe}-{run_id}")


class EventWriter:
    """Writes the events of one run (the batches its collector receives, its evaluations) under ``logdir``."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self.errors = 0
        self._writers: dict[str, object] = {}
        self._opening = threading.Lock()
        self._last_rate: dict[str, tuple[float, float, dict]] = {}  # task: (time, local step, ps counters)
        self._staleness: dict[str, list[int]] = defaultdict(list)
        self._last_step: dict[str, int] = {}
        self._charted_at: dict[str, float] = {}  # task: the time of its last charted step
        self._uncharted: dict[str, dict] = {}  # task: its latest step not charted yet
        self._graph: threading.Thread | None = None  # the model's graph being traced (``trace_graph``)

    def _writer(self, folder: str):
        with self._opening:  # the collector's thread and the graph's may open a folder at once
            if folder not in self._writers:
                from torch.utils.tensorboard import SummaryWriter  # tensorboard: loaded when a run first writes

                self._writers[folder] = SummaryWriter(str(self.logdir / folder), flush_secs=2)
            return self._writers[folder]

    def add_events(self, events: list[dict]) -> None:
        """The events of one batch: ``step`` and ``epoch`` (a worker's), ``ps`` (a ps task's); others are not
        charted."""
        for event in events:
            try:
                if event.get("kind") == "step":
                    self._step(event)
                elif event.get("kind") == "ps":
                    self._ps(event)
                elif event.get("kind") == "epoch":
                    self._writer(str(event["task"]).replace(":", "_")).add_scalar(
                        "epoch", int(event["epoch"]), int(event["global_step"]), walltime=event["time"])
            except Exception:  # a malformed event, a full disk: the run goes on without this point
                self.errors += 1

    def _step(self, e: dict) -> None:
        task = str(e["task"]).replace(":", "_")
        writer, step = self._writer(task), int(e["global_step"])
        self._last_step[task] = step
        if e["time"] - self._charted_at.get(task, -math.inf) >= POINT_S:
            self._chart(task, e)
        else:
            self._uncharted[task] = e
        if e.get("staleness") is not None:
            self._staleness[task].append(int(e["staleness"]))
            if len(self._staleness[task]) >= HISTOGRAM_STEPS:
                self._histogram(task, step)
        then = self._last_rate.get(task)
        if then is None:
            self._last_rate[task] = (e["time"], e["local_step"], {})
        elif e["time"] - then[0] >= RATE_S:
            writer.add_scalar("steps_per_s", (e["local_step"] - then[1]) / (e["time"] - then[0]), step,
                              walltime=e["time"])
            self._last_rate[task] = (e["time"], e["local_step"], {})

    def _chart(self, task: str, e: dict) -> None:
        """Write the loss, accuracy and metrics of step event ``e`` of ``task``."""
        writer, step, now = self._writer(task), int(e["global_step"]), e["time"]
        for tag in ("loss", "accuracy"):
            if e.get(tag) is not None:
                writer.add_scalar(tag, float(e[tag]), step, walltime=now)
        for name, value in (e.get("metrics") or {}).items():
            writer.add_scalar(f"metrics/{name}", float(value), step, walltime=now)
        self._charted_at[task] = now
        self._uncharted.pop(task, None)

    def _histogram(self, task: str, step: int) -> None:
        import numpy as np

        self._writer(task).add_histogram("staleness", np.asarray(self._staleness.pop(task)), step)

    def _ps(self, e: dict) -> None:
        task = str(e["task"]).replace(":", "_")
        writer, step, now = self._writer(task), int(e["step"]), e["time"]
        if e.get("lr") is not None:
            writer.add_scalar("lr", float(e["lr"]), step, walltime=now)
        writer.add_scalar("waiting_for", len(e.get("waiting_for") or ()), step, walltime=now)
        counters = {k: e[k] for k in ("applied", "bytes_in", "bytes_out") if k in e}
        then = self._last_rate.get(task)
        if then is not None and now - then[0] >= RATE_S:
            for name, tag in (("applied", "updates_per_s"), ("bytes_in", "bytes_in_per_s"),
                              ("bytes_out", "bytes_out_per_s")):
                if name in counters and name in then[2]:
                    writer.add_scalar(tag, (counters[name] - then[2][name]) / (now - then[0]), step, walltime=now)
        if then is None or now - then[0] >= RATE_S:
            self._last_rate[task] = (now, 0, counters)

    def add_evaluation(self, step: int, loss: float, accuracy: float | None) -> None:
        try:
            writer = self._writer("eval")
            writer.add_scalar("loss", float(loss), step)
            if accuracy is not None:
                writer.add_scalar("accuracy", float(accuracy), step)
        except Exception:
            self.errors += 1

    def trace_graph(self, model, inputs: tuple) -> None:
        """``add_graph`` in a thread of its own, beside the run's start, which it must not delay; ``close`` waits
        for it (a trace slower than a short run would otherwise find the files closed)."""
        self._graph = threading.Thread(target=self.add_graph, args=(model, inputs), name="pscluster-graph",
                                       daemon=True)
        self._graph.start()

    def add_graph(self, model, inputs: tuple) -> bool:
        """The model's graph (TensorBoard's Graphs tab), traced by ``torch.jit.trace`` on ``inputs``, in the
        chief's folder; whether it was written. A model torch cannot trace is left out (counted in ``errors``)
        without a word: the user asked for training, not for a trace."""
        import torch

        try:
            with warnings.catch_warnings():
                # a trace's doubts about data-dependent branches concern the graph only; the filter is
                # process-wide while it lasts, which costs other threads nothing but these warnings
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's, which add_graph uses
                torch.jit.trace(model, inputs, strict=False, check_trace=False)  # raises; add_graph would print
                self._writer("worker_0").add_graph(model, inputs)
            return True
        except Exception:
            self.errors += 1
            return False

    def close(self) -> None:
        """Write what is pending (the model's graph, each worker's last step, the staleness of its last steps) and
        close every file."""
        if self._graph is not None:
            self._graph.join()
        for task, event in list(self._uncharted.items()):
            try:
                self._chart(task, event)
            except Exception:
                self.errors += 1
        for task in list(self._staleness):
            if self._staleness[task]:
                try:
                    self._histogram(task, self._last_step.get(task, 0))
                except Exception:
                    self.errors += 1
        for writer in self._writers.values():
            writer.close()
