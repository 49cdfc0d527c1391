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

The writer never fails a run. It writes the files itself, in the thread that hands it the events: torch's
``SummaryWriter`` writes them in a thread of its own, which a full disk kills with a traceback on stderr (one
more for each folder opened after it) and whose death fails every later write and its ``close``. A malformed
event is counted in ``errors``; a file that cannot be written (a full disk, a read-only one) is one warning that
names the folder and the cause, after which nothing more is written: each event left out is counted in
``errors``, and the count said when the writer closes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import re
import socket
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path

log = logging.getLogger("pscluster.metrics")

HISTOGRAM_STEPS = 100
RATE_S = 1.0  # how often a task's rates are written
POINT_S = 0.05  # the shortest time between two charted steps of a worker
CHARTED = ("step", "ps", "epoch")  # the kinds of event charted (each written, or counted in ``errors``)
# the buckets of a histogram, SummaryWriter's ("tensorflow"): 0 and +-1e-12 to 1e20, each 10 % above the one before
_UP = list(itertools.takewhile(lambda v: v < 1e20, (1e-12 * 1.1 ** i for i in itertools.count())))
BINS = [-v for v in reversed(_UP)] + [0.0] + _UP
_file_ids = itertools.count()  # what keeps apart the names of two files of a folder opened in the same second


def run_logdir(store_path: str | Path, name: str, run_id: int) -> Path:
    """Where run ``run_id`` (named ``name``) of the run store at ``store_path`` writes its event files:
    ``<name>-<id>``, or ``run-<id>`` for a run of that default name."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    return Path(store_path).parent / "tensorboard" / (safe if safe == f"run-{run_id}" else f"{safe}-{run_id}")


_IMPORTING = threading.Lock()


def _import_writers() -> None:
    """Import what the event files are written with, one thread at a time: the collector's first event and the
    graph's trace import these modules at once otherwise, which can deadlock Python's import locks
    (``_DeadlockError``). Loaded when a run first writes, not with pscluster."""
    with _IMPORTING:
        import tensorboard.compat.proto.event_pb2  # noqa: F401
        import tensorboard.summary.writer.record_writer  # noqa: F401
        import torch.utils.tensorboard._pytorch_graph  # noqa: F401
        import torch.utils.tensorboard.summary  # noqa: F401


class _EventFile:
    """One folder's event file, in TensorBoard's format: a record of an ``Event`` proto per event, buffered until
    ``flush``."""

    def __init__(self, folder: Path):
        _import_writers()
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_file_ids)}"
        self._file = open(folder / name, "wb")
        self._records = RecordWriter(self._file)
        self.add(file_version="brain.Event:2")

    def add(self, step: int | None = None, walltime: float | None = None, **fields) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        event = Event(wall_time=time.time() if walltime is None else walltime, **fields)
        if step is not None:
            event.step = int(step)
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()  # closed even where what it held cannot be written (and raises)


class EventWriter:
    """Writes the events of one run (the batches its collector receives, its evaluations) under ``logdir``."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self.errors = 0
        self.failure: str | None = None  # why the files could not be written, once they could not
        self._closed = False
        self._files: dict[str, _EventFile] = {}
        self._lock = threading.RLock()  # the collector's thread and the graph's write at once
        self._last_rate: dict[str, tuple[float, float, dict]] = {}  # task: (time, local step, ps counters)
        self._staleness: dict[str, list[int]] = defaultdict(list)
        self._last_step: dict[str, int] = {}
        self._charted_at: dict[str, float] = {}  # task: the time of its last charted step
        self._uncharted: dict[str, dict] = {}  # task: its latest step not charted yet
        self._graph: threading.Thread | None = None  # the model's graph being traced (``trace_graph``)

    def _file(self, folder: str) -> _EventFile:
        if folder not in self._files:
            self._files[folder] = _EventFile(self.logdir / folder)
        return self._files[folder]

    def _scalar(self, folder: str, tag: str, value: float, step: int, walltime: float | None = None) -> None:
        from torch.utils.tensorboard.summary import scalar

        self._file(folder).add(step, walltime, summary=scalar(tag, value))

    def _try(self, write, *args) -> bool:
        """``write(*args)`` (under ``_lock``), and whether it wrote; what it could not write counted in ``errors``,
        and nothing tried once the files failed or closed."""
        if self.failure is not None or self._closed:
            self.errors += 1
            return False
        try:
            write(*args)
            return True
        except OSError as e:  # the disk (full, read-only): said once, and nothing more written
            self.errors += 1
            self._failed(e)
        except Exception:  # a malformed event: the run goes on without this point
            self.errors += 1
        return False

    def _failed(self, e: OSError) -> None:
        """The files cannot be written: said once, each closed (what it holds is read as it is), none opened again."""
        if self.failure is None:
            self.failure = f"[Errno {e.errno}] {e.strerror}" if e.errno and e.strerror else str(e) or type(e).__name__
            log.warning("TensorBoard files under %s could not be written: %s; the run goes on without them",
                        self.logdir, self.failure)
        files, self._files = self._files, {}
        for file in files.values():
            with contextlib.suppress(OSError):  # what its buffer holds cannot be written either
                file.close()

    def _flush(self) -> None:
        """Every file's buffer written, at the end of each call: TensorBoard draws what came so far."""
        if self.failure is None and not self._closed:
            self._try(self._flush_files)

    def _flush_files(self) -> None:
        for file in self._files.values():
            file.flush()

    def add_events(self, events: list[dict]) -> None:
        """The events of one batch: ``step`` and ``epoch`` (a worker's), ``ps`` (a ps task's); others are not
        charted."""
        with self._lock:
            for event in events:
                if not isinstance(event, dict) or event.get("kind") in CHARTED:
                    self._try(self._event, event)
            self._flush()

    def _event(self, event: dict) -> None:
        if event["kind"] == "step":
            self._step(event)
        elif event["kind"] == "ps":
            self._ps(event)
        else:
            self._scalar(str(event["task"]).replace(":", "_"), "epoch", int(event["epoch"]),
                         int(event["global_step"]), walltime=event["time"])

    def _step(self, e: dict) -> None:
        task, step = str(e["task"]).replace(":", "_"), int(e["global_step"])
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
            self._scalar(task, "steps_per_s", (e["local_step"] - then[1]) / (e["time"] - then[0]), step,
                         walltime=e["time"])
            self._last_rate[task] = (e["time"], e["local_step"], {})

    def _chart(self, task: str, e: dict) -> None:
        """Write the loss, accuracy and metrics of step event ``e`` of ``task``."""
        step, now = int(e["global_step"]), e["time"]
        for tag in ("loss", "accuracy"):
            if e.get(tag) is not None:
                self._scalar(task, tag, float(e[tag]), step, walltime=now)
        for name, value in (e.get("metrics") or {}).items():
            self._scalar(task, f"metrics/{name}", float(value), step, walltime=now)
        self._charted_at[task] = now
        self._uncharted.pop(task, None)

    def _histogram(self, task: str, step: int) -> None:
        import numpy as np
        from torch.utils.tensorboard.summary import histogram

        self._file(task).add(step, summary=histogram("staleness", np.asarray(self._staleness.pop(task)), BINS))

    def _ps(self, e: dict) -> None:
        task, step, now = str(e["task"]).replace(":", "_"), int(e["step"]), e["time"]
        if e.get("lr") is not None:
            self._scalar(task, "lr", float(e["lr"]), step, walltime=now)
        self._scalar(task, "waiting_for", len(e.get("waiting_for") or ()), step, walltime=now)
        counters = {k: e[k] for k in ("applied", "bytes_in", "bytes_out") if k in e}
        then = self._last_rate.get(task)
        if then is not None and now - then[0] >= RATE_S:
            for name, tag in (("applied", "updates_per_s"), ("bytes_in", "bytes_in_per_s"),
                              ("bytes_out", "bytes_out_per_s")):
                if name in counters and name in then[2]:
                    self._scalar(task, tag, (counters[name] - then[2][name]) / (now - then[0]), step, walltime=now)
        if then is None or now - then[0] >= RATE_S:
            self._last_rate[task] = (now, 0, counters)

    def add_evaluation(self, step: int, loss: float, accuracy: float | None) -> None:
        with self._lock:
            self._try(self._evaluation, step, loss, accuracy)
            self._flush()

    def _evaluation(self, step: int, loss: float, accuracy: float | None) -> None:
        self._scalar("eval", "loss", float(loss), step)
        if accuracy is not None:
            self._scalar("eval", "accuracy", float(accuracy), step)

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

        _import_writers()
        from torch.utils.tensorboard._pytorch_graph import graph  # what SummaryWriter.add_graph writes

        try:
            with warnings.catch_warnings():
                # a trace's doubts about data-dependent branches concern the graph only; the filter is
                # process-wide while it lasts, which costs other threads nothing but these warnings
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's, which graph() uses
                torch.jit.trace(model, inputs, strict=False, check_trace=False)  # raises; graph() would print
                graph_def, run_metadata = graph(model, inputs)
        except Exception:
            with self._lock:
                self.errors += 1
            return False
        with self._lock:  # the files are the collector's thread's too
            written = self._try(self._write_graph, graph_def, run_metadata)
            self._flush()
            return written

    def _write_graph(self, graph_def, run_metadata) -> None:
        from tensorboard.compat.proto.event_pb2 import TaggedRunMetadata

        file = self._file("worker_0")
        file.add(graph_def=graph_def.SerializeToString())
        file.add(tagged_run_metadata=TaggedRunMetadata(tag="step1", run_metadata=run_metadata.SerializeToString()))

    def close(self) -> None:
        """Write what is pending (the model's graph, each worker's last step, the staleness of its last steps) and
        close every file; never raises. Where the files could not be written, the count of the events left out is
        said; the events that come later are counted, not written."""
        if self._graph is not None:
            self._graph.join()
        with self._lock:
            if self._closed:
                return
            for task, event in list(self._uncharted.items()):
                self._try(self._chart, task, event)
            for task in list(self._staleness):
                if self._staleness[task]:
                    self._try(self._histogram, task, self._last_step.get(task, 0))
            self._flush()
            while self._files:
                try:
                    self._files.popitem()[1].close()
                except OSError as e:
                    self.errors += 1
                    self._failed(e)
            self._closed = True
            if self.failure is not None and self.errors > 1:
                log.warning("%d TensorBoard events in all could not be written under %s", self.errors, self.logdir)
