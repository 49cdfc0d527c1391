"""Partitioned and sparse variables, and bounded staleness, against in-process ps servers."""

import threading

import pytest
import torch
from torch.utils.data import TensorDataset

from pscluster.errors import ConfigError
from pscluster.metrics.collector import Collector
from pscluster.runtime.plan import TrainPlan, assemble, describe_variables
from pscluster.runtime.waiting import wait_until
from pscluster.runtime.seeding import build_model
from pscluster.runtime.worker import run_worker

from .test_worker_inprocess import RUN_ID, mlp, plain_batches

SEED = 5
BATCH = 16
VOCAB, DIM, BAG = 60, 8, 4


class BagModel(torch.nn.Module):
    """A sparse embedding bag, then a dense layer: the shape of a click-through model."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.out(self.embedding(ids)).squeeze(1)


@pytest.fixture(scope="module")
def bags():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (400, BAG), generator=g)
    labels = (ids.remainder(3) == 0).float().mean(1).gt(0.3).float()
    return TensorDataset(ids, labels)


OPTIMIZERS = {"sgd": (("sgd", {"lr": 0.1}), lambda dense, sparse: [torch.optim.SGD(dense + sparse, lr=0.1)]),
              "adagrad": (("adagrad", {"lr": 0.1}), lambda d, s: [torch.optim.Adagrad(d + s, lr=0.1)]),
              "adam": (("adam", {"lr": 0.01}), lambda d, s: [torch.optim.Adam(d, lr=0.01),
                                                              torch.optim.SparseAdam(s, lr=0.01)])}


def make_plan(spec, model_fn, *, steps, optimizer=("sgd", {"lr": 0.1}), mode="sync", partition=None,
              placement="round_robin", staleness_bound=2, metrics_address=None) -> TrainPlan:
    model = build_model(model_fn, SEED)
    return TrainPlan.of(run_id=RUN_ID, mode=mode, steps=steps, batch_size=BATCH, optimizer=optimizer[0],
                     optimizer_kwargs=optimizer[1], replicas_to_aggregate=1,
                     num_workers=len(spec.workers), staleness_bound=staleness_bound,
                     variables=describe_variables(model, len(spec.ps), placement, partition), seed=SEED,
                     metrics_address=metrics_address, request_timeout=30.0)


def plain_training(dataset, steps, make_optimizers) -> dict[str, torch.Tensor]:
    """The same run in one process with plain torch (sparse gradients, torch's own optimizers)."""
    model = build_model(BagModel, SEED)
    optimizers = make_optimizers([model.out.weight, model.out.bias], [model.embedding.weight])
    for x, y in plain_batches(dataset, steps, BATCH, SEED):
        for o in optimizers:
            o.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        for o in optimizers:
            o.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def trained(local_ps, spec, plan) -> dict[str, torch.Tensor]:
    reply = local_ps.client(spec, run_id=RUN_ID).pull_all()
    return assemble(plan.variables, reply.messages)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("num_ps, partition", [(1, None), (2, {"embedding": 2}), (3, {"embedding": 5})])
def test_sparse_partitioned_embedding_trains_like_plain_torch(local_ps, bags, optimizer, num_ps, partition):
    steps = 40  # 25 batches per epoch: crosses an epoch boundary
    spec = local_ps.start(num_ps=num_ps, num_workers=1)
    plan = make_plan(spec, BagModel, steps=steps, optimizer=OPTIMIZERS[optimizer][0], partition=partition)
    summary = run_worker(spec, 0, plan, BagModel, bags, torch.nn.BCEWithLogitsLoss())
    assert summary["global_step"] == steps
    got = trained(local_ps, spec, plan)
    expected = plain_training(bags, steps, OPTIMIZERS[optimizer][1])
    initial = dict(build_model(BagModel, SEED).named_parameters())
    assert (got["embedding.weight"] - initial["embedding.weight"]).abs().max() > 1e-3  # it did train
    for name, value in expected.items():
        assert (got[name] - value).abs().max() <= 1e-5, name


def test_a_sparse_step_moves_only_the_touched_rows(local_ps, bags):
    big = 20_000  # a table far larger than what a batch touches

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.EmbeddingBag(big, DIM, mode="sum", sparse=True)

        def forward(self, ids):
            return self.embedding(ids).sum(1)

    events = []
    spec = local_ps.start(num_ps=2, num_workers=1)
    collector = Collector(lambda batch: events.extend(e for e in batch if e.get("kind") == "step"), spec.key)
    plan = make_plan(spec, Big, steps=10, partition={"embedding": 2}, metrics_address=collector.address)
    run_worker(spec, 0, plan, Big, bags, torch.nn.BCEWithLogitsLoss())
    assert wait_until(lambda: len(events) >= 10, 5)  # the last batch may still be in flight
    collector.close()
    assert len(events) == 10
    for e in events:  # a step's bytes: the rows pulled in forward, then the push-pull
        # at most BATCH * BAG distinct rows: pulled (8 B index + DIM * 4 B) and pushed (the same), once each
        assert e["bytes_sent"] + e["bytes_received"] <= BATCH * BAG * (8 + DIM * 4) * 2 + 4096  # + headers
    assert max(e["bytes_sent"] for e in events) < big * DIM * 4 / 20  # far from moving the table


def test_a_partitioned_dense_variable_trains_like_a_whole_one(local_ps, bags):
    from pscluster.datasets import digits

    data = digits("train")
    results = []
    for num_ps, partition in ((1, None), (2, {"0.weight": 3, "2": 2})):
        spec = local_ps.start(num_ps=num_ps, num_workers=1)
        plan = make_plan(spec, mlp, steps=20, partition=partition, placement="greedy")
        run_worker(spec, 0, plan, mlp, data, torch.nn.CrossEntropyLoss())
        results.append(trained(local_ps, spec, plan))
        assert len(plan.variables) == (4 if partition is None else 4 + 2 + 1 + 1)
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def test_ssp_keeps_every_worker_within_the_bound_of_the_slowest(local_ps, bags):
    bound, steps = 2, 60
    events = []
    spec = local_ps.start(num_ps=1, num_workers=2)
    collector = Collector(lambda batch: events.extend(e for e in batch if e.get("kind") == "step"), spec.key)
    plan = make_plan(spec, BagModel, steps=steps, mode="ssp", staleness_bound=bound,
                     metrics_address=collector.address)
    slow = threading.Event()

    def loss(output, target):
        if threading.current_thread().name == "worker-1":
            slow.wait(0.06)  # a straggler: 60 ms per step
        return torch.nn.functional.binary_cross_entropy_with_logits(output, target)

    results = {}
    threads = [threading.Thread(target=lambda i=i: results.setdefault(i, run_worker(spec, i, plan, BagModel, bags,
                                                                                    loss)),
                                name=f"worker-{i}", daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert wait_until(lambda: len(events) >= sum(r["local_steps"] for r in results.values()), 5)
    collector.close()
    assert sum(r["local_steps"] for r in results.values()) >= steps
    assert results[0]["local_steps"] > results[1]["local_steps"]  # the fast one did run ahead...
    slow_steps = sorted((e["time"], e["local_step"]) for e in events if e["task"] == "worker:1")
    for e in (e for e in events if e["task"] == "worker:0"):
        # ...but never by more than the bound. The fast one records its step s once the ps, holding the slow
        # one's push of step s - bound, has answered it; the slow one records each step before it pushes the next,
        # so by then it has recorded step s - bound - 1 at least (its record of s - bound may come any time later
        # on a loaded machine)
        done = max((s for t, s in slow_steps if t <= e["time"]), default=0)
        if done < results[1]["local_steps"]:
            assert e["local_step"] - done <= bound + 1, (e, done)


def test_an_optimizer_without_sparse_updates_is_refused_before_training():
    model = build_model(BagModel, SEED)
    with pytest.raises(ConfigError, match="RMSprop cannot update sparse embeddings: use SGD, Adagrad or Adam"):
        TrainPlan.of(run_id=RUN_ID, mode="sync", steps=1, batch_size=1, optimizer="rmsprop",
                  variables=describe_variables(model, 1))
