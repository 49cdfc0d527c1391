"""Evaluation of trained parameters on a dataset, in the calling process, and the ROC AUC of scores."""

from __future__ import annotations

import numpy as np
import torch

from .errors import ConfigError
from .runtime.data import fetch_batch
from .runtime.worker import batch_accuracy


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, loss_fn, *, batch_size: int = 1024) -> dict:
    """Mean loss and accuracy (None for non-classifiers) of ``model`` over ``dataset``."""
    model.eval()
    total, loss_sum, correct, has_accuracy = 0, 0.0, 0.0, True
    for start in range(0, len(dataset), batch_size):
        x, y = fetch_batch(dataset, list(range(start, min(start + batch_size, len(dataset)))))
        output = model(x)
        n = len(y)
        loss_sum += loss_fn(output, y).item() * n
        accuracy = batch_accuracy(output, y)
        has_accuracy = has_accuracy and accuracy is not None
        correct += (accuracy or 0.0) * n
        total += n
    if total == 0:
        return {"loss": float("nan"), "accuracy": None}
    return {"loss": loss_sum / total, "accuracy": correct / total if has_accuracy else None}


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
