"""One step body: ``Cluster.train``'s loop is a ``train_fn`` on the public context, and the rules of precision,
clipping and non-finite values are the context's (``ctx.autocast``, ``ctx.backward``, ``optimizer.step()``), the same
for a user's loop."""

import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

import pscluster
from pscluster.errors import ConfigError, NonFiniteError
from pscluster.runtime.context import run_loop
from pscluster.runtime.steps import MAX_SKIPS, GradientRules, Precision

from .test_context_inprocess import plan_of
from .test_worker_inprocess import BATCH, LR, SEED, dataset, mlp, plain_batches  # noqa: F401


def test_no_module_but_the_context_reaches_into_a_context():
    package = pathlib.Path(pscluster.__file__).parent
    reaching = [f"{path.relative_to(package)}:{n}" for path in sorted(package.rglob("*.py"))
                if path != package / "runtime" / "context.py"
                for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\bctx\._", line)]
    assert reaching == []


# --- the rules, alone -----------------------------------------------------------------------------------------


def rules_with(precision="fp32", **plan):
    events = []
    rules = GradientRules(Precision(precision, torch.device("cpu")), 3, lambda kind, **f: events.append((kind, f)))
    return rules, SimpleNamespace(**{"max_grad_norm": None, "on_nonfinite": "fail", **plan}), events


def gradients(value: float):
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = value
    return list(model.parameters()), list(model.named_parameters())


def test_a_nonfinite_loss_fails_the_step_even_where_its_gradients_are_finite():
    rules, plan, _ = rules_with()
    params, named = gradients(1.0)
    assert rules.passes(plan, torch.tensor(0.5), params, named, scaled=False, step=4, local_step=2)
    with pytest.raises(NonFiniteError, match=r"worker 3 computed a non-finite loss nan at global step 4 \(its local "
                                             r"step 3\): .* on_nonfinite='skip'"):
        rules.passes(plan, torch.tensor(float("nan")), params, named, scaled=False, step=4, local_step=2)


def test_skip_leaves_steps_out_until_max_skips_in_a_row():
    rules, plan, events = rules_with(on_nonfinite="skip")
    params, named = gradients(float("inf"))
    for k in range(MAX_SKIPS):
        assert not rules.passes(plan, None, params, named, scaled=False, step=7, local_step=k)
    assert rules.skipped == MAX_SKIPS and events[0] == ("nonfinite", dict(global_step=7, local_step=1,
                                                                          problem="gradient of weight"))
    with pytest.raises(NonFiniteError, match=f"after skipping {MAX_SKIPS} batches"):
        rules.passes(plan, None, params, named, scaled=False, step=7, local_step=MAX_SKIPS)
    rules, plan, _ = rules_with(on_nonfinite="skip")
    assert not rules.passes(plan, None, params, named, scaled=False, step=7, local_step=0)
    params, named = gradients(1.0)
    assert rules.passes(plan, None, params, named, scaled=False, step=7, local_step=0)  # the count starts again


def test_an_fp16_overflow_halves_the_scale_and_leaves_the_step_out_without_failing():
    rules, plan, events = rules_with("fp16")  # on_nonfinite="fail": an overflow is no failure
    params, named = gradients(float("inf"))
    assert not rules.passes(plan, None, params, named, scaled=True, step=1, local_step=0)
    assert rules.precision.scale == 2.0 ** 15 and rules.skipped == 0
    assert events == [("loss_scale", dict(global_step=1, scale=2.0 ** 15, problem="gradient of weight"))]
    with pytest.raises(NonFiniteError):  # unscaled gradients are the rule of on_nonfinite
        rules.passes(plan, None, params, named, scaled=False, step=1, local_step=0)


def test_clipping_is_applied_to_the_gradients_that_go():
    rules, plan, _ = rules_with(max_grad_norm=0.5)
    params, named = gradients(3.0)
    assert rules.passes(plan, None, params, named, scaled=False, step=0, local_step=0)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    assert total.item() == pytest.approx(0.5, rel=1e-4)


# --- a user's loop on the context's rules ---------------------------------------------------------------------


def amp_loop(data, *, poisoned_step: int | None = None, seen: list | None = None):
    """SGD on ``mlp`` with the run's precision (``ctx.autocast``, ``ctx.backward``); at ``poisoned_step`` a loss that
    is not finite though its gradients are; ``seen``: what each ``optimizer.step()`` returned."""
    def train_fn(ctx):
        torch.manual_seed(SEED)
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        for k, (x, y) in enumerate(ctx.endless_shard(data, batch_size=BATCH)):
            optimizer.zero_grad()
            with ctx.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            if k == poisoned_step:
                loss = loss + torch.tensor(float("nan"))  # no gradient of its own
            ctx.backward(loss)
            pushed = optimizer.step()
            if seen is not None:
                seen.append(pushed)
            if ctx.should_stop():
                break
    return train_fn


def plain_amp(data, steps: int, dtype) -> dict[str, torch.Tensor]:
    """The same in plain torch: forward under ``torch.autocast(dtype)``, each gradient rounded to ``dtype`` (what
    the worker pushes), SGD on fp32 values (the ps's)."""
    torch.manual_seed(SEED)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in plain_batches(data, steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            p.grad = p.grad.to(dtype).float()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def test_a_user_loop_on_ctx_autocast_and_backward_trains_in_the_runs_precision(local_ps, dataset):
    steps = 6
    spec = local_ps.start(num_ps=1, num_workers=1)
    train_fn = amp_loop(dataset)
    plan = plan_of(train_fn, spec, mode="sync", steps=steps, precision="bf16")
    assert run_loop(spec, 0, plan, train_fn)["global_step"] == steps
    reply = local_ps.client(spec, run_id=plan.run_id).pull()
    got = {plan.variables[i].name: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
    fp32 = plain_amp(dataset, steps, torch.float32)
    for name, value in plain_amp(dataset, steps, torch.bfloat16).items():
        assert (got[name] - value).abs().max() <= 1e-6, name
        assert (got[name] - fp32[name]).abs().max() > 1e-6, name  # bf16 made a difference


def test_a_user_loop_skips_a_step_whose_loss_given_to_backward_is_not_finite(local_ps, dataset):
    steps = 5
    spec = local_ps.start(num_ps=1, num_workers=1)
    seen = []
    train_fn = amp_loop(dataset, poisoned_step=2, seen=seen)
    plan = plan_of(train_fn, spec, mode="sync", steps=steps, on_nonfinite="skip")
    summary = run_loop(spec, 0, plan, train_fn)
    assert seen[:3] == [True, True, False] and summary["skipped"] == 1 and summary["global_step"] == steps
    train_fn = amp_loop(dataset, poisoned_step=2)
    spec = local_ps.start(num_ps=1, num_workers=1)
    with pytest.raises(NonFiniteError, match="non-finite loss nan at global step 2"):
        run_loop(spec, 0, plan_of(train_fn, spec, mode="sync", steps=steps), train_fn)


def test_the_plans_own_optimizer_is_cluster_trains_alone(local_ps):
    def train_fn(ctx):
        ctx.model(torch.nn.Linear(2, 2))
        ctx.optimizer()
    with pytest.raises(ConfigError, match=r"ctx.optimizer\(\) without an optimizer: give your loop's torch"):
        plan_of(train_fn, local_ps.start(num_ps=1, num_workers=1), mode="sync", steps=3)


class Noisy(torch.utils.data.Dataset):
    """The digits with noise drawn from torch's generator as each item is read; ``during_step``: for each read,
    whether the loop was in ``optimizer.step()`` then."""

    def __init__(self, data):
        self.x, self.y = data.tensors()
        self.stepping, self.during_step = False, []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.during_step.append(self.stepping)
        return self.x[i] + torch.rand(()), self.y[i]


def noisy_loop(noisy: Noisy, seen: list, always: bool):
    """SGD over ``noisy``'s stream (``always_read_ahead=always``); ``seen``: each batch's sum."""
    def train_fn(ctx):
        torch.manual_seed(SEED)
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        for x, y in ctx.endless_shard(noisy, batch_size=BATCH, always_read_ahead=always):
            seen.append(x.sum().item())
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            noisy.stepping = True
            optimizer.step()
            noisy.stepping = False
            if ctx.should_stop():
                break
    return train_fn


def test_always_read_ahead_reads_drawing_batches_during_the_exchange_and_the_same_ones(local_ps, dataset):
    seen, during = {}, {}
    for always in (False, True):
        noisy, seen[always] = Noisy(dataset), []
        train_fn = noisy_loop(noisy, seen[always], always)
        spec = local_ps.start(num_ps=1, num_workers=1)
        plan = plan_of(train_fn, spec, mode="sync", steps=4)
        noisy.during_step = []  # the reads of the loop as the chief that made the plan
        run_loop(spec, 0, plan, train_fn)
        during[always] = noisy.during_step
    assert len(seen[True]) == 4 and seen[True] == seen[False]  # the same draws in the same order
    assert not any(during[False])  # reads that draw are left to the loop's own order
    assert during[True][:BATCH] == [False] * BATCH and all(during[True][BATCH:])  # the first before the run
