"""Input sharding: each worker reads a disjoint shard, reshuffled every epoch.

The order is exactly ``torch.utils.data.DistributedSampler(shuffle=True, seed=seed)``
with ``set_epoch(epoch)``, batched in sampler order with the last short batch kept,
so a one-worker run sees the same batches as a plain ``DataLoader`` over that sampler.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler, default_collate


def sharded_batches(dataset, rank: int, world: int, batch_size: int, seed: int) -> Iterator:
    """Endless batches of this worker's shard, epoch after epoch."""
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        indices = list(sampler)
        if not indices:
            raise ValueError("the dataset is empty: give the workers at least one item each")
        for start in range(0, len(indices), batch_size):
            yield fetch_batch(dataset, indices[start:start + batch_size])
        epoch += 1


def fetch_batch(dataset, indices: list[int]):
    """One batch: the dataset's own batched indexing when it has it, else default_collate."""
    if getattr(dataset, "supports_batch_index", False):
        return dataset[torch.as_tensor(indices)]
    return default_collate([dataset[i] for i in indices])
