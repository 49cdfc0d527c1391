"""The training workload every peer benchmark runs: a 784-256-10 MLP, batch 128 per worker, SGD, on a
fixed synthetic data set, and how a worker's speed is measured (steady-state samples/s, the first
``WARMUP`` steps left out). ``WORKLOAD_MODEL=conv`` in the environment trains a small conv net on the same
inputs seen as 28x28 images instead (compute-bound), ``WORKLOAD_MODEL=wide_conv`` a wider one sized for a GPU,
``WORKLOAD_MODEL=wide_mlp`` a wide MLP whose exchange is as long as its backward,
``WORKLOAD_BATCH`` sets the batch, ``WORKLOAD_DEVICE`` the plain loop's device (``cuda:0``; a pscluster worker's
comes from its task).

    python -m benchmarks.workload plain            a plain single-process loop
    python -m benchmarks.workload pscluster MODE [pipeline] [socket] [no-overlap]
                                                   a pscluster worker (PSCLUSTER_CONFIG set); pipeline
                                                   (async), always over the socket, without sync overlap
    python -m benchmarks.workload loop MODE        a pscluster worker running the workload as a user's own
                                                   loop (``train_fn``, as ``Cluster.run`` runs it)

Both run one round per step count read from stdin (see ``procs.Rounds``).
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch

from pscluster.runtime.data import worker_batches

from .procs import runtime_loop, runtime_worker, serve_rounds

BATCH = int(os.environ.get("WORKLOAD_BATCH", 128))
LR = 0.01
WARMUP = 20  # steps left out of every speed: connections, first allocations
TICK = 10  # a pscluster worker's clock ticks with its progress lines, one every TICK steps
TINY_STEPS = WARMUP + TICK  # the tiny size's rounds: the fewest steps that give a sync worker's speed
SAMPLES = 8192


class Synthetic(torch.utils.data.Dataset):
    """Fixed random inputs of 784 features and labels of 10 classes, indexed a batch at a time."""

    supports_batch_index = True

    def __init__(self, n: int = SAMPLES, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 784, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def conv_net() -> torch.nn.Module:
    """Two 3x3 convolutions, a max pool and two dense layers (1.2 MB of parameters): most of its time is the
    convolutions' compute, little the exchange of its parameters."""
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 28, 28)), torch.nn.Conv2d(1, 16, 3), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(32 * 12 * 12, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def wide_mlp() -> torch.nn.Module:
    """A 784-2048-2048-10 MLP (23 MB of parameters, 16 MB of them in the middle layer): a step whose backward
    and exchange both take tens of milliseconds on a CPU, the case a push during backward is for."""
    return torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 10))


def wide_conv_net() -> torch.nn.Module:
    """Three 3x3 convolutions of 64, 128 and 256 channels and two dense layers (14.6 MB of parameters): a
    model a GPU worker is given, whose exchange per step is large against its compute on a GPU."""
    return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 28, 28)), torch.nn.Conv2d(1, 64, 3), torch.nn.ReLU(),
                               torch.nn.Conv2d(64, 128, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(128, 256, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Flatten(), torch.nn.Linear(256 * 5 * 5, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


MODELS = {"mlp": mlp, "conv": conv_net, "wide_mlp": wide_mlp, "wide_conv": wide_conv_net}
DEVICE = torch.device(os.environ.get("WORKLOAD_DEVICE", "cpu"))
model_fn = MODELS[os.environ.get("WORKLOAD_MODEL", "mlp")]


def batches(rank: int = 0, world: int = 1):
    """This worker's endless batches (the order pscluster's own workers read them in)."""
    return worker_batches(Synthetic(), rank, world, BATCH, seed=0)


class Clock:
    """Steady-state speed: samples/s between the ``WARMUP``-th tick and the last."""

    def __init__(self):
        self.ticks = 0
        self.first = self.last = 0.0
        self.first_tick = 0

    def tick(self, steps: int = 1) -> None:
        self.ticks += steps
        now = time.perf_counter()
        if self.ticks >= WARMUP and not self.first:
            self.first, self.first_tick = now, self.ticks
        self.last = now

    def result(self, **extra) -> dict:
        seconds = self.last - self.first
        rate = (self.ticks - self.first_tick) * BATCH / seconds if seconds > 0 else float("nan")
        return {"samples_per_s": rate, "steps": self.ticks, **extra}



def local_loop(model: torch.nn.Module, steps: int, rank: int = 0, world: int = 1) -> Clock:
    """Forward, backward and an SGD step of ``model`` on this rank's batches, ``steps`` times."""
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    clock, data = Clock(), batches(rank, world)
    for _ in range(steps):
        x, y = (t.to(device, non_blocking=True) for t in next(data))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        clock.tick()
    if device.type == "cuda":  # the steps queued on the GPU count until they have run
        torch.cuda.synchronize(device)
        clock.tick(0)
    return clock


def plain_rounds() -> None:
    """The reference: one process, forward, backward, optimizer step."""
    torch.manual_seed(0)
    model = model_fn().to(DEVICE)
    serve_rounds(lambda steps: local_loop(model, steps).result())


def pscluster_rounds(mode: str, pipeline: bool = False, socket: bool = False, overlap: bool = True) -> None:
    """A worker of the real runtime (``procs.runtime_worker``): each round a new run (INIT by the chief) of
    about ``steps`` steps of this worker; its progress lines, one every ``TICK`` steps, are its clock.
    ``pipeline``: the next gradients are computed while the push-pull is in flight (async); ``socket``: no
    shared-memory lane (as between hosts); ``overlap``: sync pushes leave during backward."""
    from pscluster.task_config import from_environment
    world = len(from_environment()[0].workers)
    runs = itertools.count(1)

    def run(steps: int) -> dict:
        clock = Clock()
        summary = runtime_worker(model_fn, Synthetic(), torch.nn.CrossEntropyLoss(), optimizer="sgd",
                                 lr=LR, mode=mode, steps=steps * (1 if mode == "sync" else world),
                                 batch_size=BATCH, log_every=TICK, run_id=next(runs), pipeline=pipeline,
                                 shared_memory=not socket, overlap=overlap, log=lambda line: clock.tick(TICK))
        return clock.result(**{k: summary[k] for k in ("dropped", "compute_s", "comm_s", "wait_s",
                                                        "overlapped_pushes", "staged_steps")})
    serve_rounds(run)


def train_fn(ctx) -> None:
    """The workload as a user's own loop (``Cluster.run``): the same model, batches, loss and SGD."""
    model = ctx.model(model_fn().to(ctx.device))
    optimizer = ctx.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in ctx.endless_shard(Synthetic(), batch_size=BATCH):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x.to(ctx.device)), y.to(ctx.device)).backward()
        optimizer.step()
        if ctx.should_stop():
            break


def loop_rounds(mode: str) -> None:
    """A worker running ``train_fn`` on the real runtime (``procs.runtime_loop``), each round a new run, as
    ``pscluster_rounds`` runs the library's loop."""
    from pscluster.task_config import from_environment
    world = len(from_environment()[0].workers)
    runs = itertools.count(1)

    def run(steps: int) -> dict:
        clock = Clock()
        summary = runtime_loop(train_fn, run_id=next(runs), mode=mode, steps=steps * (1 if mode == "sync" else world),
                               log_every=TICK, log=lambda line: clock.tick(TICK))
        return clock.result(**{k: summary[k] for k in ("dropped", "compute_s", "comm_s", "wait_s")})
    serve_rounds(run)


if __name__ == "__main__":
    if sys.argv[1] == "plain":
        plain_rounds()
    elif sys.argv[1] == "loop":
        loop_rounds(sys.argv[2])
    else:
        options = set(sys.argv[3:])
        pscluster_rounds(sys.argv[2], pipeline="pipeline" in options, socket="socket" in options,
                         overlap="no-overlap" not in options)
