"""``ctx.shard``'s DataLoader (``shard_loader``): one worker reads what the plain DataLoader reads, in its order and
with its random draws; N workers split each epoch; epochs advance by themselves."""

import itertools
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

from pscluster.errors import ConfigError, RunEnded
from pscluster.metrics.collector import Collector
from pscluster.metrics.store import RunStore
from pscluster.runtime.context import run_loop
from pscluster.runtime.shard_loader import ShardLoader, shard_loader
from pscluster.runtime.streams import Batches
from pscluster.runtime.waiting import wait_until

from .test_context_inprocess import plan_of
from .test_worker_inprocess import LR, mlp

ITEMS = 50


def numbers() -> TensorDataset:
    return TensorDataset(torch.arange(ITEMS, dtype=torch.float32).unsqueeze(1), torch.arange(ITEMS))


class Jittered(Dataset):
    """A dataset whose items draw from torch's generator, as a random augmentation does."""

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        return torch.tensor([float(i)]) + torch.rand(1), i


class Counting(IterableDataset):
    def __iter__(self):
        return iter(range(ITEMS))


def read_ahead_stream(make):
    """How a worker context hands out an epoch's batches: read ahead after each batch, never ended."""
    return Batches(make, begin=lambda: None, counted=lambda n: None, ended=lambda: None)


def epochs(loader, n=2, read_ahead=False) -> list[list]:
    """``n`` epochs of ``loader``'s batches (``read_ahead``: a batch read ahead after each one is taken, as during
    an exchange), and torch's generator state after them."""
    out = []
    for _ in range(n):
        batches = []
        for batch in loader:
            batches.append(batch)
            if read_ahead:
                loader.read_ahead()
        out.append(batches)
    return out, torch.get_rng_state()


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


PLAIN = {
    "in order": lambda: DataLoader(numbers(), batch_size=8),
    "shuffled": lambda: DataLoader(numbers(), batch_size=8, shuffle=True),
    "shuffled, own generator": lambda: DataLoader(numbers(), batch_size=8, shuffle=True,
                                                  generator=torch.Generator().manual_seed(5)),
    "random augmentation, drop_last": lambda: DataLoader(Jittered(), batch_size=7, shuffle=True, drop_last=True),
    "loader processes": lambda: DataLoader(Jittered(), batch_size=8, shuffle=True, num_workers=2),
    "iterable": lambda: DataLoader(Counting(), batch_size=8),
}


@pytest.mark.parametrize("kind", PLAIN)
def test_one_worker_reads_the_plain_loader_s_batches_order_and_random_draws(kind):
    torch.manual_seed(3)
    expected, after = epochs(PLAIN[kind]())
    torch.manual_seed(3)
    got, got_after = epochs(ShardLoader(PLAIN[kind](), 0, 1, seed=11, stream=read_ahead_stream), read_ahead=True)
    assert same(got, expected) and torch.equal(got_after, after)
    assert not same(got[0], got[1]) or kind in ("in order", "iterable")  # each epoch its own order


def test_n_workers_split_each_epoch_into_disjoint_parts_padded_as_distributed_sampler_pads():
    world = 3
    parts = [ShardLoader(DataLoader(numbers(), batch_size=4, shuffle=True), rank, world, seed=11,
                         stream=read_ahead_stream) for rank in range(world)]
    per_epoch = []
    for epoch in range(2):
        read = [torch.cat([y for _, y in part]).tolist() for part in parts]
        assert [len(r) for r in read] == [17, 17, 17]  # ceil(50 / 3): the first 1 index repeated to pad
        assert set().union(*map(set, read)) == set(range(ITEMS))
        assert sum(map(len, read)) - ITEMS == 1
        per_epoch.append(read)
    assert per_epoch[0] != per_epoch[1]  # the epoch advanced by itself
    assert [len(part) for part in parts] == [5, 5, 5]  # ceil(17 / 4) batches: len() is this worker's
    assert parts[1].batch_size == 4 and isinstance(parts[1].sampler, DistributedSampler)
    assert len(parts[1].dataset) == ITEMS


def test_n_workers_deal_an_iterable_dataset_s_items_in_turn():
    parts = [ShardLoader(DataLoader(Counting(), batch_size=5), rank, 2, seed=0, stream=read_ahead_stream)
             for rank in range(2)]
    assert [torch.cat(list(part)).tolist() for part in parts] == [list(range(0, ITEMS, 2)), list(range(1, ITEMS, 2))]


def test_a_dataset_is_given_dataloader_s_arguments_with_a_training_set_s_defaults():
    torch.manual_seed(0)
    loader = shard_loader(numbers(), 0, 1, seed=0, stream=read_ahead_stream, kwargs={"drop_last": True})
    assert loader.batch_size == 64 and loader.drop_last and len(loader) == 0
    loader = shard_loader(numbers(), 0, 1, seed=0, stream=read_ahead_stream, kwargs={"batch_size": 10})
    first = torch.cat([y for _, y in loader]).tolist()
    assert sorted(first) == list(range(ITEMS)) and first != list(range(ITEMS))  # shuffled by default


def test_the_stream_ends_an_epoch_once_the_run_has_ended():
    ended = []
    loader = ShardLoader(DataLoader(numbers(), batch_size=5), 0, 1, seed=0,
                         stream=lambda make: Batches(make, begin=lambda: None, counted=lambda n: None,
                                                     ended=lambda: "stopped" if ended else None))
    taken = []
    for batch in loader:
        taken.append(batch)
        if len(taken) == 3:
            ended.append(True)
    assert len(taken) == 3
    with pytest.raises(RunEnded, match="stopped"):  # an epoch begun after the end: a loop that would spin on
        next(iter(loader))


def test_each_epoch_says_its_number_and_batches_as_its_first_batch_is_read():
    began = []
    loader = ShardLoader(DataLoader(numbers(), batch_size=8), 1, 2, seed=0, stream=read_ahead_stream,
                         began=lambda *told: began.append(told))
    first = iter(loader)
    assert began == []  # an epoch that reads no batch (the run ended before it) began nothing
    next(first)
    list(loader)
    assert began == [(1, 4), (2, 4)]  # ceil(25 / 8) batches of this worker's part
    parts = ShardLoader(DataLoader(Counting(), batch_size=5), 0, 2, seed=0, stream=read_ahead_stream,
                        began=lambda *told: began.append(told))
    list(parts)
    assert began[-1] == (1, None)  # a part of an IterableDataset has no length


def shard_or_endless(data):
    """Worker 0 reads its part of 3 epochs through ``ctx.shard``; worker 1 reads 4 batches of ``ctx.endless_shard``,
    which has no epochs."""
    def train_fn(ctx):
        model = ctx.model(mlp())
        optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
        if ctx.worker_index == 0:
            loader = ctx.shard(data, batch_size=8)
            batches = (batch for _ in range(3) for batch in loader)
        else:
            batches = itertools.islice(ctx.endless_shard(data, batch_size=8), 4)
        for x, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return train_fn


def test_each_worker_s_epochs_reach_the_run_store_and_a_loop_on_endless_shard_has_none(local_ps, tmp_path):
    spec = local_ps.start(num_ps=1, num_workers=2)
    train_fn = shard_or_endless(TensorDataset(torch.randn(ITEMS, 64), torch.randint(0, 10, (ITEMS,))))
    with RunStore(tmp_path / "runs.sqlite") as store:
        run_id = store.create_run(name=None, cluster="c", mode="async", config={}, spec={})
        collector = Collector(lambda events: store.add_batch(run_id, events), spec.key)
        try:
            plan = plan_of(train_fn, spec, mode="async", steps=None, metrics_address=collector.address)
            summaries = {}
            workers = [threading.Thread(target=lambda i=i: summaries.update({i: run_loop(spec, i, plan, train_fn)}))
                       for i in range(2)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(60)
            assert sorted(summaries) == [0, 1], "a worker failed"
            local_steps = sum(s["local_steps"] for s in summaries.values())
            assert wait_until(lambda: len(store.metrics(run_id)) == local_steps, 10), store.metrics(run_id)
        finally:
            collector.close()
        assert store.epochs(run_id) == {0: 3}
        began = store.events(run_id).query("kind == 'epoch'")["detail"].tolist()
        assert [(e["epoch"], e["batches"]) for e in began] == [(1, 4), (2, 4), (3, 4)]  # 25 items: 4 batches of 8


@pytest.mark.parametrize("make, kwargs, fix", [
    (lambda: DataLoader(numbers(), batch_size=4), {"batch_size": 8}, "set them on the DataLoader"),
    (lambda: DataLoader(numbers(), sampler=DistributedSampler(numbers(), num_replicas=2, rank=0)), {},
     "pscluster splits the epochs"),
    (lambda: DataLoader(numbers(), batch_sampler=[[0, 1], [2, 3]]), {}, "batch_sampler"),
    (lambda: numbers(), {"batch_size": 0}, "DataLoader's keyword arguments"),
    (lambda: 42, {}, "give a DataLoader"),
])
def test_what_cannot_be_split_is_one_line_naming_the_fix(make, kwargs, fix):
    with pytest.raises(ConfigError, match=fix):
        shard_loader(make(), 1, 2, seed=0, stream=read_ahead_stream, kwargs=kwargs)
