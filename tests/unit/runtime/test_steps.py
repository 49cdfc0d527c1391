"""The training step's contract in one process: batch structures, the default step, step_fn results, the
non-finite check and fp16's loss scale."""

from collections import namedtuple

import pytest
import torch
from torch import nn

from pscluster.errors import ConfigError
from pscluster.runtime.steps import Precision, compute, forward, grad_norm, metric_values, nonfinite, samples_in, \
    to_device

Pair = namedtuple("Pair", "image label")


def test_to_device_rebuilds_every_container_and_leaves_other_values():
    batch = {"x": (torch.zeros(2, 3), [torch.ones(2)]), "pair": Pair(torch.zeros(2), 1), "name": "digits"}
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "meta"
    assert isinstance(moved["pair"], Pair) and moved["pair"].image.device.type == "meta" and moved["pair"].label == 1
    assert moved["name"] == "digits" and isinstance(moved["x"], tuple) and isinstance(moved["x"][1], list)


@pytest.mark.parametrize("batch, n", [(torch.zeros(5, 2), 5), ({"a": "text", "b": [torch.zeros(3)]}, 3),
                                      ((torch.tensor(1.0),), 1), ({"a": 1}, 0)])
def test_samples_in_counts_the_first_tensors_rows(batch, n):
    assert samples_in(batch) == n


class Two(nn.Module):
    def forward(self, a, b):
        return a + b


def test_the_default_step_unpacks_tuple_and_dict_inputs():
    target = torch.zeros(2)
    for inputs in ((torch.ones(2), torch.ones(2)), {"a": torch.ones(2), "b": torch.ones(2)}):
        loss, output, got_target, metrics = forward(Two(), nn.functional.mse_loss, None, (inputs, target))
        assert loss.item() == 4.0 and torch.equal(output, torch.full((2,), 2.0)) and got_target is target
        assert metrics == {}


@pytest.mark.parametrize("result, problem", [
    ((1.0, {}), "step_fn returned tuple: return the loss"),
    (torch.zeros(2), "step_fn returned Tensor"),
    ((torch.zeros(()), [1]), "step_fn's metrics are a list"),
])
def test_a_step_fn_result_that_is_not_a_loss_is_refused(result, problem):
    with pytest.raises(ConfigError, match=problem):
        forward(nn.Linear(1, 1), None, lambda model, batch: result, None)


def test_metrics_must_be_single_numbers():
    assert metric_values({"a": torch.tensor(0.5), "b": 2}) == {"a": 0.5, "b": 2.0}
    with pytest.raises(ConfigError, match="metric 'v' of step_fn has shape \\(2,\\): return one number"):
        metric_values({"v": torch.zeros(2)})
    with pytest.raises(ConfigError, match="metric 'name' of step_fn is a str"):
        metric_values({"name": "x"})


def computed_with(model, loss=1.0):
    return compute(model, lambda out, y: out.sum() * 0 + loss, None, (torch.ones(2, 3), torch.zeros(2)),
                   torch.device("cpu"), 0)


def test_nonfinite_names_the_loss_or_the_first_parameter_whose_gradient_is_not_finite():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    computed = computed_with(model)
    assert nonfinite(computed.loss, grad_norm(model), list(model.named_parameters())) is None
    model[1].weight.grad[0, 0] = float("inf")  # an overflow in backward: the loss itself is finite
    assert nonfinite(computed.loss, grad_norm(model), list(model.named_parameters())) == "gradient of 1.weight"
    named = list(model.named_parameters())
    assert nonfinite(computed_with(model, float("nan")).loss, grad_norm(model), named) == "loss nan"


def test_a_sparse_gradient_is_checked_too():
    model = nn.Embedding(10, 2, sparse=True)
    model(torch.tensor([1, 2])).sum().backward()
    computed = computed_with(nn.Linear(3, 1))
    assert nonfinite(computed.loss, grad_norm(model), list(model.named_parameters())) is None
    model.weight.grad = torch.sparse_coo_tensor([[1]], [[float("nan"), 0.0]], (10, 2))
    assert nonfinite(computed.loss, grad_norm(model), list(model.named_parameters())) == "gradient of weight"


def test_clipping_is_torchs_clip_grad_norm():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert grad_norm(model, 0.5).item() == pytest.approx(total.item())
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped.item() == pytest.approx(0.5, rel=1e-4)


def test_fp16_loss_scale_halves_at_an_overflow_and_doubles_after_a_run_of_good_steps():
    precision = Precision("fp16", torch.device("cpu"))
    assert precision.scale == 2.0 ** 16 and precision.dtype is torch.float16
    assert precision.overflowed(False) and precision.scale == 2.0 ** 15
    for _ in range(Precision.GROWTH_INTERVAL - 1):
        assert not precision.overflowed(True)
    assert precision.scale == 2.0 ** 15
    assert not precision.overflowed(True) and precision.scale == 2.0 ** 16
    model = nn.Linear(2, 1)
    precision.backward(model(torch.ones(1, 2)).sum(), model)
    assert torch.allclose(model.weight.grad, torch.ones(1, 2))  # unscaled
    assert not Precision("bf16", torch.device("cpu")).overflowed(False)  # bf16 has no loss scale
