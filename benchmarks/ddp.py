"""torch DistributedDataParallel with gloo, one rank of the peer benchmark.

    python -m benchmarks.ddp RANK WORLD STEPS PORT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .workload import LR, Clock, batches, model_fn


def main(rank: int, world: int, steps: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(model_fn())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    clock, data = Clock(), batches(rank, world)
    for _ in range(steps):
        x, y = next(data)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        clock.tick()
    dist.destroy_process_group()
    clock.report()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
