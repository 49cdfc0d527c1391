"""Peers on the same work: pscluster (sync and async, 1 ps + 2 workers) against torch DDP (gloo, 2 processes),
a torch.distributed.rpc ps written as PyTorch's tutorial does (1 ps + 2 trainers), and a bare ZeroMQ ps
(1 ps + 2 workers, sync and async); the MLP of ``workload.py``, batch 128 per worker, SGD, one torch thread
per process. Speed: aggregate samples/s, the sum of every worker's steady-state speed.

pscluster runs as the product runs outside a notebook: each ps a ``python -m pscluster.runtime`` process,
each worker a process calling ``train_from_environment``."""

from __future__ import annotations

from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions

WORKERS = 2


def _total(outs: list[dict]) -> float:
    return sum(o["samples_per_s"] for o in outs)


def pscluster(mode: str, steps: int) -> float:
    with procs.PSProcesses(1, workers=WORKERS) as cluster:
        return _total(procs.outputs([procs.spawn("workload", "pscluster", mode, steps, **cluster.worker_env(i))
                                     for i in range(WORKERS)]))


def ddp(steps: int) -> float:
    (port,) = procs.free_ports(1)
    return _total(procs.outputs([procs.spawn("ddp", rank, WORKERS, steps, port) for rank in range(WORKERS)]))


def rpc_ps(steps: int) -> float:
    (port,) = procs.free_ports(1)
    outs = procs.outputs([procs.spawn("rpc_ps", rank, WORKERS, steps, port) for rank in range(WORKERS + 1)])
    return _total(outs[0]["workers"])


def bare(mode: str, steps: int) -> float:
    (port,) = procs.free_ports(1)
    ps = procs.spawn("bare_zmq_ps", "ps", port, WORKERS, mode)
    workers = [procs.spawn("bare_zmq_ps", "worker", port, rank, WORKERS, steps) for rank in range(WORKERS)]
    return _total(procs.outputs(workers)) + 0 * len(procs.outputs([ps]))


def run(tiny: bool, out_dir: Path) -> Result:
    steps = 40 if tiny else 150
    speeds = alternate({"sync": lambda: pscluster("sync", steps), "async": lambda: pscluster("async", steps),
                        "ddp": lambda: ddp(steps), "rpc": lambda: rpc_ps(steps),
                        "bare sync": lambda: bare("sync", steps), "bare async": lambda: bare("async", steps)},
                       repetitions(tiny))
    result = Result("peers", "Peers on the same work (MLP 784-256-10, batch 128 per worker, SGD)", tiny)
    unit = "samples/s"
    for mode, ddp_goal in (("sync", 1.5), ("async", 1.7)):
        label = f"pscluster {mode}, 1 ps + 2 workers"
        result.rows += [
            compare(f"{mode} vs DDP", label, speeds[mode], "DDP gloo, 2 processes", speeds["ddp"], unit,
                    Target(ddp_goal)),
            compare(f"{mode} vs RPC ps", label, speeds[mode], "torch.distributed.rpc ps, 1 + 2", speeds["rpc"], unit,
                    Target(2.0)),
            compare(f"{mode} vs bare ZeroMQ ps", label, speeds[mode], f"bare ZeroMQ ps {mode}, 1 + 2",
                    speeds[f"bare {mode}"], unit, Target(1.0)),
        ]
    result.rows.append(compare("bare ZeroMQ ps (async) vs DDP", "bare ZeroMQ ps async", speeds["bare async"],
                               "DDP gloo, 2 processes", speeds["ddp"], unit))
    result.notes.append(f"{steps} steps per worker per repetition, the first 20 left out; every process has one "
                        "torch thread (3 processes for the ps systems, 2 for DDP) on this machine's cores.")
    return result
