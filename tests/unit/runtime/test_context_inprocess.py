"""A user's loop (``context.run_loop``) against in-process ps servers: what the library's loop does, a user's
loop can ask for (pipelining), with the same numbers."""

import contextlib
from dataclasses import replace

import pytest
import torch

from pscluster.errors import ConfigError
from pscluster.runtime.context import _run_optimizer_class, loop_plan, run_loop, settings_plan
from pscluster.runtime.options import OPTIONS

from .test_overlap import Wide, plain_wide, trained
from .test_worker_inprocess import (BATCH, LR, RUN_ID, SEED, dataset, delayed_local_training,  # noqa: F401
                                    local_training, mlp, plain_batches)


def user_loop(data, seen: list | None = None):
    """A plain SGD loop in a user's shape; ``seen``: each step's ``optimizer.step()`` result and ``.grad`` after it."""
    def train_fn(ctx):
        torch.manual_seed(SEED)
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        loss_fn = torch.nn.CrossEntropyLoss()
        for x, y in ctx.endless_shard(data, batch_size=BATCH):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            pushed = optimizer.step()
            ctx.log(loss=loss.item())
            if seen is not None:
                seen.append((pushed, model[0].weight.grad))
            if ctx.should_stop():
                break
    return train_fn


class _Planned(BaseException):
    """Ends ``plan_of``'s loop at its first training call."""


def plan_of(train_fn, spec, **settings):
    """The plan ``Cluster.run`` makes of ``train_fn`` on ``spec``: from what its loop registered (as worker 0) by its
    first training call, where it is ended."""
    options = {k: v for k, v in dict(seed=SEED, request_timeout=30.0, **settings).items() if k in OPTIONS}
    fields = {k: v for k, v in settings.items() if k not in OPTIONS}
    made = []

    def planned(*registered):
        made.append(replace(loop_plan(*registered, options, num_ps=len(spec.ps), num_workers=len(spec.workers)),
                            run_id=RUN_ID, **fields))
        raise _Planned

    with contextlib.suppress(_Planned):
        run_loop(spec, 0, replace(settings_plan(options, num_workers=len(spec.workers)), run_id=RUN_ID, **fields),
                 train_fn, planned=planned)
    return made[0]


def test_a_pipelined_user_loop_computes_each_gradient_on_the_values_one_step_older(local_ps, dataset):
    steps = 30
    spec = local_ps.start(num_ps=2, num_workers=1)
    seen = []
    train_fn = user_loop(dataset, seen)
    plan = plan_of(train_fn, spec, mode="async", steps=steps, pipeline=True)
    summary = run_loop(spec, 0, plan, train_fn)

    assert (summary["local_steps"], summary["global_step"], summary["dropped"]) == (steps, steps, 0)
    assert summary["staleness"] == {0: 1, 1: steps - 1}  # the first gradient alone was computed on fresh values
    # each step's gradients left with its push; the last one, computed past the run's end, was not pushed
    assert [pushed for pushed, _ in seen] == [True] * steps + [False]
    assert all(grad is None for _, grad in seen[:-1])
    reply = local_ps.client(spec, run_id=RUN_ID).pull()
    trained = {plan.variables[i].name: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
    for name, value in delayed_local_training(dataset, steps).items():
        assert (trained[name] - value).abs().max() <= 1e-6, name


def test_an_unpipelined_user_loop_loads_the_values_in_its_step(local_ps, dataset):
    steps = 5
    spec = local_ps.start(num_ps=1, num_workers=1)
    seen = []
    train_fn = user_loop(dataset, seen)
    summary = run_loop(spec, 0, plan_of(train_fn, spec, mode="async", steps=steps), train_fn)
    assert summary["staleness"] == {0: steps} and len(seen) == steps
    assert all(pushed and grad is not None for pushed, grad in seen)  # the loop's gradients stay its own


def test_pipeline_needs_async_and_one_optimizer(local_ps, dataset):
    spec = local_ps.start(num_ps=1, num_workers=1)
    with pytest.raises(ConfigError, match="pipeline=True with mode='sync': use mode='async'"):
        plan_of(user_loop(dataset), spec, mode="sync", steps=5, pipeline=True)

    def two_optimizers(ctx):
        a, b = ctx.model(torch.nn.Linear(2, 2), name="a"), ctx.model(torch.nn.Linear(2, 2), name="b")
        ctx.optimizer(torch.optim.SGD(a.parameters(), lr=0.1))
        ctx.optimizer(torch.optim.SGD(b.parameters(), lr=0.1))
        ctx.should_stop()
    with pytest.raises(ConfigError, match="pipeline=True with several optimizers"):
        plan_of(two_optimizers, spec, mode="async", steps=5, pipeline=True)


# --- overlap=True: a user loop's pushes leave during backward -----------------------------------------------


def wide_loop(data, *, micro_batches: int = 1, no_sync: bool = True, clip: bool = False):
    """``Wide`` with Adam in a user's loop, its optimizer registered with overlap=True: each batch in
    ``micro_batches`` accumulated (the ones before the last under ``ctx.no_sync()`` where ``no_sync``), clipped
    after backward where ``clip``."""
    def train_fn(ctx):
        torch.manual_seed(SEED)
        model = ctx.model(Wide().to(ctx.device))
        optimizer = ctx.optimizer(torch.optim.Adam(model.parameters(), lr=0.001), overlap=True)
        for x, y in ctx.endless_shard(data, batch_size=BATCH):
            optimizer.zero_grad()
            for k, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
                held = ctx.no_sync() if no_sync and k < micro_batches - 1 else contextlib.nullcontext()
                with held:
                    (torch.nn.functional.cross_entropy(model(xs), ys) / micro_batches).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if ctx.should_stop():
                break
    return train_fn


def plain_accumulated(data, steps: int, micro_batches: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = Wide()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    for x, y in plain_batches(data, steps):
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (torch.nn.functional.cross_entropy(model(xs), ys) / micro_batches).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_user_loop_with_overlap_pushes_during_backward_and_trains_as_plain_torch(local_ps, dataset,
                                                                                   micro_batches):
    steps = 6
    spec = local_ps.start(num_ps=1, num_workers=1)
    train_fn = wide_loop(dataset, micro_batches=micro_batches)
    plan = plan_of(train_fn, spec, mode="sync", steps=steps, shared_memory=False)
    summary = run_loop(spec, 0, plan, train_fn)
    assert summary["global_step"] == steps and summary["overlapped_pushes"] == steps
    got = trained(local_ps, spec, plan)
    for name, value in plain_accumulated(dataset, steps, micro_batches).items():
        assert (got[f"{name}"].to(value.dtype) - value).abs().max() <= 1e-6, name


@pytest.mark.parametrize("loop, message", [
    (dict(clip=True), "the gradient of .* changed after backward had pushed it: clip with max_grad_norm="),
    (dict(micro_batches=2, no_sync=False), "backward produced the gradient of .* twice before step()"),
], ids=["clipped after backward", "accumulated without no_sync"])
def test_a_user_loop_with_overlap_that_changes_a_pushed_gradient_fails_with_the_fix(local_ps, dataset, loop,
                                                                                    message):
    spec = local_ps.start(num_ps=1, num_workers=1)
    train_fn = wide_loop(dataset, **loop)
    plan = plan_of(train_fn, spec, mode="async", steps=3, shared_memory=False)  # no early push: checked anyway
    with pytest.raises(ConfigError, match=message):
        run_loop(spec, 0, plan, train_fn)


def test_overlap_with_several_optimizers_is_refused_at_registration(local_ps):
    def train_fn(ctx):
        a, b = ctx.model(torch.nn.Linear(2, 2), name="a"), ctx.model(torch.nn.Linear(2, 2), name="b")
        ctx.optimizer(torch.optim.SGD(a.parameters(), lr=0.1), overlap=True)
        ctx.optimizer(torch.optim.SGD(b.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"overlap=True\) with several optimizers"):
        plan_of(train_fn, local_ps.start(num_ps=1, num_workers=1), mode="async", steps=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_a_gpu_user_loop_with_overlap_copies_its_gradients_to_the_host_during_backward(local_ps, dataset):
    steps = 10
    spec = local_ps.start(num_ps=1, num_workers=1)
    spec = replace(spec, workers=tuple(replace(w, device="cuda:0") for w in spec.workers))
    train_fn = wide_loop(dataset)
    plan = plan_of(train_fn, spec, mode="sync", steps=steps)
    summary = run_loop(spec, 0, plan, train_fn)
    assert summary["global_step"] == steps and summary["staged_steps"] == steps
    got = trained(local_ps, spec, plan)
    for name, value in plain_wide(dataset, steps, device="cuda").items():
        assert (got[name].to(value.dtype) - value.cpu()).abs().max() <= 1e-4, name


def test_a_loop_that_sets_a_nan_lr_fails_that_step_and_the_ps_keeps_the_values_before_it(local_ps, dataset):
    spec = local_ps.start(num_ps=1, num_workers=1)

    def train_fn(ctx):
        torch.manual_seed(SEED)
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        for k, (x, y) in enumerate(ctx.endless_shard(dataset, batch_size=BATCH)):
            if k == 2:
                optimizer.param_groups[0]["lr"] = float("nan")  # a schedule gone wrong
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if ctx.should_stop():
                break

    plan = plan_of(train_fn, spec, mode="sync", steps=10)
    with pytest.raises(ConfigError, match="param group 0 of SGD has lr=nan: the loop"):
        run_loop(spec, 0, plan, train_fn)
    reply = local_ps.client(spec, run_id=RUN_ID).pull()
    assert reply.step == 2
    held = {plan.variables[i].name: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
    for name, value in local_training(dataset, 2).state_dict().items():
        assert (held[name] - value).abs().max() <= 1e-6, name


def test_a_run_optimizers_zero_grad_does_what_torchs_does():
    """Gradients None (zeros with set_to_none=False), torch's profiler label while a profiler records, and the
    zero_grad of a class that has its own."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.__class__ = _run_optimizer_class(torch.optim.SGD)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with torch.autograd.profiler.profile(use_kineto=False) as profiled:  # kineto's first start takes a second
        optimizer.zero_grad()
    assert any(e.name.endswith("SGD.zero_grad") for e in profiled.function_events)

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    assert _run_optimizer_class(Own).zero_grad is Own.zero_grad
