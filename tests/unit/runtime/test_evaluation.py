"""Evaluation in the calling process (``runtime.evaluation``, behind ``pscluster.evaluate`` and ``Run.evaluate``):
the numbers of a plain torch loop, and one-line errors that name the fix when model, loss and data do not fit."""

import pytest
import torch

import pscluster
from pscluster.errors import ConfigError
from pscluster.runtime import evaluation


def data(n=40, features=4):
    torch.manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, features), torch.randint(0, 3, (n,)))


def test_the_loss_and_accuracy_are_those_of_a_plain_loop():
    model, dataset, loss_fn = torch.nn.Linear(4, 3), data(), torch.nn.CrossEntropyLoss()
    with torch.no_grad():
        x, y = dataset.tensors
        expected_loss = loss_fn(model(x), y).item()
        expected_accuracy = (model(x).argmax(1) == y).float().mean().item()
    result = evaluation.evaluate(model, dataset, loss_fn, batch_size=16)
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert result["accuracy"] == pytest.approx(expected_accuracy)


@pytest.mark.parametrize("evaluate", [evaluation.evaluate, pscluster.evaluate.evaluate], ids=["runtime", "public"])
def test_data_that_does_not_fit_the_model_is_a_one_line_config_error(evaluate):
    with pytest.raises(ConfigError) as caught:
        evaluate(torch.nn.Linear(4, 3), data(features=5), torch.nn.CrossEntropyLoss())
    message = str(caught.value)
    assert "\n" not in message and "evaluate fails on the dataset" in message and "fix the model or loss_fn" in message
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's error, chained


def test_a_loss_class_is_refused_asking_for_an_instance():
    with pytest.raises(ConfigError, match=r"^loss_fn=CrossEntropyLoss is a class: pass an instance, "
                                          r"loss_fn=CrossEntropyLoss\(\)$"):
        pscluster.evaluate.evaluate(torch.nn.Linear(4, 3), data(), torch.nn.CrossEntropyLoss)


def test_a_failing_step_fn_names_the_step_fn():
    def step(model, batch):
        raise ValueError("no such field")

    with pytest.raises(ConfigError, match="fix the model or step_fn"):
        evaluation.evaluate(torch.nn.Linear(4, 3), data(), None, step_fn=step)
