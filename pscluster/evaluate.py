"""``pscluster.evaluate``: a model's loss, accuracy and metrics over a dataset, in the calling process
(``evaluate``, over ``runtime.evaluation``, which ``Run.evaluate`` uses too), and the ROC AUC of scores (``auc``)."""

from __future__ import annotations

import numpy as np
import torch

from .errors import ConfigError
from .runtime import evaluation
from .runtime.steps import check_loss

__all__ = ["auc", "evaluate"]


def evaluate(model: torch.nn.Module, dataset, loss_fn=None, *, step_fn=None, batch_size: int = 1024,
             collate_fn=None) -> dict:
    """Mean loss, accuracy (None unless the outputs are class logits against integer targets) and the mean of each
    of a ``step_fn``'s metrics of ``model``, in eval mode, over ``dataset`` (a map-style or iterable dataset, batched
    as the workers batch it with ``collate_fn``, or a DataLoader), computed here: ``{"loss": ..., "accuracy": ...}``.

    ``loss_fn(output, target)`` scores the default step (``batch = (inputs, target)``); ``step_fn(model, batch)``
    replaces it. A model, loss or dataset that do not fit each other raise ConfigError naming what to fix (the
    error of the failing batch chained to it), not the error of whichever torch call failed first.
    """
    check_loss(loss_fn, step_fn)
    return evaluation.evaluate(model, dataset, loss_fn, step_fn=step_fn, batch_size=batch_size, collate_fn=collate_fn)


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
