"""A ``torch.distributed.rpc`` parameter server written the way PyTorch's tutorial "Implementing Batch RPC
Processing Using Asynchronous Executions" does: rank 0 owns a BatchUpdateParameterServer; trainers send
their gradients with ``rpc_sync`` to ``update_and_fetch_model``, an ``@async_execution`` function that
sums them and, once every trainer's are in, applies the mean and returns the model to all of them.

    python -m benchmarks.rpc_ps RANK WORKERS PORT     (rank 0, the ps, runs one round per step count read
                                                      from stdin and prints every trainer's speed)
"""

from __future__ import annotations

import os
import sys
import threading

import torch
import torch.distributed.rpc as rpc

from .procs import serve_rounds
from .workload import LR, Clock, batches, model_fn


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size: int):
        torch.manual_seed(0)
        self.model = model_fn()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def run_trainer(ps_rref, rank: int, workers: int, steps: int) -> dict:
    loss_fn = torch.nn.CrossEntropyLoss()
    model = ps_rref.rpc_sync().get_model()
    clock, data = Clock(), batches(rank, workers)
    for _ in range(steps):
        x, y = next(data)
        loss_fn(model(x), y).backward()
        model = rpc.rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                             args=(ps_rref, [p.grad for p in model.parameters()]))
        clock.tick()
    return clock.result()


def main(rank: int, workers: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=workers + 1)
    if rank == 0:
        ps_rref = rpc.RRef(BatchUpdateParameterServer(workers))

        def train(steps: int) -> dict:
            futures = [rpc.rpc_async(f"trainer{r}", run_trainer, args=(ps_rref, r - 1, workers, steps))
                       for r in range(1, workers + 1)]
            return {"workers": torch.futures.wait_all(futures)}
        serve_rounds(train)
    rpc.shutdown()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
