"""torch DistributedDataParallel with gloo, one rank of the peer benchmark.

    python -m benchmarks.ddp RANK WORLD PORT      (one round per step count read from stdin)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .procs import serve_rounds
from .workload import local_loop, model_fn


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(model_fn())
    serve_rounds(lambda steps: local_loop(model, steps, rank, world).result())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
