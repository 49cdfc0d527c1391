"""The floor of a same-host ps: the least a parameter server on one host can do per step, measured beside pscluster
on the same work (issue 56). 1 ps + 1 worker (sync, and pipelined: the next gradients computed while the ps applies
the last ones) and 1 ps + 2 workers (sync); the MLP of ``workload.py``, batch 128 per worker, SGD, one torch thread
per process, the same steps as pscluster, torch DDP (gloo, 2 processes) and the plain single-process loop, all
measured in the same run, alternately. Rows: pscluster against the floor in each case, and the floor against DDP and
the plain loop.

The floor, per step: each worker runs forward and backward, copies its gradients into its own slot of shared memory
(a file in /dev/shm mapped by ``torch.from_file``), and writes a byte into its pipe to the ps (a FIFO); the ps,
blocked reading the pipes of all its workers, applies ``p -= lr * mean(g)`` in place to the values in shared
memory and writes a byte into each worker's pipe back; each worker then copies the values into its model. No
checks, no signing, no run, no messages: one flat float32 buffer of values, one per worker of gradients, two bytes
through pipes. Pipelined (1 worker): the worker copies the values and its new gradients and wakes the ps only once
the ps has answered its last push, then computes its next gradients while the ps applies these (one step stale).

    python -m benchmarks.floor ps FOLDER WORKERS
    python -m benchmarks.floor worker FOLDER RANK WORKERS sync|pipelined   (one round per step count from stdin)
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .workload import LR, TINY_STEPS, Clock, batches, model_fn

SHM = "/dev/shm"
FLOOR_CASES = {"1w sync": (1, False), "1w pipelined": (1, True), "2w sync": (2, False)}  # workers, pipelined


def _buffer(folder: str, name: str, numel: int) -> torch.Tensor:
    """A float32 tensor of ``numel`` elements mapped from ``folder/name`` (created at that size if absent),
    shared with every process that maps it."""
    return torch.from_file(os.path.join(folder, name), shared=True, size=numel, dtype=torch.float32)


def _wait(fd: int) -> None:
    if not os.read(fd, 1):
        raise EOFError("the other side of the pipe has ended")


def serve(folder: str, workers: int) -> None:
    """The ps: the values (seeded as every model here is) in shared memory; each step, once every worker's byte
    has come, ``values -= lr * mean(grads)`` in place and a byte back to each worker. Ends when a worker has."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init = torch.nn.utils.parameters_to_vector(model_fn().parameters()).detach()
    values = _buffer(folder, "values", init.numel())
    values.copy_(init)
    ups, downs = [], []
    for rank in range(workers):  # in the workers' order of opening: each open waits for the other end's
        ups.append(os.open(os.path.join(folder, f"up{rank}"), os.O_RDONLY))
        downs.append(os.open(os.path.join(folder, f"down{rank}"), os.O_WRONLY))
    grads = [_buffer(folder, f"grad{rank}", init.numel()) for rank in range(workers)]
    total = torch.empty_like(values)
    try:
        while True:
            for fd in ups:
                if not os.read(fd, 1):
                    return
            if workers == 1:
                values.sub_(grads[0], alpha=LR)
            else:
                torch.add(grads[0], grads[1], out=total)
                for g in grads[2:]:
                    total.add_(g)
                values.sub_(total, alpha=LR / workers)
            for fd in downs:
                os.write(fd, b"v")
    finally:
        for fd in ups + downs:
            os.close(fd)


def train(folder: str, rank: int, workers: int, how: str) -> None:
    """A worker: its model and batches as ``workload.py``'s; each step forward, backward, the gradients into its
    slot, a byte to the ps, and (sync) the values back into its model once the ps's byte has come. ``pipelined``:
    the push of a step's gradients waits for the ps's answer to the last push, and the next step's compute runs
    while the ps applies them. Per round, its speed (``workload.Clock``) and its seconds computing, copying
    (``comm_s``) and waiting for the ps."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = model_fn()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    grad = _buffer(folder, f"grad{rank}", numel)
    up = os.open(os.path.join(folder, f"up{rank}"), os.O_WRONLY)
    down = os.open(os.path.join(folder, f"down{rank}"), os.O_RDONLY)
    values = _buffer(folder, "values", numel)  # written by the ps before it opened the pipes

    def views(flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view_as(p) for v, p in zip(torch.split(flat, [p.numel() for p in params]), params)]
    grad_views, value_views = views(grad), views(values)
    loss_fn = torch.nn.CrossEntropyLoss()
    pipelined = how == "pipelined"

    def pull() -> None:
        with torch.no_grad():
            torch._foreach_copy_(params, value_views)

    def push() -> None:
        torch._foreach_copy_(grad_views, [p.grad for p in params])
        os.write(up, b"g")
    pull()

    def steps(n: int) -> dict:
        clock, data = Clock(), batches(rank, workers)
        compute = comm = wait = 0.0
        pending = False
        for _ in range(n):
            t0 = time.perf_counter()
            x, y = next(data)
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            t1 = time.perf_counter()
            if pipelined:
                if pending:
                    _wait(down)
                t2 = time.perf_counter()
                pull()
                push()
                pending = True
                wait += t2 - t1
                comm += time.perf_counter() - t2
            else:
                push()
                t2 = time.perf_counter()
                _wait(down)
                t3 = time.perf_counter()
                pull()
                wait += t3 - t2
                comm += t2 - t1 + time.perf_counter() - t3
            compute += t1 - t0
            clock.tick()
        if pending:  # the last push answered within the round: the next one starts with nothing in flight
            _wait(down)
            pull()
            clock.tick(0)
        return clock.result(compute_s=compute, comm_s=comm, wait_s=wait)
    procs.serve_rounds(steps)
    os.close(up)
    os.close(down)


def floor(workers: int, pipelined: bool = False) -> procs.Rounds:
    """The floor's ps and ``workers`` workers, one round per command; their folder (the shared memory and the
    pipes) removed once they have ended."""
    folder = tempfile.mkdtemp(prefix="pscluster-floor-", dir=SHM if os.path.isdir(SHM) else None)
    started = []
    try:
        for rank in range(workers):
            os.mkfifo(os.path.join(folder, f"up{rank}"))
            os.mkfifo(os.path.join(folder, f"down{rank}"))
        started.append(procs.spawn("floor", "ps", folder, workers))
        for rank in range(workers):
            started.append(procs.spawn("floor", "worker", folder, rank, workers,
                                       "pipelined" if pipelined else "sync"))
    except BaseException:
        for child in started:
            child.kill()
            child.wait()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    ps, *trained = started
    return procs.Rounds(trained, [ps], after=lambda: shutil.rmtree(folder, ignore_errors=True))


def run(tiny: bool, out_dir: Path) -> Result:
    from .peers import aggregate, ddp

    steps = TINY_STEPS if tiny else 300
    systems: dict[str, procs.Rounds] = {}
    split: dict[str, list[dict]] = {}

    def measure(name: str) -> float:
        outs = systems[name].round(steps)
        if "plain" not in name and "DDP" not in name:
            split.setdefault(name, []).extend(procs.worker_times(out) for out in outs)
        return aggregate(outs)
    try:
        for case, (workers, pipelined) in FLOOR_CASES.items():
            systems[f"floor {case}"] = floor(workers, pipelined)
            systems[f"pscluster {case}"] = procs.workload_workers("async" if pipelined else "sync", workers,
                                                                  pipeline=pipelined)
        systems["DDP"] = ddp()
        systems["plain"] = procs.Rounds([procs.spawn("workload", "plain")])
        # twice the usual repetitions, as hidden's: rounds of a second or two on a VM whose speed moves
        speeds = alternate({name: (lambda name=name: measure(name)) for name in systems}, repetitions(tiny, times=2),
                           warmup=not tiny)
    finally:
        procs.close_all(systems.values())
    result = Result("floor", "The floor: a minimal same-host ps (shared memory, pipes) against pscluster, DDP and the "
                    "plain loop (MLP 784-256-10, batch 128 per worker, SGD)", tiny)
    unit = "samples/s"

    def label(system: str, case: str) -> str:
        workers, pipelined = FLOOR_CASES[case]
        return f"{system}, 1 ps + {workers} worker{'s' * (workers > 1)}, {'async pipelined' if pipelined else 'sync'}"
    for case in FLOOR_CASES:
        result.rows.append(compare(f"{case}: pscluster vs the floor", label("pscluster", case),
                                   speeds[f"pscluster {case}"], label("floor", case), speeds[f"floor {case}"], unit,
                                   Target(0.85)))
    result.rows += [
        compare("2w sync: the floor vs DDP", label("floor", "2w sync"), speeds["floor 2w sync"],
                "DDP gloo, 2 processes", speeds["DDP"], unit),
        compare("1w sync: the floor vs the plain loop", label("floor", "1w sync"), speeds["floor 1w sync"],
                "plain loop", speeds["plain"], unit),
        compare("1w pipelined: the floor vs the plain loop", label("floor", "1w pipelined"),
                speeds["floor 1w pipelined"], "plain loop", speeds["plain"], unit),
    ]
    result.extra["worker_time_split"] = split
    times = {name: procs.step_split(rounds, steps) for name, rounds in split.items()}
    result.notes.append("Where a worker's step goes (its own timers, ms, medians over rounds and workers; the "
                        "floor's exchange is its two copies and the pipe byte, pscluster's the push-pull beyond what "
                        "overlaps it; both hold the time the ps, woken, ran on the worker's core): " + "; ".join(
                            f"{name} compute {t['compute_s']:.2f}, exchange {t['comm_s']:.2f}, waiting for the ps "
                            f"{t['wait_s']:.2f}" for name, t in times.items()) + ".")
    floor_ddp = statistics.median(a / b for a, b in zip(speeds["floor 2w sync"], speeds["DDP"]))
    result.notes.append(f"The floor's 2 workers ran at {floor_ddp:.2f}x DDP: pscluster at 0.85 of the floor would be "
                        f"{0.85 * floor_ddp:.2f}x DDP, against pscluster's own target of 1.5x (peers).")
    result.notes.append(f"{steps} steps per worker per repetition (the first 20 left out), the systems alternated "
                        "within each repetition, one round of each left out before them; every process has one torch "
                        "thread and is started once (3 or 2 processes for the ps systems, 2 for DDP, 1 for the plain "
                        "loop); each pscluster repetition is a new run. The floor (floor.py): each worker copies its "
                        "gradients into shared memory and writes a byte into a pipe; the ps, woken by all of them, "
                        "applies p -= lr * mean(g) in place on the shared values and answers each with a byte; the "
                        "worker copies the values into its model. Pipelined: the worker computes its next gradients "
                        "while the ps applies the last ones (one step stale), as pscluster's async pipelined mode.")
    return result


if __name__ == "__main__":
    role, folder, *rest = sys.argv[1:]
    if role == "ps":
        serve(folder, int(rest[0]))
    else:
        train(folder, int(rest[0]), int(rest[1]), rest[2])
