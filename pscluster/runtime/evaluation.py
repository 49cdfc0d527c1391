"""Evaluation of a model on a dataset in the calling process, batched as the workers batch it: the controller's
evaluations during a run (``Run.evaluate``, ``test_dataset``) and the public ``pscluster.evaluate.evaluate``."""

from __future__ import annotations

import torch

from ..errors import ConfigError, PSClusterError
from .data import in_order
from .steps import batch_accuracy, describe, forward, metric_values, samples_in


def evaluate(model: torch.nn.Module, dataset, loss_fn, *, step_fn=None, batch_size: int = 1024,
             collate_fn=None) -> dict:
    """Mean loss, accuracy (None where it means nothing, see ``runtime.steps.batch_accuracy``) and the mean of each
    of a ``step_fn``'s metrics (under their own names) of ``model`` in eval mode over ``dataset``, a map-style or
    iterable dataset batched as the workers batch it (``collate_fn``: theirs), or a DataLoader.

    A model, loss or dataset that do not fit each other raise ConfigError naming what to fix (the error of the
    failing batch chained to it), not the error of whichever torch call failed first."""
    try:
        return _evaluate(model, dataset, loss_fn, step_fn, batch_size, collate_fn)
    except PSClusterError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        fix = ("fix the model or step_fn to fit its batches" if step_fn is not None else
               "fix the model or loss_fn to fit its batches, or give step_fn=f(model, batch) -> loss")
        raise ConfigError(f"evaluate fails on the dataset (items: {_item_of(dataset)}): {type(e).__name__}: {first} "
                          f"— {fix}") from e


def _item_of(dataset) -> str:
    """What the dataset's first item looks like, for the error message."""
    try:
        return describe(dataset[0])
    except Exception:  # an iterable dataset, or one that fails itself: the error says the rest
        return type(dataset).__name__


@torch.no_grad()
def _evaluate(model: torch.nn.Module, dataset, loss_fn, step_fn, batch_size: int, collate_fn) -> dict:
    model.eval()
    total, loss_sum, correct, has_accuracy, sums = 0, 0.0, 0.0, True, {}
    for batch in in_order(dataset, batch_size, collate_fn):
        loss, output, target, metrics = forward(model, loss_fn, step_fn, batch)
        n = samples_in(batch)
        loss_sum += loss.item() * n
        accuracy = batch_accuracy(output, target)
        has_accuracy = has_accuracy and accuracy is not None
        correct += (accuracy or 0.0) * n
        for name, value in metric_values(metrics).items():
            sums[name] = sums.get(name, 0.0) + value * n
        total += n
    if total == 0:
        return {"loss": float("nan"), "accuracy": None}
    return {"loss": loss_sum / total, "accuracy": correct / total if has_accuracy else None,
            **{name: value / total for name, value in sums.items()}}
