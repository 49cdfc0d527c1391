"""The divergence rule (``metrics.divergence``) on the losses of real training: plain torch runs of the digits MLP
with a sane and a far too large learning rate, and losses of other scales and signs."""

import functools
import math

import pytest
import torch

from pscluster.datasets import digits
from pscluster.metrics.divergence import PATIENCE, REFERENCE_REPORTS, DivergenceWatch


@functools.cache
def losses_of(lr: float, steps: int = 400) -> tuple[float, ...]:
    """The per-step losses of the digits MLP trained by a plain loop with SGD at ``lr`` (one torch thread: a
    second only waits for the first on a loaded machine, at this size)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _losses(lr, steps)
    finally:
        torch.set_num_threads(threads)


def _losses(lr: float, steps: int) -> tuple[float, ...]:
    torch.manual_seed(0)
    x, y = digits("train").tensors()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        batch = slice((step * 32) % (len(x) - 32), (step * 32) % (len(x) - 32) + 32)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return tuple(losses)


def watch(losses) -> DivergenceWatch:
    w = DivergenceWatch()
    for step, loss in enumerate(losses, 1):
        w.add(step, loss)
    return w


@pytest.mark.parametrize("lr", [0.1, 5.0])  # 5.0: a noisy run, its loss up to 3 times its start's, settling
def test_a_run_that_trains_is_never_flagged(lr):
    assert watch(losses_of(lr)).found is None


@pytest.mark.parametrize("lr", [50.0, 1e6])  # the loss about 8 and 2e5 times its start's, never infinite
def test_a_run_whose_loss_explodes_and_stays_is_flagged_since_it_rose(lr):
    losses = losses_of(lr)
    assert all(math.isfinite(v) for v in losses), "the test wants a finite, diverged loss"
    found = watch(losses).found
    assert found is not None and REFERENCE_REPORTS < found.since_step <= 2 * PATIENCE
    assert found.loss > found.threshold and "diverging since step" in found.line()


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4, -1.0])
def test_the_rule_follows_the_loss_s_own_scale_and_sign(scale):
    settled = [scale * (1 + 0.1 * math.sin(i)) for i in range(400)]
    assert watch(settled).found is None  # noise around its level
    risen = settled[:100] + [scale + 20 * abs(scale) + 1e-2] * 200
    found = watch(risen).found
    assert found is not None and found.since_step > 100


def test_a_spike_that_comes_back_down_is_not_divergence():
    spiky = [1.0] * 100 + [50.0] * 20 + [1.0] * 300
    assert watch(spiky).found is None
