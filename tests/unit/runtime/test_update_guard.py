"""An update that would leave a NaN or an infinity is refused whole: the values and optimizer slots stay as they
were (``runtime.update_guard``)."""

import math

import pytest
import torch

from pscluster.errors import NonFiniteUpdate
from pscluster.runtime import update_guard


def test_plain_sgd_takes_a_finite_update_and_carries_a_bound_of_the_values():
    params, grads = [torch.tensor([1.0, -2.0])], [torch.tensor([0.5, 4.0])]
    bound = update_guard.sgd_step(params, grads, 0.5, None)
    assert torch.equal(params[0], torch.tensor([0.75, -4.0]))
    assert bound >= params[0].abs().max()
    assert update_guard.sgd_step(params, grads, 0.5, bound) >= params[0].abs().max()


@pytest.mark.parametrize("value, grad, lr", [(3e38, -1.0, 1e38), (1.0, math.inf, 0.1), (1.0, math.nan, 0.1),
                                             (6e4, -1e4, 1.0)])
def test_plain_sgd_refuses_an_update_past_the_range_and_changes_nothing(value, grad, lr):
    dtype = torch.float16 if value == 6e4 else torch.float32
    params, grads = [torch.tensor([value, 1.0], dtype=dtype)], [torch.tensor([grad, 0.0], dtype=dtype)]
    before = params[0].clone()
    assert not torch.isfinite(before - lr * grads[0]).all()  # torch's own step would leave an inf or a NaN
    with pytest.raises(NonFiniteUpdate):
        update_guard.sgd_step(params, grads, lr, None)
    assert torch.equal(params[0], before)


def test_largest_is_the_largest_magnitude_and_sees_every_nan_and_infinity():
    tensors = [torch.tensor([1.0, -7.5]), torch.empty(0), torch.tensor([[3.0]], dtype=torch.float16)]
    assert update_guard.largest(tensors) == 7.5
    assert update_guard.largest([]) == update_guard.largest([torch.empty(0)]) == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        mixed = [torch.ones(5), torch.tensor([0.0, bad, 2.0], dtype=torch.bfloat16)]
        assert (math.isnan if bad != bad else math.isinf)(update_guard.largest(mixed)), bad
    assert math.isnan(update_guard.largest([torch.tensor([math.nan, math.inf])]))


def test_magnitude_bound_bounds_every_element_and_sees_every_nan_and_infinity():
    tensors = [torch.tensor([1.0, -7.5]), torch.empty(0), torch.tensor([[3.0]], dtype=torch.float16)]
    assert 7.5 <= update_guard.magnitude_bound(tensors) <= math.sqrt(1 + 7.5 ** 2 + 9) * (1 + 1e-6)
    assert update_guard.magnitude_bound([]) == update_guard.magnitude_bound([torch.empty(0)]) == 0.0
    for bad in (math.nan, math.inf, -math.inf):
        mixed = [torch.ones(5), torch.tensor([0.0, bad, 2.0], dtype=torch.bfloat16)]
        assert (math.isnan if bad != bad else math.isinf)(update_guard.magnitude_bound(mixed)), bad
    # a norm past its dtype's range is no infinity: the elements' own largest magnitude bounds them then
    assert update_guard.magnitude_bound([torch.full((4,), 6e4, dtype=torch.float16)]) == 60000.0


def test_plain_sgd_takes_gradients_whose_norm_alone_leaves_their_dtype():
    params = [torch.zeros(4, dtype=torch.float16)]
    update_guard.sgd_step(params, [torch.full((4,), 6e4, dtype=torch.float16)], 1e-4, None)
    assert torch.isfinite(params[0]).all() and params[0][0] == torch.tensor(-6.0, dtype=torch.float16)


def step_kept(optimizer, param, grad):
    param.grad = grad
    try:
        with update_guard.kept([optimizer]):
            optimizer.step()
    finally:
        param.grad = None


def test_an_optimizer_step_whose_state_would_overflow_is_put_back_whole():
    """Adam's squared gradient of 1e30 overflows float32 while the value it moves stays finite."""
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.Adam([param], lr=0.01)
    step_kept(optimizer, param, torch.tensor([0.1, 0.2]))  # one good step: the state exists
    before = param.detach().clone()
    state = {k: v.clone() for k, v in optimizer.state[param].items()}
    with pytest.raises(NonFiniteUpdate, match="optimizer slot 'exp_avg_sq'"):
        step_kept(optimizer, param, torch.tensor([1e30, 0.2]))
    assert torch.equal(param.detach(), before)
    for k, v in optimizer.state[param].items():
        assert torch.equal(v, state[k]), k
    step_kept(optimizer, param, torch.tensor([0.1, 0.2]))  # and the next finite update is taken as usual
    assert int(optimizer.state[param]["step"]) == 2


def test_a_first_step_refused_leaves_no_optimizer_state():
    param = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = torch.optim.Adam([param], lr=0.01)
    with pytest.raises(NonFiniteUpdate):
        step_kept(optimizer, param, torch.tensor([1e30]))
    assert param not in optimizer.state and torch.equal(param.detach(), torch.tensor([1.0]))


def test_a_sparse_update_keeps_and_puts_back_only_its_rows():
    table = torch.nn.Parameter(torch.arange(10.0).view(5, 2))
    optimizer = torch.optim.Adagrad([table], lr=0.1)
    rows = torch.tensor([[1, 3]])
    step_kept(optimizer, table, torch.sparse_coo_tensor(rows, torch.ones(2, 2), (5, 2)))
    before, total = table.detach().clone(), optimizer.state[table]["sum"].clone()
    with pytest.raises(NonFiniteUpdate):
        step_kept(optimizer, table, torch.sparse_coo_tensor(rows, torch.full((2, 2), 1e30), (5, 2)))
    assert torch.equal(table.detach(), before)
    assert torch.equal(optimizer.state[table]["sum"], total)


def pending_step(optimizer_class, *, value=1.0, grad=0.5, dtype=torch.float32, steps=1, **options):
    """An optimizer of ``optimizer_class`` over one parameter, stepped ``steps - 1`` times with ``grad`` and that
    gradient set again for its next step."""
    param = torch.nn.Parameter(torch.full((4,), value, dtype=dtype))
    optimizer = optimizer_class([param], **options)
    for _ in range(steps - 1):
        param.grad = torch.full_like(param, grad)
        optimizer.step()
    param.grad = torch.full_like(param, grad)
    return optimizer


BOUNDED = [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}),
           (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}), (torch.optim.AdamW, {"lr": 1e-3}),
           (torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5})]


@pytest.mark.parametrize("optimizer_class, options", BOUNDED)
def test_a_step_of_sane_inputs_and_options_is_bounded_and_needs_no_copy(optimizer_class, options):
    assert update_guard.bounded([pending_step(optimizer_class, steps=3, **options)])


@pytest.mark.parametrize("why, optimizer", [
    ("a gradient past SAFE_MAGNITUDE", lambda: pending_step(torch.optim.Adam, grad=1e13, lr=1e-3)),
    ("a value that is NaN", lambda: pending_step(torch.optim.Adam, value=math.nan, lr=1e-3)),
    ("an optimizer outside the bounded ones", lambda: pending_step(torch.optim.NAdam, lr=1e-3)),
    ("centered RMSprop (a square root of a difference)", lambda: pending_step(torch.optim.RMSprop, centered=True)),
    ("a learning rate past 1e2", lambda: pending_step(torch.optim.SGD, lr=1e3)),
    ("an eps below 1e-12", lambda: pending_step(torch.optim.Adam, lr=1e-3, eps=1e-20)),
    ("float16 values", lambda: pending_step(torch.optim.SGD, lr=0.1, momentum=0.9, dtype=torch.float16))])
def test_a_step_the_bounds_do_not_cover_is_kept(why, optimizer):
    assert not update_guard.bounded([optimizer()]), why


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.SGD, {"lr": 1e2, "momentum": 1 - 1e-4, "nesterov": True, "weight_decay": 1e2}),
    (torch.optim.Adam, {"lr": 1e2, "betas": (1 - 1e-4, 1 - 1e-4), "eps": 1e-12, "weight_decay": 1e2}),
    (torch.optim.AdamW, {"lr": 1e2, "betas": (1 - 1e-4, 0.0), "eps": 1e-12, "weight_decay": 1e2, "amsgrad": True}),
    (torch.optim.Adagrad, {"lr": 1e2, "eps": 1e-12, "weight_decay": 1e2, "initial_accumulator_value": 0.0}),
    (torch.optim.RMSprop, {"lr": 1e2, "alpha": 0.0, "eps": 1e-12, "momentum": 1 - 1e-4, "weight_decay": 1e2})])
def test_the_bounds_hold_at_their_extremes(optimizer_class, options):
    """What ``bounded`` lets through without a copy stays finite: the largest inputs and options it allows, of
    either sign and next to zeros (the smallest denominators), in float32."""
    generator = torch.Generator().manual_seed(0)
    extremes = torch.tensor([update_guard.SAFE_MAGNITUDE, -update_guard.SAFE_MAGNITUDE, 0.0, 1e-30])
    param = torch.nn.Parameter(extremes[torch.randint(4, (4096,), generator=generator)])
    optimizer = optimizer_class([param], **options)
    steps = 0
    for _ in range(5):
        param.grad = extremes[torch.randint(4, (4096,), generator=generator)]
        if not update_guard.bounded([optimizer]):
            break  # the values grew past the bound: the next step is kept, as a ps would
        optimizer.step()
        steps += 1
        tensors = [param.detach(), *(v for v in optimizer.state[param].values() if isinstance(v, torch.Tensor))]
        assert all(bool(torch.isfinite(t).all()) for t in tensors), optimizer_class.__name__
    assert steps >= 1
