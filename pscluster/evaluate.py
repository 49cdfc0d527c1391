"""Evaluation of trained parameters on a dataset, in the calling process."""

from __future__ import annotations

import torch

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
