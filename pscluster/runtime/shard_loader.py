"""``ctx.shard(loader)``: a worker's DataLoader, one epoch of its part of the data per iteration.

- **One worker** reads the DataLoader as the plain script does: its own sampler (or batch sampler), generator,
  loader processes and worker seeds, so its batches come in the plain order with the plain random draws, and a
  one-worker sync run of an unmodified script is the plain script.
- **N workers** split each epoch as ``DistributedSampler`` does, seeded with the run's seed so that every worker
  draws the same order: a map-style dataset's indices (shuffled every epoch when the loader shuffles, in order
  otherwise) are padded to a multiple of N by repeating the first ones, and worker ``rank`` reads every N-th from
  ``rank``: each worker reads ``ceil(len / N)`` items an epoch, batched by the loader's ``batch_size`` and
  ``drop_last``. An ``IterableDataset``'s items are dealt out the same way as they come (item ``k`` of each
  loader process's stream to worker ``k % N``), so parts may differ by an item; a dataset that sets
  ``pscluster_sharded = True`` reads its part itself (``data.shard()``).
- The epoch advances by itself at each ``iter()`` (``set_epoch`` on the sampler pscluster made; a sampler of the
  user's is left as the user drives it). When an epoch's first batch is read, ``began(epoch, batches)`` is told
  (the worker's metrics: the views show each worker's epoch).

``len()``, ``.dataset``, ``.batch_size``, ``.sampler``, ``.num_workers`` read as a DataLoader's (it is one); for
N workers ``.sampler`` is the ``DistributedSampler`` of this worker's part, and ``.dataset`` of an
``IterableDataset`` the wrapper that deals its items.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, get_worker_info

from ..errors import ConfigError
from . import seeding
from .data import DEFAULT_BATCH_SIZE, enter_shard, shuffles

DATASET_DEFAULTS = {"batch_size": DEFAULT_BATCH_SIZE, "shuffle": True}  # ``ctx.shard(dataset)``: a training set's


class _Part(IterableDataset):
    """Worker ``rank`` of ``world``'s items of an IterableDataset (see the module)."""

    def __init__(self, dataset: IterableDataset, rank: int, world: int):
        self.dataset, self.rank, self.world = dataset, rank, world

    def __iter__(self) -> Iterator:
        if getattr(self.dataset, "pscluster_sharded", False):
            info = get_worker_info()
            loaders = info.num_workers if info else 1
            enter_shard(self.rank * loaders + (info.id if info else 0), self.world * loaders)
            return iter(self.dataset)
        return itertools.islice(iter(self.dataset), self.rank, None, self.world)


def _settings(loader: DataLoader) -> dict:
    """What a DataLoader was built with, besides its dataset and how it samples."""
    return dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                in_order=loader.in_order)


def _sampling(loader: DataLoader, rank: int, world: int, seed: int) -> tuple[object, dict]:
    """(the dataset, the sampling arguments) of worker ``rank``'s DataLoader over ``loader``'s data."""
    if world == 1:
        if loader.batch_size is None and loader.batch_sampler is not None:  # a batch sampler of the user's
            return loader.dataset, dict(batch_sampler=loader.batch_sampler)
        if isinstance(loader.dataset, IterableDataset):  # read as it comes: DataLoader takes no sampler for it
            return loader.dataset, dict(batch_size=loader.batch_size, drop_last=loader.drop_last)
        return loader.dataset, dict(batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last)
    if loader.batch_size is None and loader.batch_sampler is not None:
        raise ConfigError("a DataLoader with a batch_sampler cannot be split across workers: give "
                          "DataLoader(dataset, batch_size=..., shuffle=...), and ctx.shard splits its epochs")
    if isinstance(loader.sampler, DistributedSampler):
        raise ConfigError("a DataLoader with a DistributedSampler given to ctx.shard: pscluster splits the epochs "
                          "across its workers itself; give DataLoader(dataset, shuffle=True or False)")
    shuffle = shuffles(loader)
    if isinstance(loader.dataset, IterableDataset):
        return _Part(loader.dataset, rank, world), dict(batch_size=loader.batch_size, drop_last=loader.drop_last)
    part = DistributedSampler(loader.dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    return loader.dataset, dict(batch_size=loader.batch_size, sampler=part, drop_last=loader.drop_last)


class ShardLoader(DataLoader):
    """Worker ``rank`` of ``world``'s DataLoader over ``loader``'s data (see the module). ``seed``: the run's (the
    order N workers share). ``stream(make)``: what an iteration returns, given the function that starts the
    epoch's DataLoader iterator (the worker context's read-ahead and end of the run, ``streams.Batches``).
    ``began(epoch, batches)``: called as an epoch's first batch is read, with its number (1 for the first) and
    ``len()`` (None where the loader has none: a part of an IterableDataset without a length)."""

    def __init__(self, loader: DataLoader, rank: int, world: int, seed: int,
                 stream: Callable[[Callable[[], Iterator]], Iterator],
                 began: Callable[[int, int | None], None] | None = None):
        dataset, sampling = _sampling(loader, rank, world, seed)
        super().__init__(dataset, **sampling, **_settings(loader))
        self.epoch = 0  # the epoch the next iteration reads
        self._stream = stream
        self._began = began
        self._current = None  # the iteration under way

    def __iter__(self) -> Iterator:
        if isinstance(self.sampler, DistributedSampler):  # the part pscluster made (a user's is never given here)
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        self.close()
        self._current = self._stream(functools.partial(self._begin, self.epoch))
        return self._current

    def _begin(self, epoch: int) -> Iterator:
        """Epoch ``epoch``'s DataLoader iterator, made when its first batch is asked for (``began`` told)."""
        if self._began is not None:
            try:
                batches = len(self)
            except TypeError:  # an IterableDataset without __len__
                batches = None
            self._began(epoch, batches)
        return super().__iter__()

    def read_ahead(self) -> None:
        """Read the iteration's next batches while an exchange is in flight (``streams.Batches.read_ahead``)."""
        if self._current is not None:
            self._current.read_ahead()

    def close(self) -> None:
        """End the iteration under way (its loader processes with it)."""
        if self._current is not None:
            self._current.close()
            self._current = None


def shard_loader(data, rank: int, world: int, seed: int, stream, kwargs: dict, began=None) -> ShardLoader:
    """``ctx.shard(data, **kwargs)``: over a DataLoader (no ``kwargs``), or over a dataset with DataLoader's keyword
    arguments (``DATASET_DEFAULTS`` where not given; a ``generator`` of the worker's own, seeded from the run's seed
    and the worker, unless one is given: a loop that makes no DataLoader of its own draws nothing for one).
    ``stream``, ``began``: as ``ShardLoader`` takes them."""
    if isinstance(data, DataLoader):
        if kwargs:
            raise ConfigError(f"ctx.shard(loader, {', '.join(kwargs)}=...): a DataLoader brings its own settings; set "
                              "them on the DataLoader, or give ctx.shard the dataset")
        loader = data
    else:
        if not isinstance(data, IterableDataset) and not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise ConfigError("ctx.shard(data): give a DataLoader, a map-style dataset (len() and indexing) or an "
                              "IterableDataset")
        if isinstance(data, IterableDataset):
            kwargs = {"shuffle": False, **kwargs}  # an IterableDataset comes in its own order
        # no DataLoader of the user's to read as it reads: its order and seeds from the worker's own generator,
        # not from torch's global one, whose draws are the loop's (its dropout, its noise)
        kwargs.setdefault("generator", torch.Generator().manual_seed(seeding.worker_seed(seed, rank)))
        try:
            loader = DataLoader(data, **{**DATASET_DEFAULTS, **kwargs})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"ctx.shard(dataset, ...): {e}: give DataLoader's keyword arguments") from None
    return ShardLoader(loader, rank, world, seed, stream, began)
