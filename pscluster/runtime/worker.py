"""The library's own worker loop (``Cluster.train``'s): ``library_loop``, a ``train_fn`` of the worker's context
(``context.WorkerContext``), and ``run_worker``, which runs it as worker ``index`` of a run.

Each step is one fused push-then-pull round trip to every ps at once, during which the step's numbers and the
next batch are read (with ``pipeline``, its gradients computed); the dense values go through shared memory to a
ps on the same host (``PSClient.share``).
"""

from __future__ import annotations

import math

import torch

from ..errors import NonFiniteError
from ..spec import ClusterSpec
from . import seeding
from .data import worker_batches
from .overlap import EarlyPush
from .plan import TrainPlan
from .staging import GradientStaging
from .steps import Computed, Precision, batch_accuracy, compute, grad_norm, metric_values, nonfinite


MAX_SKIPS = 100  # on_nonfinite="skip": batches in a row a worker may leave out before it fails anyway


class _Steps:
    """This worker's gradients, batch after batch: the training step (``steps``) in the run's precision, the
    non-finite check of ``plan.on_nonfinite`` and the clipping to ``plan.max_grad_norm``."""

    def __init__(self, model, loss_fn, step_fn, batches, device, plan: TrainPlan, index: int, emit,
                 early: EarlyPush | None = None, staging: GradientStaging | None = None):
        """``early``: the pushes that leave during backward (begun here once forward gave a finite loss);
        ``staging``: a CUDA worker's gradients copied to the host during backward (begun before each)."""
        self.model, self.loss_fn, self.step_fn, self.batches = model, loss_fn, step_fn, batches
        self.device, self.plan, self.index, self.emit = device, plan, index, emit
        self.precision = Precision(plan.precision, device)
        self.early, self.staging = early, staging
        self.skipped = 0
        self.named = list(model.named_parameters())  # read once: walking the modules every step costs
        self.params = [p for _, p in self.named]

    def gradients(self, batch, step: int, local_step: int) -> Computed:
        """The gradients of ``batch`` on the parameters of global ``step``; a batch with a non-finite loss or
        gradient fails the run (NonFiniteError naming this worker and the step) or, with ``skip``, is left out
        for the next one."""
        def before_backward(loss: torch.Tensor) -> None:
            if self.staging is not None:
                self.staging.begin()
            if self.early is not None and math.isfinite(loss.detach().item()):
                self.early.begin(step)

        for attempt in range(MAX_SKIPS + 1):
            computed = compute(self.model, self.loss_fn, self.step_fn, batch, self.device, step, self.precision,
                               before_backward=before_backward)
            checked = self.early.checked() if self.early is not None else frozenset()  # finite, checked already
            norm = grad_norm(self.model, self.plan.max_grad_norm, checked, params=self.params)
            problem = nonfinite(computed, norm, self.named)
            if self.precision.overflowed(problem is None):  # fp16: the loss scale was too high for this batch
                self.emit("loss_scale", global_step=step, scale=self.precision.scale, problem=problem)
                batch = next(self.batches)
                continue
            if problem is None:
                return computed
            if self.plan.on_nonfinite == "fail" or attempt == MAX_SKIPS:
                raise NonFiniteError(
                    f"worker {self.index} computed a non-finite {problem} at global step {step} (its local step "
                    f"{local_step + 1}{f', after skipping {attempt} batches' if attempt else ''}): lower the "
                    "learning rate, clip with max_grad_norm=..., or train with on_nonfinite='skip'")
            self.skipped += 1
            self.emit("nonfinite", global_step=step, local_step=local_step + 1, problem=problem)
            batch = next(self.batches)
        raise AssertionError("unreachable")


def library_loop(model_fn, dataset, loss_fn, step_fn=None, collate_fn=None):
    """``Cluster.train``'s loop: a ``train_fn`` of the worker's context (``context.WorkerContext``), whose exchange
    it shares with every user's loop.

    The model is built under the run's seed, then the worker's own random streams seeded (``seeding``); its first
    batch is read before the run starts (``ctx._start``). Each step: the gradients of a batch on the values the
    worker holds (``_Steps``: the run's precision, non-finite check, clipping; pushes leaving during backward and
    a GPU's host copies where the plan's ``overlap`` applies), pushed (``ctx._push``); while the push-pull is in
    flight, the step's numbers, the next batch and, with ``pipeline``, its gradients; then the reply's values
    (``ctx._settle``)."""
    def train_fn(ctx) -> None:
        plan = ctx._plan
        model = ctx.model(seeding.build_model(model_fn, plan.seed).to(ctx.device))
        seeding.seed_worker(plan.seed, ctx.worker_index, plan.attempt)
        batches = worker_batches(dataset, ctx.worker_index, plan.num_workers, plan.batch_size, plan.seed, plan.loader,
                                 collate_fn, ctx.device)
        try:
            batch = next(batches)
            ctx._overlap = True
            ctx._start()
            steps = _Steps(model, loss_fn, step_fn, batches, ctx.device, plan, ctx.worker_index, ctx._emitter.emit,
                           ctx._early, ctx._staging)
            ahead = None  # pipeline: the gradients of the next batch, computed while the last push-pull was in flight
            while not ctx.should_stop():
                computed = ahead if ahead is not None else steps.gradients(batch, ctx.global_step, ctx._local_steps)
                ctx._samples += computed.samples
                ctx._push(computed.step)
                ctx._log_step(computed.loss.item(), batch_accuracy(computed.output, computed.target),
                              metric_values(computed.metrics))
                batch = next(batches)
                ahead = steps.gradients(batch, ctx.global_step, ctx._local_steps + 1) if plan.pipeline else None
                ctx._settle()
            ctx._skipped += steps.skipped
        finally:
            batches.close()  # its loader processes end

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
