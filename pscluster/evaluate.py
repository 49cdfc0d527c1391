"""``pscluster.evaluate``: a model's loss, accuracy and metrics over a dataset, in the calling process
(``evaluate``, from ``runtime.evaluation``, which ``Run.evaluate`` uses too), and the ROC AUC of scores (``auc``)."""

from __future__ import annotations

import numpy as np
import torch

from .errors import ConfigError
from .runtime.evaluation import evaluate

__all__ = ["auc", "evaluate"]


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
