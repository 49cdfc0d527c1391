"""The library's own worker loop (``Cluster.train``'s): ``library_loop``, a ``train_fn`` of the worker's public
context (``context.WorkerContext``), and ``run_worker``, which runs it as worker ``index`` of a run.

Each step is one fused push-then-pull round trip to every ps at once, during which the next batch is read (with
``pipeline``, its gradients computed); the dense values go through shared memory to a ps on the same host
(``PSClient.share``).
"""

from __future__ import annotations

from ..spec import ClusterSpec
from . import seeding
from .plan import TrainPlan
from .steps import batch_accuracy, compute


def library_loop(model_fn, dataset, loss_fn, step_fn=None, collate_fn=None):
    """``Cluster.train``'s loop: a ``train_fn`` of the worker's public context (``context.WorkerContext``), as a
    user's loop is, so both follow one set of rules (the context's ``autocast``, ``backward`` and
    ``optimizer.step()``: precision, clipping, non-finite values, overlap, pipelining).

    The model is built under the run's seed, then the worker's own random streams seeded (``seeding``); its first
    batch is read before the run starts (``ctx.endless_shard``). Each step: forward under ``ctx.autocast()``,
    ``ctx.backward(loss)`` (fp16 loss scaling; the pushes that leave during backward and a GPU's host copies where
    the plan's ``overlap`` applies), ``optimizer.step()`` of the plan's own optimizer (the run's rules, the push;
    the next batch read while it is in flight, or with ``pipeline`` the reply settled at the next step), then the
    step's numbers (``ctx.log``). A step left out (a non-finite value with ``on_nonfinite="skip"``, an fp16
    overflow) takes the next batch."""
    def train_fn(ctx) -> None:
        plan = ctx.plan
        model = ctx.model(seeding.build_model(model_fn, plan.seed).to(ctx.device))
        seeding.seed_worker(plan.seed, ctx.worker_index, plan.attempt)
        optimizer = ctx.optimizer(overlap=True)  # the plan's: its gradients are final when backward returns
        loader = plan.loader
        batches = ctx.endless_shard(dataset, plan.batch_size, collate_fn=collate_fn, loader_workers=loader.num_workers,
                                    prefetch_factor=loader.prefetch_factor, pin_memory=loader.pin_memory,
                                    shuffle=loader.shuffle, drop_last=loader.drop_last, always_read_ahead=True)
        for batch in batches:
            computed = compute(model, loss_fn, step_fn, batch, ctx.device, autocast=ctx.autocast,
                               backward=ctx.backward)
            if optimizer.step():
                numbers = {**{str(name): value for name, value in computed.metrics.items()},
                           "loss": computed.loss.item()}
                accuracy = batch_accuracy(computed.output, computed.target)
                if accuracy is not None:
                    numbers["accuracy"] = accuracy
                ctx.log(**numbers)
            if ctx.should_stop():
                break

    return train_fn


def run_worker(spec: ClusterSpec, index: int, plan: TrainPlan, model_fn, dataset, loss_fn,
               *, step_fn=None, collate_fn=None, log=None, join: bool = False) -> dict:
    """Train as worker ``index`` until the run reaches its step target or is stopped: ``library_loop`` on the
    worker's context.

    Each step is ``step_fn(model, batch)`` or the default step (see ``steps``) on the batches of ``dataset`` that
    are this worker's (``data.worker_batches``, with the plan's loader options and ``collate_fn``). ``join``: this
    worker replaces a lost one in a running run (see ``join_run``). Returns a summary: local steps, last global step,
    dropped pushes, skipped batches, timings.
    """
    from .context import run_loop  # the context is built on this module's pieces

    return run_loop(spec, index, plan, library_loop(model_fn, dataset, loss_fn, step_fn, collate_fn), join=join,
                    log=log)
