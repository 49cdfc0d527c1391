"""An update of a run's variables on its ps: one optimizer step with the mean of summed gradients (dense, or
sparse rows for the sparse-aware optimizers: SGD, Adagrad, and Adam as the lazy SparseAdam, which touches only the
rows present), and the buffers set from the values the workers pushed, by the run's rule (``plan.BUFFER_RULES``).
When an update is applied, and whether it is a global step, is the policy's (``policies``)."""

from __future__ import annotations

import torch

from . import update_guard


def apply(run, grads: list, count: int) -> None:
    """One optimizer step of ``run`` (a ``run_state.RunState``) with the mean of ``count`` summed gradients (of the
    variables this ps owns; sparse ones as lists of (rows, values) parts; a dense one on the meta device was applied
    as it arrived, see ``streamed``; None: a variable of another of a user's optimizers, left as it is), then its
    buffers from the latest pushed values. NonFiniteUpdate, nothing of it applied, when it would make a value or an
    optimizer slot NaN or infinite (``update_guard``)."""
    run.release_sent()
    kept = [(p, g) for p, g in zip(run.trained_params, grads)
            if g is not None and not (isinstance(g, torch.Tensor) and g.is_meta)]
    params, grads = [p for p, _ in kept], [g for _, g in kept]
    lr = run.optimizer.plain_sgd_rate(run.step)
    if lr is not None and grads:  # what SGD's step does without momentum or decay, less its per-call overhead
        with torch.no_grad():  # the mean's division in the rate: one pass fewer over the summed gradients
            run.value_bound = update_guard.sgd_step(params, grads, lr / count, run.value_bound)
    elif lr is not None:  # this ps holds no trained variable: buffers or frozen ones only
        pass
    else:
        for p, g in zip(params, grads):
            if isinstance(g, torch.Tensor):
                p.grad = g.div_(count) if count > 1 else g
            else:
                p.grad = _sparse_grad(p, g, count)
        try:
            run.optimizer.step(run.step)
        finally:
            for p in run.trained_params:
                p.grad = None
    _keep_buffers(run)


def note_buffers(run, worker: int, values: list[torch.Tensor]) -> None:
    """Keep the buffer values of a push that is applied (copies: its frames are released after the request);
    ``apply`` sets the buffers from them."""
    if values:
        run.buffer_values[worker] = [v.clone() for v in values]


def _keep_buffers(run) -> None:
    """Set the buffers by the run's rule from the latest pushed values: ``chief``, those of the lowest-numbered
    live worker that pushed any (worker 0 while it lives, as DDP's broadcast_buffers takes rank 0's);
    ``average``, the mean of every live worker's latest (integer buffers rounded)."""
    if not run.buffers or not run.buffer_values:
        return
    live = [w for w in run.live() if w in run.buffer_values] or sorted(run.buffer_values)
    with torch.no_grad():
        if run.buffer_rule == "chief":
            for b, v in zip(run.buffers, run.buffer_values[live[0]]):
                b.copy_(v)
            return
        for k, b in enumerate(run.buffers):
            mean = torch.stack([run.buffer_values[w][k].double() for w in live]).mean(0)
            b.copy_(mean.round() if not b.is_floating_point() else mean)


def _sparse_grad(param: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], count: int) -> torch.Tensor:
    """The mean of ``count`` sparse gradients given as (row indices, row values) parts."""
    rows = torch.cat([r for r, _ in parts])
    values = torch.cat([v for _, v in parts])
    if count > 1:
        values = values / count
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, param.shape, check_invariants=False).coalesce()
