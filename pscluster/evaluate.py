"""Evaluation of trained parameters on a dataset, in the calling process, and the ROC AUC of scores."""

from __future__ import annotations

import numpy as np
import torch

from .errors import ConfigError
from .runtime.data import in_order
from .runtime.steps import batch_accuracy, forward, metric_values, samples_in


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, loss_fn, *, step_fn=None, batch_size: int = 1024,
             collate_fn=None) -> dict:
    """Mean loss, accuracy (None where it means nothing, see ``runtime.steps.batch_accuracy``) and the mean of each
    of a ``step_fn``'s metrics (under their own names) of ``model`` in eval mode over ``dataset``, a map-style or
    iterable dataset batched as the workers batch it (``collate_fn``: theirs), or a DataLoader."""
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


def auc(scores, labels) -> float:
    """ROC AUC of ``scores`` (logits or probabilities) against 0/1 ``labels``; tensors or arrays.

    The chance that a random positive scores above a random negative (ties count half).
    Raises ConfigError when the labels hold a single class, where the AUC is undefined.
    """
    from sklearn.metrics import roc_auc_score  # imported here: sklearn is slow to import

    scores, labels = _flat_numpy(scores), _flat_numpy(labels)
    if len(scores) != len(labels):
        raise ConfigError(f"auc got {len(scores)} scores for {len(labels)} labels: pass one score per label")
    classes = np.unique(labels).tolist()
    if len(classes) < 2:
        raise ConfigError(f"auc needs labels of both classes, got only {classes}: evaluate on rows with both outcomes")
    if len(classes) > 2:
        raise ConfigError(f"auc needs binary labels, got {len(classes)} classes: pass 0/1 labels")
    return float(roc_auc_score(labels, scores))


def _flat_numpy(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values).reshape(-1)
