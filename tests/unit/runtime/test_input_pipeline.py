"""The workers' input pipeline (runtime/data.py) with real DataLoader loader processes: the same batches in
the same order with and without them, prefetching, classes that cannot be imported, forking from a process
with threads, IterableDataset streams, and DataLoaders taken apart."""

import hashlib
import hmac
import json
import multiprocessing
import sys
import threading
import time
from dataclasses import asdict

import psutil
import pytest
import torch
import zmq
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              SubsetRandomSampler, WeightedRandomSampler)

from pscluster.errors import ConfigError, TrainingError
from pscluster.runtime.data import LoaderOptions, from_dataloader, shard, worker_batches

pytestmark = pytest.mark.timeout(60)
SEED = 3
TWO = LoaderOptions(num_workers=2)


class Items(Dataset):
    """Item ``i``: a dict of its index and a small tensor, so batches are nested structures."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i, "x": torch.full((2,), float(i)), "pair": (i % 3, [float(i)])}


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def take(batches, n):
    return [next(batches) for _ in range(n)]


def flat(batches):
    return [i for b in batches for i in (b["i"] if isinstance(b, dict) else b).tolist()]


def equal(a, b) -> bool:
    """Batches of any structure equal, tensors included."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    return a == b


def children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def wait_for(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# --- options ---------------------------------------------------------------------------------------------


def test_options_round_trip_through_json():
    options = LoaderOptions(num_workers=3, prefetch_factor=4, pin_memory=True, shuffle=False, drop_last=True)
    assert LoaderOptions(**json.loads(json.dumps(asdict(options)))) == options
    assert LoaderOptions(**asdict(LoaderOptions())) == LoaderOptions()


@pytest.mark.parametrize("kwargs, fix", [({"num_workers": -1}, "0 or more"), ({"num_workers": 1.5}, "0 or more"),
                                         ({"prefetch_factor": 2}, "set num_workers > 0"),
                                         ({"num_workers": 2, "prefetch_factor": 0}, "1 or more"),
                                         ({"shuffle": "yes"}, "True or False")])
def test_bad_options_say_what_to_do(kwargs, fix):
    with pytest.raises(ConfigError, match=fix) as raised:
        LoaderOptions(**kwargs)
    assert "\n" not in str(raised.value)


# --- map-style datasets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [LoaderOptions(), LoaderOptions(shuffle=False), LoaderOptions(drop_last=True)])
def test_loader_processes_give_the_same_batches_in_the_same_order(options):
    ds, batch, steps = Items(37), 4, 12  # shards of 19 (padded): 5 batches an epoch, the last short or dropped
    for rank in (0, 1):
        inline = take(worker_batches(ds, rank, 2, batch, SEED, options), steps)
        loaded = worker_batches(ds, rank, 2, batch, SEED, LoaderOptions(**{**asdict(options), "num_workers": 2}))
        assert all(equal(a, b) for a, b in zip(inline, take(loaded, steps), strict=True))
        loaded.close()
    per_epoch = 4 if options.drop_last else 5
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=options.shuffle, seed=SEED)
    sampler.set_epoch(1)
    expected = list(sampler)[:16] if options.drop_last else list(sampler)
    assert flat(inline[per_epoch:2 * per_epoch]) == expected  # rank 1's second epoch
    assert [len(b["i"]) for b in inline[:per_epoch]] == ([4] * 4 if options.drop_last else [4, 4, 4, 4, 3])


class Batched(Dataset):
    """A dataset with its own batched indexing (the fast path)."""

    supports_batch_index = True

    def __init__(self, n):
        self.x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
        self.y = torch.arange(n) % 10

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def test_batched_indexing_and_collate_fn_in_loader_processes():
    def collate(items):  # defined here: not importable, which the forked loader processes do not need
        return {"sum": sum(float(x) for x, _ in items), "n": len(items)}

    for collate_fn in (None, collate):
        inline = take(worker_batches(Batched(50), 0, 1, 8, SEED, collate_fn=collate_fn), 10)
        loaded = worker_batches(Batched(50), 0, 1, 8, SEED, TWO, collate_fn=collate_fn)
        assert all(equal(a, b) for a, b in zip(inline, take(loaded, 10), strict=True))
        loaded.close()
    assert isinstance(inline[0], dict) and inline[0]["n"] == 8


def test_a_dataset_class_that_cannot_be_imported():
    def item(self, i):
        return torch.tensor([i, i * i])

    Runtime = type("Runtime", (Dataset,), {"__len__": lambda self: 30, "__getitem__": item})
    assert not hasattr(sys.modules[Runtime.__module__], "Runtime")  # pickle cannot name it: forking needs not
    batches = worker_batches(Runtime(), 1, 3, 4, SEED, LoaderOptions(num_workers=2, prefetch_factor=1))
    assert all(equal(a, b) for a, b in zip(take(batches, 9), take(worker_batches(Runtime(), 1, 3, 4, SEED), 9)))
    batches.close()


class Counted(Dataset):
    """Counts the items its loader processes made, in shared memory."""

    def __init__(self, n):
        self.n, self.made = n, multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.made.get_lock():
            self.made.value += 1
        return i


def test_batches_are_made_ahead_of_the_step():
    ds = Counted(1000)
    batches = worker_batches(ds, 0, 1, 5, SEED, LoaderOptions(num_workers=2, prefetch_factor=3))
    next(batches)
    ahead = 2 * 3  # num_workers x prefetch_factor batches in flight, each loader process busy with its own
    assert wait_for(lambda: ds.made.value == (1 + ahead) * 5)
    time.sleep(0.2)
    assert ds.made.value == (1 + ahead) * 5  # and no more
    next(batches)
    assert wait_for(lambda: ds.made.value == (2 + ahead) * 5)
    batches.close()


def test_too_little_data_is_refused():
    with pytest.raises(ConfigError, match="empty"):
        next(worker_batches(Items(0), 0, 1, 4, SEED, TWO))
    with pytest.raises(ConfigError, match="drop_last=False"):
        worker_batches(Items(10), 0, 2, 8, SEED, LoaderOptions(drop_last=True))


# --- loader processes: fork, ending, what cannot cross -------------------------------------------------


@pytest.fixture
def busy_threads():
    """A ZeroMQ request/reply pair and hashing (what a worker's emitter does), busy in threads of this process
    while it forks.

    No torch: a thread inside a torch op at the fork may leave a lock of torch's held in the child (the default
    generator's, an allocator's), whose DataLoader then waits forever (CI saw it once in a few hundred runs with a
    matrix product in this thread). pscluster forks in the training thread, and no other thread of a worker runs
    torch ops."""
    stop = threading.Event()
    context = zmq.Context()
    rep, req = context.socket(zmq.REP), context.socket(zmq.REQ)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    req.connect(f"tcp://127.0.0.1:{port}")
    rounds = [0]

    def serve():
        while not stop.is_set():
            if rep.poll(20):
                rep.send(rep.recv())

    def ask():
        while not stop.is_set():
            req.send(b"x" * 1000)
            while not req.poll(20):  # the server may stop before it answers the last request
                if stop.is_set():
                    return
            req.recv()
            rounds[0] += 1

    data = bytes(1 << 16)

    def compute():
        while not stop.is_set():
            hmac.new(b"secret", data, hashlib.sha256).digest()

    threads = [threading.Thread(target=f, daemon=True) for f in (serve, ask, compute)]
    for t in threads:
        t.start()
    yield rounds
    stop.set()
    for t in threads:
        t.join(5)
    req.close(0)
    rep.close(0)
    context.term()


def test_forking_from_a_process_with_busy_threads(busy_threads):
    for _ in range(3):
        batches = worker_batches(Items(64), 0, 1, 8, SEED, TWO)
        assert flat(take(batches, 16)) == flat(take(worker_batches(Items(64), 0, 1, 8, SEED), 16))
        batches.close()
    before = busy_threads[0]
    assert wait_for(lambda: busy_threads[0] > before + 10)  # the threads and their sockets still work


def test_no_loader_process_outlives_close_or_the_iterator():
    others = {p.pid for p in children()}  # what earlier tests of the session keep running (their clusters)

    def loaders():
        return [p for p in children() if p.pid not in others]

    batches = worker_batches(Items(40), 0, 1, 4, SEED, TWO)
    next(batches)
    assert len(loaders()) == 2
    batches.close()
    assert not loaders()
    batches = worker_batches(Stream(40), 0, 1, 4, SEED, TWO)
    next(batches)
    pids = [p.pid for p in loaders()]
    del batches  # garbage: the generator closes
    assert len(pids) == 2 and not loaders()


def test_a_batch_the_worker_cannot_unpickle_is_refused_not_lost():
    Record = type("Record", (), {})

    def collate(items):
        return {"x": torch.tensor(items), "meta": [Record()]}

    assert next(worker_batches(Stream(8), 0, 1, 4, SEED, collate_fn=collate))  # in the training thread: fine
    batches = worker_batches(Stream(8), 0, 1, 4, SEED, LoaderOptions(num_workers=1), collate_fn=collate)
    with pytest.raises(ConfigError, match="Record, a class loader processes cannot send back"):
        next(batches)
    batches.close()


def test_an_error_whose_class_cannot_be_imported_still_reaches_the_worker():
    Bad = type("Bad", (ValueError,), {})

    def item(self, i):
        raise Bad(f"item {i} is broken")

    Broken = type("Broken", (Dataset,), {"__len__": lambda self: 8, "__getitem__": item})
    with pytest.raises(Bad):
        next(worker_batches(Broken(), 0, 1, 4, SEED))
    batches = worker_batches(Broken(), 0, 1, 4, SEED, LoaderOptions(num_workers=1))
    with pytest.raises(TrainingError, match=r"TrainingError: Bad: item \d+ is broken"):
        next(batches)
    batches.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_only_for_a_cuda_device(workers):
    options = LoaderOptions(num_workers=workers, pin_memory=True)
    assert next(worker_batches(Batched(16), 0, 1, 4, SEED, options, device="cuda"))[0].is_pinned()
    assert not next(worker_batches(Batched(16), 0, 1, 4, SEED, options, device="cpu"))[0].is_pinned()


# --- IterableDataset ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_streams_see_each_item_once_per_pass(workers):
    n, world, batch = 42, 2, 5  # 4 streams of 11, 11, 10, 10 items: batches of 5, 5 and a short one
    loaders = max(1, workers)
    per_pass = {0: 6, 1: 4} if workers else {0: 5, 1: 5}  # batches of each rank in one pass
    passes = {0: [], 1: []}
    for rank in (0, 1):
        batches = worker_batches(Stream(n), rank, world, batch, SEED, LoaderOptions(num_workers=workers))
        for _ in range(2):
            passes[rank].append(flat(take(batches, per_pass[rank])))
        batches.close()
        for items in passes[rank]:
            assert {k % (world * loaders) for k in items} <= set(range(rank * loaders, (rank + 1) * loaders))
    for p in range(2):
        both = passes[0][p] + passes[1][p]
        assert sorted(both) == list(range(n))  # every item exactly once


class Sharded(IterableDataset):
    """Reads only its own part, as a dataset over files would."""

    pscluster_sharded = True

    def __iter__(self):
        index, count = shard()
        return iter(range(100 * index, 100 * index + 3))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_shards_itself(workers):
    batches = worker_batches(Sharded(), 1, 2, 3, SEED, LoaderOptions(num_workers=workers))
    got = [next(batches).tolist() for _ in range(4)]
    batches.close()
    first = [[200, 201, 202], [300, 301, 302]] if workers else [[100, 101, 102]] * 2
    assert got == first * 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_worker_with_no_items_is_told(workers):
    batches = worker_batches(Stream(2), 2, 3, 4, SEED, LoaderOptions(num_workers=workers))
    with pytest.raises(ConfigError, match="gave worker 2 no batch.*fewer workers or loader processes"):
        next(batches)
    assert len(next(worker_batches(Stream(2), 0, 3, 4, SEED, LoaderOptions(num_workers=workers)))) == 1


# --- DataLoaders taken apart ---------------------------------------------------------------------------------


def test_a_dataloader_taken_apart():
    ds = Items(10)

    def collate(items):
        return items

    assert from_dataloader(DataLoader(ds, batch_size=4)) == (ds, 4, None, LoaderOptions(shuffle=False))
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, prefetch_factor=3, pin_memory=True,
                        drop_last=True, collate_fn=collate)
    assert from_dataloader(loader) == (ds, 8, collate, LoaderOptions(num_workers=2, prefetch_factor=3,
                                                                     pin_memory=True, drop_last=True))
    stream = Stream(5)
    assert from_dataloader(DataLoader(stream, batch_size=2)) == (stream, 2, None, LoaderOptions(shuffle=False))


@pytest.mark.parametrize("make, why", [
    (lambda ds: DataLoader(ds, sampler=WeightedRandomSampler([1.0] * 10, 10)), "weight the loss"),
    (lambda ds: DataLoader(ds, sampler=SubsetRandomSampler([1, 2])), "Subset"),
    (lambda ds: DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=0)), "shards it"),
    (lambda ds: DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 2, False)), "batch_sampler"),
    (lambda ds: DataLoader(ds, batch_size=None), "batch_size=None"),
    (lambda ds: DataLoader(ds, sampler=RandomSampler(ds, replacement=True)), "replacement"),
    (lambda ds: DataLoader(ds, sampler=RandomSampler(ds, num_samples=5)), "num_samples"),
    (lambda ds: DataLoader(ds, worker_init_fn=print), "worker_init_fn"),
])
def test_a_dataloader_that_cannot_be_split_is_refused(make, why):
    with pytest.raises(ConfigError, match=why) as raised:
        from_dataloader(make(Items(10)))
    assert "\n" not in str(raised.value)
