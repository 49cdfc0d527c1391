"""The input pipeline: a training loop fed by ``worker_batches`` with 2 loader processes against the same loop
with batches built in its own thread, on a dataset whose batches cost about as much CPU as a training step
(synthetic images "decoded" and augmented on every read); samples/s ratio.

``train_step`` is the whole per-step work, so the same measurement can run through the cluster API.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from pscluster.runtime.data import LoaderOptions, worker_batches

from .common import Result, Target, alternate, compare, repetitions

BATCH = 64
LR = 0.01
WARMUP = 10  # steps left out of every speed: the loader processes' start, first allocations


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


def speed(dataset: Dataset, options: LoaderOptions, steps: int) -> float:
    """Samples/s of ``steps`` training steps fed by ``worker_batches`` (after ``WARMUP`` steps)."""
    torch.manual_seed(0)
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = worker_batches(dataset, 0, 1, BATCH, seed=0, options=options)
    try:
        for _ in range(WARMUP):
            train_step(model, optimizer, next(batches))
        start = time.perf_counter()
        for _ in range(steps):
            train_step(model, optimizer, next(batches))
        return steps * BATCH / (time.perf_counter() - start)
    finally:
        batches.close()


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
    torch.set_num_threads(1)  # the training loop's process, as every benchmark's; loader processes have 1 too
    try:
        work, step_s, batch_s = calibrate()
        steps = 20 if tiny else 100
        dataset = Augmented(work=work)
        options = {"num_workers=2": LoaderOptions(num_workers=2), "num_workers=0": LoaderOptions()}
        # twice the usual repetitions, each a few seconds: the loader processes need this VM's second core,
        # which other processes take now and then
        speeds = alternate({name: (lambda o=o: speed(dataset, o, steps)) for name, o in options.items()},
                           2 * repetitions(tiny))
    finally:
        torch.set_num_threads(threads)
    result = Result("input_pipeline", "Input pipeline: 2 loader processes against batches built in the training "
                    "thread", tiny)
    result.rows.append(compare(f"conv net, batch {BATCH}, SGD, a batch's reads ~ one step", "num_workers=2",
                               speeds["num_workers=2"], "num_workers=0", speeds["num_workers=0"], "samples/s",
                               Target(1.6)))
    result.extra.update(work=work, step_ms=step_s * 1e3, batch_ms=batch_s * 1e3)
    result.notes.append(f"Calibrated in this run: a training step (forward, backward, SGD) {step_s * 1e3:.1f} ms, "
                        f"building one batch of {BATCH} in the training thread {batch_s * 1e3:.1f} ms ({work} rounds "
                        "of augmentation per image), so without loader processes a step costs both, and with them "
                        "at best the larger; 2 at most on 2 cores, where the loader processes and the training loop "
                        "share the cores.")
    result.notes.append(f"{steps} steps per repetition after {WARMUP} left out; each repetition a fresh "
                        "worker_batches (its loader processes forked from the benchmark process, prefetch_factor "
                        "2); 1 torch thread in every process.")
    return result
