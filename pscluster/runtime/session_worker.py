"""The workers of a notebook's session (seed 004's in-graph replication, ``Cluster.session``): the notebook's loop
hands each worker a slice of its batch, each computes its slice's gradients, the ps tasks aggregate them (sync) and
apply the update, each worker gives back its slice's numbers.

On a worker's engine, ``start`` runs the run's loop (``context.run_loop``) in a thread of its own, which leaves the
engine free for the controller's ``step`` calls; the two meet through a pair of queues. ``end`` lets the loop
return. The control plane reaches these through ``remote`` (ipyparallel, authenticated): slices never travel on the
data plane.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError, TrainingError
from ..spec import ClusterSpec
from .context import run_loop
from .plan import TrainPlan
from .steps import batch_accuracy, compute, metric_values
from .seeding import build_model

_ENDED = object()  # what the loop's outbox holds once it returned or failed


@dataclass
class _Worker:
    inbox: queue.Queue = field(default_factory=queue.Queue)  # (slice, group options), or None: end
    outbox: queue.Queue = field(default_factory=queue.Queue)  # each step's numbers, then _ENDED
    failure: str | None = None  # why its loop ended, if it failed


_workers: dict[tuple[int, int], _Worker] = {}


def build_optimizer(optimizer, model: torch.nn.Module, options: dict) -> torch.optim.Optimizer:
    """``optimizer(model.parameters(), **options)`` for an optimizer class, ``optimizer(model)`` for a function that
    builds one (tensor groups, as ``configure_optimizers`` does)."""
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters(), **options)
    if options:
        raise ConfigError("optimizer options go with an optimizer class: give optimizer=torch.optim.SGD, lr=0.1, or "
                          "a function of the model that builds the optimizer (and no options)")
    if not callable(optimizer):
        raise ConfigError(f"optimizer {optimizer!r}: give a torch.optim class or a function of the model")
    built = optimizer(model)
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(f"the optimizer function returned a {type(built).__name__}: return a torch optimizer")
    return built


def serve(ctx, worker: _Worker, plan: TrainPlan, model_fn, optimizer, options: dict, loss_fn, step_fn) -> None:
    """The session's loop on a worker: each slice's forward and backward (the default step or ``step_fn``), the
    exchange (``optimizer.step()``) with the controller's group options, and the slice's numbers back."""
    model = ctx.model(build_model(model_fn, plan.seed).to(ctx.device), name=plan.modules[0])
    run_optimizer = ctx.optimizer(build_optimizer(optimizer, model, options))
    while not ctx.should_stop():
        item = worker.inbox.get()
        if item is None:
            return
        batch, groups = item
        for group, values in zip(run_optimizer.param_groups, groups):
            group.update(values)
        computed = compute(model, loss_fn, step_fn, batch, ctx.device, ctx.global_step, autocast=ctx.autocast,
                           backward=ctx.backward)
        numbers = {"loss": computed.loss.item(), "accuracy": batch_accuracy(computed.output, computed.target),
                   "metrics": metric_values(computed.metrics), "samples": computed.samples}
        run_optimizer.step()
        ctx.log(loss=numbers["loss"], **({"accuracy": numbers["accuracy"]} if numbers["accuracy"] is not None
                                         else {}), **numbers["metrics"])
        worker.outbox.put({**numbers, "global_step": ctx.global_step})


def start(spec: ClusterSpec, index: int, plan: TrainPlan, model_fn, optimizer, options: dict, loss_fn, step_fn,
          join: bool = False) -> None:
    """Run worker ``index``'s session loop in a thread of this process (the one of an earlier attempt of the run
    ends on its own: its connections are fenced off)."""
    worker = _Worker()
    _workers[(plan.run_id, index)] = worker

    def run() -> None:
        try:
            run_loop(spec, index, plan,
                     lambda ctx: serve(ctx, worker, plan, model_fn, optimizer, options, loss_fn, step_fn), join=join)
        except BaseException as e:  # noqa: BLE001 - the controller's next step says why
            worker.failure = f"{type(e).__name__}: {e}"
        finally:
            worker.outbox.put(_ENDED)

    threading.Thread(target=run, name=f"pscluster-session-{index}", daemon=True).start()


def step(run_id: int, index: int, batch, groups: list[dict], timeout: float) -> dict:
    """Worker ``index``'s part of one step: its slice ``batch`` computed and exchanged with ``groups`` (the
    controller's optimizer options, per group); its numbers (loss, accuracy, metrics, samples, global step)."""
    worker = _workers.get((run_id, index))
    if worker is None:
        raise TrainingError(f"worker {index} holds no session of run {run_id}: start the session again")
    worker.inbox.put((batch, groups))
    try:
        out = worker.outbox.get(timeout=timeout)
    except queue.Empty:
        raise TrainingError(f"worker {index} gave no result within {timeout:.0f}s") from None
    if out is _ENDED:
        worker.outbox.put(_ENDED)
        raise TrainingError(f"worker {index}'s session ended: {worker.failure or 'the run was stopped'}")
    return out


def end(run_id: int, index: int) -> None:
    """Let worker ``index``'s session loop return (the run's end)."""
    worker = _workers.pop((run_id, index), None)
    if worker is not None:
        worker.inbox.put(None)
