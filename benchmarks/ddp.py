"""torch DistributedDataParallel with gloo, one rank of the peer benchmark.

    python -m benchmarks.ddp RANK WORLD STEPS PORT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .workload import local_loop, model_fn


def main(rank: int, world: int, steps: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    clock = local_loop(torch.nn.parallel.DistributedDataParallel(model_fn()), steps, rank, world)
    dist.destroy_process_group()
    clock.report()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
