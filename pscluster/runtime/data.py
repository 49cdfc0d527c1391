"""The workers' input: each worker reads its own part of the data, epoch after epoch, with ``DataLoader``
semantics, its batches built ahead of the training step by loader processes when asked.

Map-style datasets: worker ``rank`` of ``world`` reads the indices of
``DistributedSampler(num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)`` with ``set_epoch(epoch)``
every epoch, batched in sampler order, the last short batch kept unless ``drop_last``: one worker reads the
batches of a plain ``DataLoader`` over that sampler. With ``num_workers`` loader processes the same batches
come in the same order (for a deterministic dataset; random augmentations draw from each loader process's
own RNG, seeded from ``seed`` and ``rank`` as ``DataLoader`` seeds its workers).

An ``IterableDataset`` is read by one stream per worker and loader process: stream ``rank * L + i`` of
``world * L`` (``L = max(1, num_workers)``, ``i`` the loader process) collates items ``k`` of each pass with
``k % (world * L) == rank * L + i``, so every stream reads the whole pass and keeps its part. A dataset that
reads only its own part sets ``pscluster_sharded = True`` and calls ``shard()`` at the start of
``__iter__``. When a pass ends the stream starts the next; a stream whose pass made no batch ends, and a
worker all of whose streams ended gets a ConfigError.

Loader processes are forked (``multiprocessing_context="fork"``) at the first ``next()``, in the calling
thread: nothing is pickled on the way in, so datasets and collate functions defined in a notebook and
shipped by value work, and an in-memory dataset is shared copy-on-write. The other threads of the process
(ZeroMQ, metrics, the kernel's) do not matter to them, except one inside a torch random op at that moment:
its generator lock stays held in the child, whose seeding by DataLoader then waits forever. Loader
processes cannot use CUDA. What comes back is pickled, so a batch may hold only classes importable in the
worker (tensors, numbers, strings, tuples, lists, dicts; a notebook's namedtuple is not): one that holds
another is refused with a ConfigError, and an error of such a class becomes a TrainingError, rather than
being lost (which would hang the step).
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, WeightedRandomSampler, default_collate, get_worker_info)
from torch.utils.data._utils.pin_memory import pin_memory  # what DataLoader pins with when num_workers=0

from ..errors import ConfigError, TrainingError

__all__ = ["LoaderOptions", "worker_batches", "fetch_batch", "in_order", "first_batch", "from_dataloader", "shard",
           "enter_shard", "shuffles", "training_input"]


@dataclass(frozen=True)
class LoaderOptions:
    """How a worker reads its batches; JSON round trip: ``dataclasses.asdict`` and ``LoaderOptions(**d)``.

    ``num_workers``: loader processes per pscluster worker (0: batches built in the training thread).
    ``prefetch_factor``: batches each loader process keeps ready (``DataLoader``'s; 2 when None).
    ``pin_memory``: batches in page-locked memory, for workers whose device is CUDA (ignored on others).
    ``shuffle``: a new order every epoch (map-style datasets; an IterableDataset comes in its own order).
    ``drop_last``: leave out the last short batch of each epoch.
    """

    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self):
        if type(self.num_workers) is not int or self.num_workers < 0:
            raise ConfigError(f"num_workers={self.num_workers!r}: give a number of loader processes, 0 or more")
        if self.prefetch_factor is not None:
            if type(self.prefetch_factor) is not int or self.prefetch_factor < 1:
                raise ConfigError(f"prefetch_factor={self.prefetch_factor!r}: give 1 or more batches per loader "
                                  "process, or None")
            if self.num_workers == 0:
                raise ConfigError(f"prefetch_factor={self.prefetch_factor} needs loader processes: set "
                                  "num_workers > 0, or leave prefetch_factor unset")
        for name in ("pin_memory", "shuffle", "drop_last"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{name}={getattr(self, name)!r}: give True or False")


_DEFAULTS = LoaderOptions()
DEFAULT_BATCH_SIZE = 64  # per worker, where neither the call nor a DataLoader gives one


def worker_batches(dataset, rank: int, world: int, batch_size: int, seed: int,
                   options: LoaderOptions = _DEFAULTS, collate_fn: Callable | None = None,
                   device=None) -> Iterator:
    """Endless batches of worker ``rank`` of ``world``, epoch after epoch (see the module docstring).

    ``collate_fn`` (default ``default_collate``) turns a list of items into a batch of any structure.
    ``device``: the worker's; batches are pinned when it is CUDA and ``options.pin_memory``.
    Loader processes start at the first ``next()`` and end at ``close()``, when the iterator is garbage
    collected, or with this process (killed, it is missed within 5 s). One DataLoader iteration serves the
    whole run, its sampler endless: the processes start once, and no epoch's end empties the prefetch.
    Raises ConfigError (at the call, or for an IterableDataset after a pass) when the worker gets no batch.
    """
    pin = options.pin_memory and device is not None and torch.device(device).type == "cuda"
    loaders = max(1, options.num_workers)
    if isinstance(dataset, IterableDataset):
        source, sampler = _Stream(dataset, rank * loaders, world * loaders, batch_size, collate_fn,
                                  options.drop_last), None
    else:
        source = _Fetch(dataset, collate_fn)
        sampler = _IndexBatches(dataset, rank, world, batch_size, seed, options.shuffle, options.drop_last)
    starved = (f"the dataset gave worker {rank} no {'full ' if options.drop_last else ''}batch of {batch_size} in a "
               f"whole pass ({world} workers x {loaders} loader processes, each stream keeping every "
               f"{world * loaders}th item): give it more items, or use fewer workers or loader processes")
    if options.num_workers == 0:
        return _in_thread(source, sampler, pin, starved)
    # batch_size=None: the sampler yields whole index lists (or the stream whole batches), fetched as one item;
    # the generator seeds the loader processes per worker without drawing from the training RNG
    loader = DataLoader(source, batch_size=None, sampler=sampler, collate_fn=_sendable,
                        num_workers=options.num_workers, prefetch_factor=options.prefetch_factor, pin_memory=pin,
                        multiprocessing_context="fork", generator=torch.Generator().manual_seed(seed * world + rank))
    return _loaded(loader, starved)


def _in_thread(source, sampler, pin: bool, starved: str) -> Iterator:
    for batch in iter(source) if sampler is None else (source[indices] for indices in sampler):
        yield pin_memory(batch) if pin else batch
    raise ConfigError(starved)


def _loaded(loader: DataLoader, starved: str) -> Iterator:
    batches = iter(loader)  # forks the loader processes; each one's first batches are asked for at once
    try:
        yield from batches
    finally:
        batches._shutdown_workers()  # now, not when the iterator is collected: what DataLoader's __del__ calls
    raise ConfigError(starved)


class _IndexBatches:
    """The index lists of worker ``rank``'s batches: its DistributedSampler shard, set_epoch every epoch."""

    def __init__(self, dataset, rank: int, world: int, batch_size: int, seed: int, shuffle: bool, drop_last: bool):
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        shard_size = len(self.sampler)  # the same every epoch
        if shard_size == 0:
            raise ConfigError("the dataset is empty: give the workers at least one item each")
        self.stop = shard_size - shard_size % batch_size if drop_last else shard_size
        if self.stop == 0:
            raise ConfigError(f"worker {rank} reads {shard_size} items per epoch, fewer than batch_size={batch_size}, "
                              "and drop_last drops them all: give more data, a smaller batch_size, or drop_last=False")

    def __iter__(self) -> Iterator[list[int]]:
        for epoch in itertools.count():
            self.sampler.set_epoch(epoch)
            indices = list(self.sampler)
            for start in range(0, self.stop, self.batch_size):
                yield indices[start:start + self.batch_size]


class _Fetch(Dataset):
    """A map-style dataset whose item at a list of indices is the batch of those indices."""

    def __init__(self, dataset, collate_fn: Callable | None):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __getitem__(self, indices: list[int]):
        with _errors_that_cross():
            return fetch_batch(self.dataset, indices, self.collate_fn)


class _Stream(IterableDataset):
    """The batches of one stream of an IterableDataset: stream ``first + i`` of ``count`` in loader process
    ``i`` (0 outside any), pass after pass, until a pass makes no batch."""

    def __init__(self, dataset, first: int, count: int, batch_size: int, collate_fn: Callable | None,
                 drop_last: bool):
        self.dataset, self.first, self.count = dataset, first, count
        self.batch_size, self.collate, self.drop_last = batch_size, collate_fn or default_collate, drop_last

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        index = self.first + (info.id if info else 0)
        strided = not getattr(self.dataset, "pscluster_sharded", False)
        with _errors_that_cross():
            while True:
                enter_shard(index, self.count)  # read by the dataset's __iter__, which runs at the first next()
                items = iter(self.dataset)
                if strided:
                    items = itertools.islice(items, index, None, self.count)
                made, batch = 0, []
                for item in items:
                    batch.append(item)
                    if len(batch) == self.batch_size:
                        yield self.collate(batch)
                        made, batch = made + 1, []
                if batch and not self.drop_last:
                    yield self.collate(batch)
                    made += 1
                if not made:
                    return


_here = threading.local()


def enter_shard(index: int, count: int) -> None:
    """Make stream ``index`` of ``count`` the one ``shard()`` names in this thread (at the start of a pass)."""
    _here.shard = (index, count)


def shard() -> tuple[int, int]:
    """``(index, count)`` of the IterableDataset stream that last began a pass in this thread: stream
    ``rank * L + i`` of ``world * L`` (loader process ``i`` of ``L``); ``(0, 1)`` before any. A dataset with
    ``pscluster_sharded = True`` calls it at the start of ``__iter__`` and yields only its part."""
    return getattr(_here, "shard", (0, 1))


def fetch_batch(dataset, indices: list[int], collate_fn: Callable | None = None):
    """The batch of ``dataset``'s items at ``indices``: ``collate_fn`` (default ``default_collate``) over the
    items, taken with the dataset's ``__getitems__`` when it has one (as DataLoader does); without
    ``collate_fn``, the dataset's own batched indexing when it has it (``supports_batch_index``)."""
    if collate_fn is None and getattr(dataset, "supports_batch_index", False):
        return dataset[torch.as_tensor(indices)]
    items = dataset.__getitems__(indices) if hasattr(dataset, "__getitems__") else [dataset[i] for i in indices]
    return (collate_fn or default_collate)(items)


@functools.cache
def _importable(cls: type) -> bool:
    """Whether pickle can name ``cls`` in the worker process (a class from a notebook, shipped by value, or
    defined in a function, cannot: pickling it in a loader process fails in a thread, and its batch is lost)."""
    found = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _sendable(batch):
    """``batch``, checked in its loader process to hold only importable classes (its collate_fn there)."""
    stack = [batch]
    while stack:
        value = stack.pop()
        if value is not None and not _importable(type(value)):
            raise ConfigError(f"a batch holds a {type(value).__module__}.{type(value).__qualname__}, a class loader "
                              "processes cannot send back: return tensors, numbers, strings, tuples, lists or dicts "
                              "from the dataset and collate_fn, or set num_workers=0")
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(itertools.chain(value.keys(), value.values()))
    return batch


@contextmanager
def _errors_that_cross():
    """In a loader process, an error whose class the worker cannot import becomes a TrainingError (with the
    original's traceback): DataLoader would lose the original, and the worker would wait forever."""
    try:
        yield
    except Exception as error:
        if get_worker_info() is None or _importable(type(error)):
            raise
        raise TrainingError(f"{type(error).__name__}: {error}") from error


def shuffles(loader: DataLoader) -> bool:
    """Whether ``loader`` reads its map-style dataset in a new order every epoch (a RandomSampler) or in order (a
    SequentialSampler, or any IterableDataset): what a split of its epochs across workers keeps. ConfigError for a
    sampler that does not read each item once per epoch, which cannot be split."""
    sampler = loader.sampler
    if isinstance(loader.dataset, IterableDataset) or type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler.num_samples != len(sampler.data_source):
            raise ConfigError("RandomSampler(replacement=True or num_samples=...) cannot be split across workers, "
                              "which read each item once per epoch: use shuffle=True, or resample the dataset itself")
        return True
    if isinstance(sampler, WeightedRandomSampler):
        raise ConfigError("a WeightedRandomSampler cannot be split across workers, which read each item once per "
                          "epoch: weight the loss instead, or give a dataset that repeats items in the proportions "
                          "wanted, with shuffle=True")
    raise ConfigError(f"a {type(sampler).__name__} cannot be split across workers: give the dataset (a "
                      "torch.utils.data.Subset for some of it) with shuffle=True or False; pscluster shards it "
                      "as DistributedSampler does")


def from_dataloader(loader: DataLoader) -> tuple[object, int, Callable | None, LoaderOptions]:
    """``(dataset, batch_size, collate_fn, options)`` of a DataLoader given in place of a dataset; collate_fn is
    None for torch's ``default_collate``. Its sampler must be a SequentialSampler or a RandomSampler (each item
    once per epoch): pscluster shards the dataset itself. Its generator, timeout, multiprocessing_context and
    persistent_workers are not carried (pscluster seeds, forks, and keeps its loader processes for the run).
    Raises ConfigError for what cannot be sharded, saying what to give instead."""
    if loader.batch_size is None:
        raise ConfigError("a DataLoader with a batch_sampler or batch_size=None cannot be split across workers: give "
                          "DataLoader(dataset, batch_size=..., shuffle=...), or the dataset and LoaderOptions")
    if loader.worker_init_fn is not None:
        raise ConfigError("DataLoader(worker_init_fn=...) is not carried to pscluster's loader processes: do that "
                          "setup in the dataset (on its first __getitem__ or __iter__) and drop worker_init_fn")
    shuffle = shuffles(loader)
    options = LoaderOptions(num_workers=loader.num_workers, pin_memory=loader.pin_memory, shuffle=shuffle,
                            drop_last=loader.drop_last,
                            prefetch_factor=loader.prefetch_factor if loader.num_workers else None)
    collate_fn = None if loader.collate_fn is default_collate else loader.collate_fn
    return loader.dataset, loader.batch_size, collate_fn, options



def in_order(dataset, batch_size: int, collate_fn: Callable | None = None) -> Iterator:
    """The dataset's batches once, in its order (evaluation): a DataLoader's own; an IterableDataset's items, or a
    map-style dataset's by index, ``batch_size`` at a time, collated as the workers collate them."""
    if isinstance(dataset, DataLoader):
        yield from dataset
        return
    if isinstance(dataset, IterableDataset):
        items = iter(dataset)
        while chunk := list(itertools.islice(items, batch_size)):
            yield (collate_fn or default_collate)(chunk)
        return
    for start in range(0, len(dataset), batch_size):
        yield fetch_batch(dataset, list(range(start, min(start + batch_size, len(dataset)))), collate_fn)


def first_batch(dataset, size: int = 2, collate_fn: Callable | None = None):
    """A batch of the dataset's first ``size`` items (fewer when it has fewer), as the workers collate them: what
    the controller tries the training step on at ``train()``."""
    batch = next(in_order(dataset, size, collate_fn), None)
    if batch is None:
        raise ConfigError("the dataset is empty: give the workers at least one item each")
    return batch


def training_input(dataset, batch_size: int | None, collate_fn, loader_workers: int = 0, prefetch_factor=None,
                   pin_memory: bool = False) -> tuple[object, int, Callable | None, LoaderOptions]:
    """(dataset, batch size, collate_fn, LoaderOptions) of ``Cluster.train``'s arguments: a DataLoader taken apart, or a
    dataset with the options given; ConfigError for what the workers cannot read."""
    if isinstance(dataset, DataLoader):
        if collate_fn is not None or loader_workers or prefetch_factor is not None or pin_memory:
            raise ConfigError("a DataLoader given as the dataset brings its own collate_fn, num_workers, "
                              "prefetch_factor and pin_memory: set them on the DataLoader, or give its dataset")
        dataset, loader_batch, collate_fn, loader = from_dataloader(dataset)
        if batch_size is not None and batch_size != loader_batch:
            raise ConfigError(f"batch_size={batch_size} but the DataLoader's is {loader_batch}: give one of them")
        return dataset, loader_batch, collate_fn, loader
    if not isinstance(dataset, IterableDataset) and not (hasattr(dataset, "__len__") and
                                                         hasattr(dataset, "__getitem__")):
        raise ConfigError("dataset must be a map-style dataset (len() and indexing), an IterableDataset or a "
                          "DataLoader, e.g. pscluster.datasets.digits('train')")
    if collate_fn is not None and not callable(collate_fn):
        raise ConfigError("collate_fn must be a function of a list of items that returns a batch")
    loader = LoaderOptions(num_workers=loader_workers, prefetch_factor=prefetch_factor, pin_memory=pin_memory)
    return dataset, DEFAULT_BATCH_SIZE if batch_size is None else batch_size, collate_fn, loader
