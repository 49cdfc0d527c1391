"""Peers on the same work: pscluster (sync, async and async pipelined; 1 ps + 2 workers) against torch DDP
(gloo, 2 processes), a torch.distributed.rpc ps written as PyTorch's tutorial does (1 ps + 2 trainers), and
a bare ZeroMQ ps (1 ps + 2 workers, sync and async); the MLP of ``workload.py``, batch 128 per worker, SGD, one
torch thread per process. Speed: aggregate samples/s, the sum of every worker's steady-state speed.

pscluster runs as the product runs outside a notebook: each ps a ``python -m pscluster.runtime`` process,
each worker a process running the runtime's worker loop (``procs.runtime_worker``)."""

from __future__ import annotations

import statistics
from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .workload import BATCH

WORKERS = 2
PSCLUSTER_MODES = {"sync": ("sync", False), "async": ("async", False), "async pipelined": ("async", True)}


def ddp() -> procs.Rounds:
    (port,) = procs.free_ports(1)
    return procs.Rounds([procs.spawn("ddp", rank, WORKERS, port) for rank in range(WORKERS)])


def rpc_ps() -> procs.Rounds:
    (port,) = procs.free_ports(1)
    ps, *trainers = [procs.spawn("rpc_ps", rank, WORKERS, port) for rank in range(WORKERS + 1)]
    return procs.Rounds([ps], trainers)


def bare(mode: str, workers: int = WORKERS) -> procs.Rounds:
    """The bare ZeroMQ ps (``bare_zmq_ps.py``) in ``mode`` and its ``workers``, one round per command."""
    (port,) = procs.free_ports(1)
    ps = procs.spawn("bare_zmq_ps", "ps", port, workers, mode)
    return procs.Rounds([procs.spawn("bare_zmq_ps", "worker", port, rank, workers) for rank in range(workers)], [ps])


def aggregate(outs: list[dict]) -> float:
    """Samples/s of all workers together: the sum of each one's (the rpc ps reports its trainers')."""
    return sum(o["samples_per_s"] for out in outs for o in out.get("workers", [out]))


def run(tiny: bool, out_dir: Path) -> Result:
    steps = 80 if tiny else 300
    systems = {}
    split: dict[str, list[dict]] = {mode: [] for mode in PSCLUSTER_MODES}  # each worker's rounds, by mode

    def measure(name: str) -> float:
        outs = systems[name].round(steps)
        if name in split:
            split[name] += [procs.worker_times(out) for out in outs]
        return aggregate(outs)
    try:
        for name, (mode, pipeline) in PSCLUSTER_MODES.items():
            systems[name] = procs.workload_workers(mode, WORKERS, pipeline=pipeline)
        for name, start in (("ddp", ddp), ("rpc", rpc_ps), ("bare sync", lambda: bare("sync")),
                            ("bare async", lambda: bare("async"))):
            systems[name] = start()
        speeds = alternate({name: (lambda name=name: measure(name)) for name in systems}, repetitions(tiny),
                           warmup=not tiny)
    finally:
        procs.close_all(systems.values())
    result = Result("peers", "Peers on the same work (MLP 784-256-10, batch 128 per worker, SGD)", tiny)
    unit = "samples/s"
    for mode, bare_mode, ddp_goal in (("sync", "sync", 1.5), ("async", "async", 1.7),
                                      ("async pipelined", "async", 1.7)):
        label = f"pscluster {mode}, 1 ps + 2 workers"
        result.rows += [
            compare(f"{mode} vs DDP", label, speeds[mode], "DDP gloo, 2 processes", speeds["ddp"], unit,
                    Target(ddp_goal)),
            compare(f"{mode} vs RPC ps", label, speeds[mode], "torch.distributed.rpc ps, 1 + 2", speeds["rpc"], unit,
                    Target(2.0)),
            compare(f"{mode} vs bare ZeroMQ ps", label, speeds[mode], f"bare ZeroMQ ps {bare_mode}, 1 + 2",
                    speeds[f"bare {bare_mode}"], unit, Target(1.0)),
        ]
    result.rows.append(compare("bare ZeroMQ ps (async) vs DDP", "bare ZeroMQ ps async", speeds["bare async"],
                               "DDP gloo, 2 processes", speeds["ddp"], unit))
    ddp_step = 1e3 * BATCH / (statistics.median(speeds["ddp"]) / WORKERS)
    result.notes.append("Where a pscluster worker's step goes (its own timers, medians over the rounds of both "
                        "workers; about, async, where a worker's share of the global steps varies): "
                        + "; ".join(f"{mode} compute {t['compute_s']:.2f} ms, exchange {t['comm_s']:.2f} ms, "
                                    f"waiting for the ps {t['wait_s']:.2f} ms"
                                    for mode, t in ((m, procs.step_split(r, steps)) for m, r in split.items()))
                        + f"; a DDP process's whole step {ddp_step:.2f} ms.")
    result.notes.append(f"{steps} steps per worker per repetition, the first 20 left out; every process has one "
                        "torch thread (3 processes for the ps systems, 2 for DDP) on this machine's cores. Each "
                        "system's processes are started once and run one repetition per command (idle, blocked "
                        "on a pipe, while the others run), and one round of each, left out, before the "
                        "repetitions (a first round is the slowest: the first run's allocations and connections); "
                        "each pscluster repetition is a new run (INIT by the chief).")
    return result
