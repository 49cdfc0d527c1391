"""The run's end is the loop's end, both ways (``context``): a loop that returns leaves the run, which ends when every
worker's loop has; the run's end ends ``ctx.shard``'s iteration, and a step after it raises ``RunEnded``."""

import threading

import pytest
import torch
from torch.utils.data import TensorDataset

from pscluster.errors import RunEnded
from pscluster.runtime.context import run_loop

from .test_context_inprocess import plan_of
from .test_worker_inprocess import LR, SEED, mlp

ITEMS, BATCH = 96, 16  # 6 batches an epoch on one worker, 3 on each of two


@pytest.fixture(scope="module")
def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ITEMS, 64, generator=generator), torch.randint(0, 10, (ITEMS,),
                                                                                   generator=generator))


def epochs_loop(data, epochs_of=lambda ctx: 2, seen: list | None = None):
    """A plain epoch loop: ``epochs_of(ctx)`` epochs of ``ctx.shard``, no step target, no ``should_stop()``."""
    def train_fn(ctx):
        torch.manual_seed(SEED)
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        loader = ctx.shard(data, batch_size=BATCH)
        for _ in range(epochs_of(ctx)):
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if seen is not None:
                    seen.append(ctx.worker_index)
    return train_fn


def test_a_loop_without_a_step_target_trains_its_epochs_and_ends_the_run(local_ps, data):
    spec = local_ps.start(num_ps=1, num_workers=1)
    train_fn = epochs_loop(data)
    summary = run_loop(spec, 0, plan_of(train_fn, spec, mode="sync", steps=None), train_fn)
    assert (summary["local_steps"], summary["global_step"]) == (12, 12)
    stats = local_ps.client(spec).stats()
    assert stats[0]["step"] == 12


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sync_worker_whose_loop_returns_first_leaves_without_stalling_the_other(local_ps, data, mode):
    spec = local_ps.start(num_ps=2, num_workers=2)
    seen = []
    train_fn = epochs_loop(data, epochs_of=lambda ctx: 1 + 2 * ctx.worker_index, seen=seen)  # 1 and 3 epochs
    plan = plan_of(train_fn, spec, mode=mode, steps=None)
    summaries = [None, None]

    def worker(i):
        summaries[i] = run_loop(spec, i, plan, train_fn)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker waited on one whose loop had returned"
    assert [s["local_steps"] for s in summaries] == [3, 9]
    # sync: 3 steps of both workers' gradients, then 6 of worker 1's alone; async: one step a push. The ps is asked,
    # not a worker's summary: in async a worker's last push may land before the other's last one.
    assert local_ps.client(spec).stats()[0]["step"] == (9 if mode == "sync" else 12)


def test_the_run_s_target_ends_the_epoch_and_a_step_after_it_raises_run_ended(local_ps, data):
    spec = local_ps.start(num_ps=1, num_workers=1)
    batches, raised = [], []

    def train_fn(ctx):
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        loader = ctx.shard(data, batch_size=BATCH)
        for x, y in loader:  # 6 batches; the target is 4 steps
            batches.append(ctx.global_step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        try:
            for _ in loader:  # an epoch begun after the end: a loop over epochs without end would spin
                pass
        except RunEnded as e:
            raised.append(e.reason)
        try:
            optimizer.step()  # a loop that goes on after the end
        except RunEnded as e:
            raised.append(e.reason)
            raise

    summary = run_loop(spec, 0, plan_of(train_fn, spec, mode="sync", steps=4), train_fn)
    assert batches == [0, 1, 2, 3] and summary["global_step"] == 4 and summary["local_steps"] == 4
    assert raised == ["its target of 4 global steps reached"] * 2  # and run_loop took it as the loop's end


def test_a_module_registered_after_an_optimizer_trains_with_the_others(local_ps, data):
    """A GAN's shape: one module and its optimizer, then the other and its own. Registering the second renames the
    first one's parameters (``<name>.<parameter>``): the plan is made from the final set, and every batch trains."""
    spec = local_ps.start(num_ps=1, num_workers=1)

    def train_fn(ctx):
        a = ctx.model(torch.nn.Linear(64, 10), name="a")
        opt_a = ctx.optimizer(torch.optim.SGD(a.parameters(), lr=LR))
        b = ctx.model(torch.nn.Linear(64, 10), name="b")
        opt_b = ctx.optimizer(torch.optim.SGD(b.parameters(), lr=LR))
        for x, y in ctx.shard(data, batch_size=BATCH):
            for net, optimizer in ((a, opt_a), (b, opt_b)):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()

    plan = plan_of(train_fn, spec, mode="sync", steps=None)
    assert [p.groups[0]["params"] for p in plan.optimizer_specs] == [["a.weight", "a.bias"], ["b.weight", "b.bias"]]
    assert run_loop(spec, 0, plan, train_fn)["local_steps"] == ITEMS // BATCH
