"""The input pipeline: a pscluster worker (1 ps + 1 worker of the real runtime, sync) with 2 loader processes
against the same worker building its batches in its own thread, on a dataset whose batches cost about as much CPU as
a training step (synthetic images "decoded" and augmented on every read); samples/s ratio.

    python -m benchmarks.input_pipeline worker WORK LOADERS    a worker child (PSCLUSTER_CONFIG set), rounds on stdin
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from pscluster.runtime.data import worker_batches

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .procs import serve_rounds

BATCH = 64
LR = 0.01
WARMUP = 10  # steps left out of every speed: the loader processes' start, first allocations, the chief's INIT
TICK = 5  # a worker's clock ticks with its progress lines, one every TICK steps


class Augmented(Dataset):
    """Synthetic 3x40x40 images, made and augmented on every read (``work`` rounds of blur and jitter, then
    a random 32x32 crop and flip): CPU work in torch and Python, like decoding and augmenting a JPEG."""

    def __init__(self, n: int = 4096, work: int = 1):
        self.n, self.work = n, work

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        image = torch.rand(1, 3, 40, 40, generator=g)  # "decode"
        for _ in range(self.work):
            image = F.avg_pool2d(image, 3, stride=1, padding=1)
            image = (image * (0.9 + 0.2 * torch.rand(1, 3, 1, 1, generator=g))).clamp_(0, 1)
        top, left = torch.randint(0, 9, (2,), generator=g).tolist()
        image = image[0, :, top:top + 32, left:left + 32]
        if torch.rand((), generator=g) < 0.5:
            image = image.flip(-1)
        return (image - 0.5) / 0.25, i % 10


def model_fn() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> float:
    """One step on ``batch``: forward, cross-entropy, backward, optimizer step; the loss."""
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def worker_rounds(work: int, loaders: int) -> None:
    """A pscluster worker of the real runtime (``procs.runtime_worker``, PSCLUSTER_CONFIG set): each round a new
    sync run of ``steps`` steps on ``Augmented(work=work)`` with ``loaders`` loader processes; its progress lines,
    one every ``TICK`` steps, are its clock (the first ``WARMUP`` steps left out)."""
    runs = itertools.count(1)

    def run(steps: int) -> dict:
        ticks = []
        procs.runtime_worker(model_fn, Augmented(work=work), torch.nn.CrossEntropyLoss(), optimizer="sgd", lr=LR,
                             steps=WARMUP + steps, batch_size=BATCH, log_every=TICK, run_id=next(runs),
                             loader_workers=loaders, log=lambda line: ticks.append(time.perf_counter()))
        first, last = ticks[WARMUP // TICK - 1], ticks[-1]
        return {"samples_per_s": (len(ticks) - WARMUP // TICK) * TICK * BATCH / (last - first)}
    serve_rounds(run)


def _median_s(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate() -> tuple[int, float, float]:
    """``work`` such that building one batch costs about one training step; (work, step s, batch s)."""
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batch = next(worker_batches(Augmented(), 0, 1, BATCH, seed=0))
    step_s = _median_s(lambda: train_step(model, optimizer, batch), 30)

    def batch_s(work: int) -> float:
        return _median_s(lambda: next(worker_batches(Augmented(BATCH, work), 0, 1, BATCH, seed=0)), 5)
    one, five = batch_s(1), batch_s(5)
    work = max(1, round(1 + (step_s - one) / ((five - one) / 4)))
    return work, step_s, batch_s(work)


def run(tiny: bool, out_dir: Path) -> Result:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every benchmark process; the workers, ps and loader processes have 1 too
    try:
        work, step_s, batch_s = calibrate()
    finally:
        torch.set_num_threads(threads)
    steps = 20 if tiny else 100
    contenders = {}
    for name, loaders in (("loader_workers=2", 2), ("loader_workers=0", 0)):
        cluster = procs.PSProcesses(1, workers=1)
        contenders[name] = procs.Rounds([procs.spawn("input_pipeline", "worker", work, loaders,
                                                     **cluster.worker_env(0))], after=cluster.close)
    try:
        # twice the usual repetitions, each a few seconds: the loader processes need this VM's second core, which
        # other processes take now and then
        speeds = alternate({name: (lambda r=r: r.round(steps)[0]["samples_per_s"]) for name, r in contenders.items()},
                           repetitions(tiny, times=2))
    finally:
        procs.close_all(contenders.values())
    result = Result("input_pipeline", "Input pipeline: a worker with 2 loader processes against one building its "
                    "batches in the training thread", tiny)
    result.rows.append(compare(f"conv net, batch {BATCH}, 1 ps + 1 worker sync, a batch's reads ~ one step",
                               "loader_workers=2", speeds["loader_workers=2"], "loader_workers=0",
                               speeds["loader_workers=0"], "samples/s", Target(1.6)))
    result.extra.update(work=work, step_ms=step_s * 1e3, batch_ms=batch_s * 1e3)
    result.notes.append(f"Calibrated in this run, in one process: a training step (forward, backward, SGD) "
                        f"{step_s * 1e3:.1f} ms, building one batch of {BATCH} {batch_s * 1e3:.1f} ms ({work} rounds "
                        "of augmentation per image). Without loader processes a worker's step costs both; with them "
                        "at best the larger: 2 at most, on 2 cores that the worker, its loader processes and the ps "
                        "share.")
    result.notes.append(f"Each repetition a new run of {WARMUP} + {steps} steps through procs.runtime_worker "
                        f"(the runtime's worker, loader processes forked at its start, prefetch_factor 2), the first "
                        f"{WARMUP} left out; 1 torch thread in every process.")
    return result


if __name__ == "__main__":
    worker_rounds(int(sys.argv[2]), int(sys.argv[3]))
