"""The user's code a run trains, as the controller's process holds it: what builds a trained model again here and
evaluates it (``Run.model``, ``Run.evaluate``, and the supervisor's evaluations during the run)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TrainingError
from ..runtime.evaluation import evaluate
from ..runtime.seeding import build_model


@dataclass(frozen=True)
class ModelCode:
    """``model_fn`` (a module or a function that builds one; None for a run another process started, whose code
    stays on its engines), with the run's ``seed`` and its ``loss_fn``, ``step_fn`` and ``collate_fn``."""

    model_fn: object = None
    seed: int = 0
    loss_fn: object = None
    step_fn: object = None
    collate_fn: object = None

    def model(self, state: dict, run_name: str) -> torch.nn.Module:
        """A model built by ``model_fn`` holding ``state`` (loaded strictly); TrainingError naming ``run_name``'s
        way out when this process has no ``model_fn``."""
        if self.model_fn is None:
            raise TrainingError(f"{run_name} was started by another process, whose model_fn this one does not "
                                "have: build the model and load run.state_dict() into it")
        model = build_model(self.model_fn, self.seed)
        model.load_state_dict(state)
        return model

    def evaluate(self, model: torch.nn.Module, dataset, *, batch_size: int = 1024) -> dict:
        """``{"loss": ..., "accuracy": ...}`` of ``model`` on ``dataset`` (``evaluation.evaluate``)."""
        return evaluate(model, dataset, self.loss_fn, step_fn=self.step_fn, batch_size=batch_size,
                        collate_fn=self.collate_fn)

    def evaluator(self, dataset):
        """What the supervisor scores a state dict with, on ``dataset`` (``Supervisor``'s ``evaluator``)."""
        return lambda state: self.evaluate(self.model(state, "the run"), dataset)
