"""Session: seed 004's in-graph replication in a notebook. The notebook's own loop calls ``session.step(batch)``;
the batch is split along its first dimension across the workers, each computes its slice's gradients, the ps tasks
average them and apply one update (sync), and ``step`` returns the batch's loss and metrics. Everything else is the
notebook's: a ``ReduceLROnPlateau`` on ``session.optimizer`` (its groups' options go with every step), early
stopping, its own evaluation on ``session.model()``.

    with cluster.session(Net, torch.optim.SGD, torch.nn.CrossEntropyLoss(), lr=0.1) as session:
        for epoch in range(10):
            for batch in loader:
                out = session.step(batch)       # {"loss", "accuracy", ..., "global_step"}
            plateau.step(validate(session.model()))

The session is a run like any other (the run store, the dashboard, the side panel, checkpoints, a lost worker
replaced): ``session.run``. ``close()`` ends it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ConfigError, TrainingError
from ..runtime import remote
from ..runtime.optim import group_options
from . import ipp_bounds
from .run import Run

SESSION_STEPS = 2**31 - 1  # a session's step target: none that a notebook reaches; close() ends it


def split(batch, parts: int) -> list:
    """``batch`` (a tensor, or tuples, lists and dicts of them) cut into ``parts`` slices along the first dimension of
    each tensor, as evenly as ``torch.tensor_split`` cuts; other values go to every slice as they are."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] < parts:
            raise ConfigError(f"a batch of {batch.shape[0] if batch.dim() else 0} samples for {parts} workers: give "
                              f"each worker one at least (a batch of {parts} or more)")
        return list(torch.tensor_split(batch, parts))
    if isinstance(batch, Mapping):
        cut = {k: split(v, parts) for k, v in batch.items()}
        return [type(batch)({k: v[i] for k, v in cut.items()}) for i in range(parts)]
    if isinstance(batch, (tuple, list)):
        cut = [split(v, parts) for v in batch]
        rebuild = (lambda items: type(batch)(*items)) if hasattr(batch, "_fields") else type(batch)
        return [rebuild(v[i] for v in cut) for i in range(parts)]
    return [batch] * parts


def _pickled_bytes(piece) -> int:
    """The bytes of the tensors in ``piece`` as pickling sends them: the whole storage of each, once (a slice of a
    batch pickles the batch's)."""
    storages = {}

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (tuple, list)):
            for v in value:
                walk(v)

    walk(piece)
    return sum(storages.values())


def combine(outs: list[dict]) -> dict:
    """One step's numbers from each worker's: loss, accuracy and metrics averaged over the samples, the global
    step after the update."""
    samples = sum(o["samples"] for o in outs)

    def mean(values) -> float:
        return sum(v * o["samples"] for v, o in zip(values, outs)) / samples

    out = {"loss": mean(o["loss"] for o in outs)}
    if all(o["accuracy"] is not None for o in outs):
        out["accuracy"] = mean(o["accuracy"] for o in outs)
    for name in outs[0]["metrics"]:
        out[name] = mean(o["metrics"][name] for o in outs)
    return {**out, "samples": samples, "global_step": max(o["global_step"] for o in outs)}


class Session:
    """A notebook's loop over the cluster's workers (see the module); ``Cluster.session`` makes one."""

    def __init__(self, cluster, run: Run, optimizer: torch.optim.Optimizer, model: torch.nn.Module, timeout: float):
        self._cluster, self.run, self.optimizer, self._model, self._timeout = cluster, run, optimizer, model, timeout
        self._global_step = 0

    def step(self, batch) -> dict:
        """One global step on ``batch``, split across the workers: ``{"loss", "accuracy" (where it means something),
        <step_fn's metrics>, "samples", "global_step"}``. The options of ``optimizer``'s groups (its learning rate)
        apply to this step's update."""
        if self.run.done:
            raise TrainingError(f"{self.run.name} is over ({self.run.status}): start a new session")
        spec = self.run.spec
        groups = group_options(self.optimizer)
        slices = split(batch, len(spec.workers))
        ipp_bounds.check(max(map(_pickled_bytes, slices)), "the batch of one worker",
                         "give session.step() smaller batches")
        pending = [self._cluster.task_view(t).apply_async(remote.session_step, self.run.id, t.index, piece, groups,
                                                     self._timeout)
                   for t, piece in zip(spec.workers, slices)]
        try:
            out = combine([p.get(self._timeout + 10) for p in pending])
        except Exception as e:  # a RemoteError: its one line
            raise TrainingError(f"{self.run.name}: step failed: {str(e).strip().splitlines()[-1]}") from None
        self._global_step = out["global_step"]
        return out

    @property
    def global_step(self) -> int:
        """The global step after the last ``step``."""
        return self._global_step

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters the ps tasks hold now (after the last step), as the model's ``state_dict()``."""
        return self.run.supervisor.pull_parameters()[1]

    def model(self) -> torch.nn.Module:
        """The controller's copy of the model, holding the parameters the ps tasks hold now."""
        self._model.load_state_dict(self.state_dict())
        return self._model

    def close(self) -> Run:
        """End the session's run, finished (its workers' loops end, the final checkpoint is written); returns it."""
        if not self.run.done:
            for t in self.run.spec.workers:
                self._cluster.task_view(t).apply_sync(remote.end_session_worker, self.run.id, t.index)
            self.run.wait(timeout=self.run.plan.request_timeout, verbose=False)
        return self.run

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Session {self.run.name}: global step {self._global_step}, {len(self.run.spec.workers)} workers>"
