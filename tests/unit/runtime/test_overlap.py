"""Sync overlap (``overlap``): pushes that leave during backward, over the socket, against in-process ps servers,
compared with plain torch and with the same run pushing after backward."""

import pytest
import torch

from pscluster.errors import NonFiniteError
from pscluster.runtime.overlap import MIN_BYTES, EarlyPush
from pscluster.runtime.plan import TrainPlan, describe_variables
from pscluster.runtime.seeding import build_model
from pscluster.runtime.worker import run_worker

from .test_worker_inprocess import RUN_ID, SEED, dataset, plain_batches, run_workers  # noqa: F401 - a fixture

BATCH = 32
POISON = 99.0  # an input whose first feature is this gets NaN gradients from the middle layer down, a finite loss


class PoisonGrad(torch.autograd.Function):
    """The identity, whose gradient is NaN for a batch holding a sample marked ``POISON``."""

    @staticmethod
    def forward(ctx, h, x):
        ctx.poisoned = bool((x[:, 0] == POISON).any())
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad * float("nan") if ctx.poisoned else grad), None


class Wide(torch.nn.Module):
    """An MLP of 8.4 MB on the digits, its layers declared in another order than forward uses them (backward's
    order is not the model's); the gradients from the 8 MB middle layer down pass through ``PoisonGrad``."""

    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(2048, 10)
        self.hidden = torch.nn.Linear(1024, 2048)
        self.norm = torch.nn.BatchNorm1d(1024)
        self.first = torch.nn.Linear(64, 1024, bias=False)  # BatchNorm follows (Adam would amplify the noise of a
        # bias gradient that BatchNorm makes zero)

    def forward(self, x):
        h = torch.relu(self.norm(self.first(x)))
        return self.out(PoisonGrad.apply(torch.relu(self.hidden(h)), x))


def plan_for(spec, *, steps, partition=None, **settings) -> TrainPlan:
    """A sync run of ``Wide`` with Adam over the socket (no shared-memory lane), ``settings`` changed."""
    model = build_model(Wide, SEED)
    fields = dict(run_id=RUN_ID, mode="sync", steps=steps, batch_size=BATCH, optimizer="adam",
                  optimizer_kwargs={"lr": 0.001}, replicas_to_aggregate=len(spec.workers),
                  num_workers=len(spec.workers), seed=SEED, request_timeout=30.0, shared_memory=False)
    return TrainPlan.of(variables=describe_variables(model, len(spec.ps), partition=partition),
                        **{**fields, **settings})


def plain_wide(dataset, steps: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The same training in one process: plain torch, Adam."""
    torch.manual_seed(SEED)
    model = Wide().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    for x, y in plain_batches(dataset, steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    return model.state_dict()


def trained(local_ps, spec, plan) -> dict[str, torch.Tensor]:
    reply = local_ps.client(spec, run_id=RUN_ID).pull()
    return {plan.variables[i].name: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}


def test_the_model_is_large_enough_to_push_during_backward():
    assert sum(t.numel() * t.element_size() for t in Wide().parameters()) >= MIN_BYTES


@pytest.mark.parametrize("overlap", [True, False])
def test_a_worker_pushing_during_backward_trains_as_plain_torch(local_ps, dataset, overlap):
    steps = 50  # across an epoch boundary (a short last batch)
    spec = local_ps.start(num_ps=1, num_workers=1)
    plan = plan_for(spec, steps=steps, overlap=overlap)
    summary = run_worker(spec, 0, plan, Wide, dataset, torch.nn.CrossEntropyLoss())
    assert summary["global_step"] == steps and summary["overlapped_pushes"] == (steps if overlap else 0)
    got, expected = trained(local_ps, spec, plan), plain_wide(dataset, steps)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert (got[name].to(value.dtype) - value).abs().max() <= 1e-6, name


def test_two_sync_workers_on_two_ps_take_the_same_steps_with_and_without_overlap(local_ps, dataset):
    """The middle layer's weight is split across both ps (4 MB each): both pushes leave during backward."""
    steps = 15
    results = {}
    for overlap in (True, False):
        spec = local_ps.start(num_ps=2, num_workers=2)
        plan = plan_for(spec, steps=steps, overlap=overlap, partition={"hidden.weight": 2})
        summaries = run_workers(spec, plan, dataset, build_model(Wide, SEED))
        assert [s["overlapped_pushes"] for s in summaries.values()] == ([steps, steps] if overlap else [0, 0])
        results[overlap] = trained(local_ps, spec, plan)
    for name, value in results[False].items():
        assert (results[True][name] - value).abs().max() <= 1e-6, name


@pytest.mark.parametrize("settings", [{"max_grad_norm": 1.0}, {"on_nonfinite": "skip"}, {"mode": "async"},
                                      {"overlap": False}, {"shared_memory": True}],
                         ids=lambda s: next(iter(s)))
def test_no_push_during_backward_where_a_push_could_change_after_it_or_has_nothing_to_overlap(local_ps, dataset,
                                                                                            settings):
    spec = local_ps.start(num_ps=1, num_workers=1)
    plan = plan_for(spec, steps=3, **settings)
    summary = run_worker(spec, 0, plan, Wide, dataset, torch.nn.CrossEntropyLoss())
    assert summary["global_step"] == 3 and summary["overlapped_pushes"] == 0
    assert EarlyPush.applies(plan, torch.device("cpu")) is ("shared_memory" in settings)  # a lane: nothing to do


def test_a_nonfinite_gradient_never_leaves_and_the_step_is_not_applied(local_ps, dataset):
    """The middle layer's gradient (8 MB: a part of its own) is NaN, the last layer's before it finite: the NaN
    bytes never leave, and the run fails at that step as without overlap, with the parameters of the step
    before."""
    x, y = dataset.tensors()
    poisoned = torch.utils.data.TensorDataset(x.clone(), y)
    marked = list(plain_batches(poisoned, 3))[2][0][0]  # the first sample of the third batch: global step 2
    poisoned.tensors[0][int((x == marked).all(dim=1).nonzero()[0]), 0] = POISON
    spec = local_ps.start(num_ps=1, num_workers=1)
    plan = plan_for(spec, steps=10)
    with pytest.raises(NonFiniteError, match="non-finite gradient of hidden.weight at global step 2"):
        run_worker(spec, 0, plan, Wide, poisoned, torch.nn.CrossEntropyLoss())
    stats = local_ps.client(spec, run_id=RUN_ID).stats()[0]
    assert stats["step"] == 2 and stats["applied"] == 2
    push = sum(t.numel() * t.element_size() for t in Wide().state_dict().values())
    assert 3 * push < stats["bytes_in"] < 3.5 * push  # the INIT and two pushes: the third never took the 8 MB
    got, expected = trained(local_ps, spec, plan), plain_wide(poisoned, 2)
    for name, value in expected.items():
        assert torch.isfinite(got[name]).all() and (got[name].to(value.dtype) - value).abs().max() <= 1e-6, name
