"""The worker loop against in-process ps servers, its helpers, input sharding and metrics."""

import itertools
import json
import math
import re
import secrets
import threading
import time

import pytest
import torch
import zmq
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from pscluster.datasets import digits
from pscluster.errors import ConfigError
from pscluster.metrics.collector import Collector
from pscluster.runtime.data import fetch_batch, worker_batches
from pscluster.runtime.emitter import MetricsEmitter, sign_batch
from pscluster.runtime import emitter as emitter_module
from pscluster.runtime.protocol import mac
from pscluster.runtime.optim import resolve_optimizer
from pscluster.runtime.plan import TrainPlan, describe_variables
from pscluster.runtime.waiting import wait_until
from pscluster.runtime.steps import batch_accuracy
from pscluster.runtime.member import log_line
from pscluster.runtime.seeding import build_model
from pscluster.runtime.worker import run_worker
from pscluster.runtime.network import free_port

RUN_ID = 7  # the run id the conftest clients use
SEED = 3
BATCH = 32
LR = 0.1
LOG_LINE = re.compile(r"After \d+ training steps \(\d+ global steps\), loss \d+\.\d{3}, "
                      r"accuracy \d\.\d{3} \(\d+\.\d{3} sec/batch\)")


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def other_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))


@pytest.fixture(scope="module")
def dataset():
    ds = digits("train")
    ds.tensors()  # load once for the module
    return ds


SGD = ("sgd", {"lr": LR})
OPTIMIZERS = [SGD, ("SGD", {"lr": 0.05, "momentum": 0.9}), ("adam", {"lr": 0.01}),
              ("adagrad", {"lr": 0.05}), ("AdamW", {"lr": 0.01, "betas": [0.8, 0.99]})]


def make_plan(spec, *, steps, mode="sync", replicas=1, log_every=100, model_fn=mlp, metrics_address=None,
              optimizer=SGD):
    model = build_model(model_fn, SEED)
    return TrainPlan.of(run_id=RUN_ID, mode=mode, steps=steps, batch_size=BATCH, optimizer=optimizer[0],
                     optimizer_kwargs=optimizer[1], replicas_to_aggregate=replicas,
                     num_workers=len(spec.workers),
                     variables=describe_variables(model, len(spec.ps)),
                     seed=SEED, log_every=log_every, metrics_address=metrics_address, request_timeout=30.0)


def plain_batches(dataset, steps: int, batch_size: int = BATCH, seed: int = SEED):
    """The first ``steps`` batches of a plain DataLoader over a one-replica DistributedSampler, epoch after
    epoch: what a single worker trains on."""
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    def endless():
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from loader
    return itertools.islice(endless(), steps)


def local_training(dataset, steps: int, optimizer=SGD) -> torch.nn.Module:
    """The same training in one process: plain torch, DataLoader over a DistributedSampler."""
    torch.manual_seed(SEED)
    model = mlp()
    optimizer = resolve_optimizer(optimizer[0])(model.parameters(), **optimizer[1])
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in plain_batches(dataset, steps):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    return model


def delayed_local_training(dataset, steps: int) -> dict[str, torch.Tensor]:
    """Plain SGD in one process where the gradient of batch k is taken at the parameters before step k - 1
    was applied (the first at the initial ones): what a pipelined worker computes."""
    torch.manual_seed(SEED)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    older = {name: p.detach().clone() for name, p in model.named_parameters()}
    for x, y in plain_batches(dataset, steps):
        current = {name: p.detach().clone() for name, p in model.named_parameters()}
        model.load_state_dict(older)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        model.load_state_dict(current)
        optimizer.step()
        older = current
    return {name: p.detach() for name, p in model.named_parameters()}


def run_workers(spec, plan, dataset, model_fn=mlp):
    """Every worker of ``spec`` in its own thread; their summaries by index. (Threads that build their models
    share torch's random generator: give a model, which each copies, where the initial values matter.)"""
    summaries, errors = {}, {}

    def work(i):
        try:
            summaries[i] = run_worker(spec, i, plan, model_fn, dataset, torch.nn.CrossEntropyLoss())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(spec.workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a worker did not finish"
    return summaries


# --- whole runs ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_ps", [1, 2])
def test_one_worker_matches_plain_torch_training(local_ps, dataset, num_ps):
    steps = 50  # 45 batches per epoch: crosses an epoch boundary (short last batch, reshuffle)
    spec = local_ps.start(num_ps=num_ps, num_workers=1)
    plan = make_plan(spec, steps=steps, log_every=10)
    lines = []
    summary = run_worker(spec, 0, plan, mlp, dataset, torch.nn.CrossEntropyLoss(), log=lines.append)

    assert (summary["local_steps"], summary["global_step"], summary["dropped"]) == (steps, steps, 0)
    assert summary["samples"] == len(dataset) + (steps - math.ceil(len(dataset) / BATCH)) * BATCH
    assert len(lines) == steps // 10 and all(LOG_LINE.fullmatch(line) for line in lines)
    assert lines[-1].startswith(f"After {steps} training steps ({steps} global steps)")

    reply = local_ps.client(spec, run_id=RUN_ID).pull()
    trained = {plan.variables[i].name: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
    expected = dict(local_training(dataset, steps).named_parameters())
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        assert (trained[name] - value.detach()).abs().max() <= 1e-6, name


@pytest.mark.parametrize("optimizer", OPTIMIZERS[1:], ids=lambda o: f"{o[0]}{o[1]}")
def test_optimizer_state_on_two_ps_matches_plain_torch(local_ps, dataset, optimizer):
    """Each ps keeps the optimizer state (momentum, Adam moments, Adagrad sums) of its own variables."""
    steps = 30
    spec = local_ps.start(num_ps=2, num_workers=1)
    plan = make_plan(spec, steps=steps, optimizer=optimizer)
    run_worker(spec, 0, plan, mlp, dataset, torch.nn.CrossEntropyLoss())
    reply = local_ps.client(spec, run_id=RUN_ID).pull()
    trained = {plan.variables[i].name: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
    expected = dict(local_training(dataset, steps, optimizer).named_parameters())
    initial = dict(build_model(mlp, SEED).named_parameters())
    moved = max((trained[n] - p).abs().max().item() for n, p in initial.items())
    assert moved > 1e-3
    for name, value in expected.items():
        assert (trained[name] - value.detach()).abs().max() <= 1e-6, name


def test_two_sync_workers_make_one_global_step_per_local_step(local_ps, dataset):
    steps = 20
    spec = local_ps.start(num_ps=1, num_workers=2)
    summaries = run_workers(spec, make_plan(spec, steps=steps, replicas=2), dataset)
    for s in summaries.values():
        assert (s["local_steps"], s["global_step"], s["dropped"]) == (steps, steps, 0)
        assert s["staleness"] == {0: steps}
    stats = local_ps.client(spec, run_id=RUN_ID).stats()[0]
    assert (stats["step"], stats["applied"], stats["pushes"], stats["dropped_stale"]) == (steps, steps, 2 * steps, 0)


def accumulating_local_training(dataset, steps: int, batches_per_step: int) -> dict[str, torch.Tensor]:
    """Plain SGD in one process, each step on the mean gradient of the next ``batches_per_step`` batches."""
    torch.manual_seed(SEED)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = plain_batches(dataset, steps * batches_per_step)
    for _ in range(steps):
        optimizer.zero_grad()
        for x, y in itertools.islice(batches, batches_per_step):
            (loss_fn(model(x), y) / batches_per_step).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def test_seed_000s_one_worker_with_two_replicas_makes_a_global_step_of_every_two_chief_steps(local_ps, dataset):
    # seed 000: "if we only run one worker (chief worker), we'll still be able to proceed, but there is only one
    # step in global step after two steps in chief worker" (replicas_to_aggregate=2): TF's tokens
    steps = 100
    spec = local_ps.start(num_ps=2, num_workers=1)
    lines = []
    summary = run_worker(spec, 0, make_plan(spec, steps=steps, replicas=2, log_every=50), mlp, dataset,
                         torch.nn.CrossEntropyLoss(), log=lines.append)
    assert (summary["local_steps"], summary["global_step"], summary["dropped"]) == (2 * steps, steps, 0)
    assert lines[-1].startswith(f"After {2 * steps} training steps ({steps} global steps)")
    reply = local_ps.client(spec, run_id=RUN_ID).pull()
    trained = {make_plan(spec, steps=steps).variables[i].name: t for m in reply.messages
               for i, t in zip(m.ids, m.tensors)}
    for name, value in accumulating_local_training(dataset, steps, 2).items():  # each step: the mean of two
        assert (trained[name] - value).abs().max() <= 1e-6, name


def test_three_replicas_on_two_workers_and_two_ps_take_two_gradients_of_worker_0_and_one_of_worker_1(local_ps,
                                                                                                   dataset):
    steps = 30
    spec = local_ps.start(num_ps=2, num_workers=2)
    summaries = run_workers(spec, make_plan(spec, steps=steps, replicas=3), dataset)
    assert [(s["local_steps"], s["global_step"], s["dropped"]) for _, s in sorted(summaries.items())] == \
        [(2 * steps, steps, 0), (steps, steps, 0)]
    for stats in local_ps.client(spec, run_id=RUN_ID).stats():  # both ps applied the same gradients
        assert (stats["step"], stats["applied"], stats["pushes"], stats["dropped_stale"]) == \
            (steps, steps, 3 * steps, 0)


def test_two_async_workers_apply_exactly_the_step_target(local_ps, dataset):
    # One ps: with several, the last concurrent pushes may be applied on one ps and late on another.
    steps = 20
    spec = local_ps.start(num_ps=1, num_workers=2)
    summaries = run_workers(spec, make_plan(spec, steps=steps, mode="async"), dataset)
    applied = sum(s["local_steps"] - s["dropped"] for s in summaries.values())
    assert applied == steps
    assert all(s["dropped"] <= 1 and s["global_step"] == steps for s in summaries.values())
    stats = local_ps.client(spec, run_id=RUN_ID).stats()[0]
    assert stats["applied"] == steps and stats["late"] == sum(s["dropped"] for s in summaries.values())
    assert sum(stats["staleness"].values()) == steps


def test_a_pipelined_async_worker_computes_each_gradient_on_the_parameters_one_step_older(local_ps, dataset):
    steps = 30
    spec = local_ps.start(num_ps=2, num_workers=1)
    plan = make_plan(spec, steps=steps, mode="async").replace(pipeline=True)
    summary = run_worker(spec, 0, plan, mlp, dataset, torch.nn.CrossEntropyLoss())

    assert (summary["local_steps"], summary["global_step"], summary["dropped"]) == (steps, steps, 0)
    assert summary["staleness"] == {0: 1, 1: steps - 1}  # the first gradient alone was computed on fresh values
    reply = local_ps.client(spec, run_id=RUN_ID).pull()
    trained = {plan.variables[i].name: t for m in reply.messages for i, t in zip(m.ids, m.tensors)}
    for name, value in delayed_local_training(dataset, steps).items():
        assert (trained[name] - value).abs().max() <= 1e-6, name


def test_worker_refuses_a_model_that_differs_from_the_plan(local_ps, dataset):
    spec = local_ps.start(num_ps=1, num_workers=1)
    plan = make_plan(spec, steps=1, model_fn=other_mlp)
    with pytest.raises(ConfigError, match="differs from the planned one: make model_fn deterministic"):
        run_worker(spec, 0, plan, mlp, dataset, torch.nn.CrossEntropyLoss())


# --- helpers ---------------------------------------------------------------------------------


def test_build_model():
    template = mlp()
    copy = build_model(template, SEED)
    assert copy is not template
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), template.parameters()))
    a, b = build_model(mlp, SEED), build_model(mlp, SEED)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    with pytest.raises(ConfigError, match="model_fn returned int: it must build a torch.nn.Module"):
        build_model(lambda: 3, SEED)


def test_log_line_format():
    assert (log_line(200, 385, 0.5534, 0.8361, 0.01234)
            == "After 200 training steps (385 global steps), loss 0.553, accuracy 0.836 (0.012 sec/batch)")
    assert log_line(1, 2, 1.0, None, 0.5) == "After 1 training steps (2 global steps), loss 1.000 (0.500 sec/batch)"


@pytest.mark.parametrize("output, target, expected", [
    (torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, 1.0], [1.0, 2.0]]), torch.tensor([0, 1, 1, 1]), 0.75),
    (torch.tensor([[0.5], [-1.0], [2.0], [-0.1]]), torch.tensor([1.0, 0.0, 0.0, 0.0]), 0.75),
    (torch.tensor([0.5, -1.0]), torch.tensor([1.0, 1.0]), 0.5),
    (torch.randn(4, 3), torch.randn(4), None),
    (torch.randn(4, 1), torch.randn(4, 1), None),
    ((torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.randn(2, 5)), torch.tensor([0, 0]), 0.5),
    ({"logits": torch.tensor([[2.0, 1.0], [0.0, 3.0]]), "aux": torch.zeros(())}, torch.tensor([0, 1]), 1.0),
    ({"scores": torch.randn(2, 3)}, torch.tensor([0, 1]), None),
    (torch.tensor([[[2.0, 1.0], [0.0, 3.0]]]), torch.tensor([[0, 0]]), 0.5),
    (torch.randn(4, 3), {"label": torch.tensor([0, 1, 2, 0])}, None),
], ids=["classes", "binary-logit", "binary-flat", "regression", "regression-column", "tuple-output",
        "dict-logits", "dict-without-logits", "tokens", "dict-target"])
def test_batch_accuracy(output, target, expected):
    assert batch_accuracy(output, target) == expected


# --- input sharding --------------------------------------------------------------------------


class Indices(Dataset):
    """Item ``i`` is ``i``: batches show which indices a worker read."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def epochs(dataset, rank, world, batch, n_epochs=2, seed=SEED):
    """The indices ``rank`` reads in each of its first epochs."""
    per_epoch = math.ceil(math.ceil(len(dataset) / world) / batch)
    batches = worker_batches(dataset, rank, world, batch, seed)
    return [[i for _ in range(per_epoch) for i in next(batches).tolist()] for _ in range(n_epochs)]


def test_two_ranks_read_disjoint_shards_that_cover_the_data():
    ds = Indices(100)
    (first0, second0), (first1, _) = epochs(ds, 0, 2, 8), epochs(ds, 1, 2, 8)
    assert len(first0) == len(first1) == 50
    assert not set(first0) & set(first1)
    assert set(first0) | set(first1) == set(range(100))
    assert first0 != second0  # reshuffled every epoch


def test_uneven_data_is_padded_like_distributed_sampler():
    ds = Indices(101)
    shards = [epochs(ds, rank, 2, 8, n_epochs=1)[0] for rank in (0, 1)]
    assert [len(s) for s in shards] == [51, 51]
    assert set(shards[0]) | set(shards[1]) == set(range(101))
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=SEED)
    assert shards[1] == list(sampler)


def test_last_short_batch_is_kept():
    batches = worker_batches(Indices(10), 0, 1, 4, SEED)
    assert [len(next(batches)) for _ in range(6)] == [4, 4, 2, 4, 4, 2]


def test_empty_dataset():
    with pytest.raises(ValueError, match="empty"):
        next(worker_batches(Indices(0), 0, 1, 4, SEED))


def test_fetch_batch_uses_batched_indexing_when_the_dataset_has_it(dataset):
    X, y = dataset.tensors()
    xb, yb = fetch_batch(dataset, [5, 1, 9])
    assert torch.equal(xb, X[[5, 1, 9]]) and torch.equal(yb, y[[5, 1, 9]])
    assert torch.equal(fetch_batch(Indices(10), [5, 1, 9]), torch.tensor([5, 1, 9]))


# --- metrics ---------------------------------------------------------------------------------


KEY = bytes(range(16))  # the metrics tests' cluster secret


@pytest.fixture
def collector():
    events = []
    c = Collector(events.extend, KEY)
    yield c, events
    c.close()
    assert not c._thread.is_alive()


@pytest.fixture
def emitters():
    """Factory of MetricsEmitters, all closed at teardown."""
    made = []

    def make(address, task="worker:0"):
        made.append(MetricsEmitter(address, task, KEY))
        return made[-1]

    yield make
    for e in made:
        e.close()


def test_emitter_and_collector_deliver_events_in_order(collector, emitters):
    c, events = collector
    emitter = emitters(c.address)
    for i in range(5):
        emitter.emit("step", local_step=i, loss=0.5)
    emitter.flush()
    assert wait_until(lambda: len(events) == 5, 2)
    assert [e["local_step"] for e in events] == list(range(5))
    assert all(e["kind"] == "step" and e["task"] == "worker:0" and e["loss"] == 0.5 for e in events)
    assert abs(events[0]["time"] - time.time()) < 60
    assert emitter.dropped == 0


def test_close_sends_what_is_buffered(collector):
    c, events = collector
    emitter = MetricsEmitter(c.address, "ps:0", KEY)
    emitter.emit("state", state="training")
    emitter.emit("done")
    emitter.close()
    assert wait_until(lambda: len(events) == 2, 2)
    assert [e["kind"] for e in events] == ["state", "done"]


def test_a_done_event_goes_at_once_with_what_is_buffered(collector, emitters, monkeypatch):
    monkeypatch.setattr(emitter_module, "FLUSH_S", 3600.0)  # no batch due by itself
    c, events = collector
    emitter = emitters(c.address)
    emitter.emit("step", local_step=1)
    emitter.emit("done", local_steps=1)  # a script's chief waits for the run's end before it closes its emitter
    assert wait_until(lambda: len(events) == 2, 2)
    assert [e["kind"] for e in events] == ["step", "done"]


def test_emitter_without_a_listener_never_blocks(emitters):
    port = free_port()  # a port where nothing listens
    emitter = emitters(f"tcp://127.0.0.1:{port}")
    started = time.monotonic()
    for i in range(1000):
        emitter.emit("step", local_step=i)
        emitter.flush()
    assert time.monotonic() - started < 10
    assert 0 < emitter.dropped < 1000  # the send queue filled up, then events were dropped and counted


def test_emitter_without_address_does_nothing(emitters):
    emitter = emitters(None)
    emitter.emit("step", local_step=1)
    emitter.flush()
    assert emitter.dropped == 0


def test_collector_counts_bad_batches_and_ignores_odd_ones(collector):
    c, events = collector
    push = zmq.Context.instance().socket(zmq.PUSH)
    emitter = secrets.token_bytes(8)
    try:
        push.connect(c.address)
        signed = [sign_batch(batch, KEY, emitter, n) for n, batch in enumerate([{"kind": "x"},
                                                                                [1, "two", {"kind": "ok"}]])]
        not_json = [signed[1][0][:-1] + b"\x07", b"["]  # the next sequence number, then a signed non-JSON body
        for frames in ([b"not json"], [json.dumps([{"kind": "unsigned"}]).encode()],
                       sign_batch([{"kind": "other cluster"}], bytes(16), emitter, 5),
                       [b"PSCM", b"[]", bytes(32)], *signed, signed[1], [signed[1][0], b"[", signed[1][2]],
                       [*not_json, mac(KEY, not_json)], [b""] * 1000):
            push.send_multipart(frames)
        assert wait_until(lambda: sum(c.rejected.values()) == 8, 2)
    finally:
        push.close(linger=0)
    assert events == [{"kind": "ok"}]
    assert c.rejected == {"unsigned": 2, "bad_signature": 3, "replayed": 1, "malformed": 2}


def test_a_runs_collector_takes_no_other_runs_events():
    # a script's chief started again listens where its first incarnation did: the workers of the run it replaced
    # may still send there until they join the new one
    events = []
    c = Collector(events.extend, KEY, run_id=8)
    old = MetricsEmitter(c.address, "worker:1", KEY, run_id=7)
    new = MetricsEmitter(c.address, "worker:1", KEY, run_id=8)
    try:
        old.emit("step", global_step=100)
        new.emit("step", global_step=101)
        old.flush()
        new.flush()
        assert wait_until(lambda: events and c.rejected, 5)
    finally:
        old.close()
        new.close()
        c.close()
    assert [e["global_step"] for e in events] == [101] and c.rejected == {"other_run": 1}
