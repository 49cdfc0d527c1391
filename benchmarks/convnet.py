"""A compute-bound model: 1 ps + 2 workers of the real runtime (one torch thread each, sync) training
``workload.py``'s conv net against the best single process on the same 2 cores (2 torch threads, the workers'
batch or twice it, whichever is faster in that round); aggregate samples/s ratio."""

from __future__ import annotations

import statistics
from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .workload import TINY_STEPS

CONV = {"WORKLOAD_MODEL": "conv"}
BATCH = 64
THREADS = 2  # the single process's torch threads: the cores the cluster's processes share


def run(tiny: bool, out_dir: Path) -> Result:
    steps = TINY_STEPS if tiny else 200
    cluster = procs.workload_workers("sync", 2, **CONV, WORKLOAD_BATCH=str(BATCH))
    # tiny: one single process, of one thread: on a loaded machine two threads wait on each other at every op, ten
    # times as long as one thread takes
    batches, threads = ((BATCH,), 1) if tiny else ((BATCH, 2 * BATCH), THREADS)
    on_threads = f"{threads} thread{'s' if threads > 1 else ''}"
    single = {batch: procs.Rounds([procs.spawn("workload", "plain", threads=threads, **CONV,
                                               WORKLOAD_BATCH=str(batch))])
              for batch in batches}
    per_batch: dict[int, list[float]] = {batch: [] for batch in single}
    split: list[dict] = []  # each worker's round: seconds computing, exchanging, waiting

    def pscluster() -> float:
        outs = cluster.round(steps)
        split.extend(procs.worker_times(out) for out in outs)
        return sum(out["samples_per_s"] for out in outs)

    def best_single() -> float:
        for batch, rounds in single.items():
            per_batch[batch].append(rounds.round(steps)[0]["samples_per_s"])
        return max(per_batch[batch][-1] for batch in single)
    try:
        speeds = alternate({"pscluster": pscluster, "single": best_single}, repetitions(tiny))
    finally:
        procs.close_all((cluster, *single.values()))
    result = Result("convnet", "A compute-bound conv net: 1 ps + 2 workers against the best single process", tiny)
    result.rows.append(compare(f"conv net (2 conv + 2 dense, 1.2 MB), sync, batch {BATCH} per worker",
                               "1 ps + 2 workers", speeds["pscluster"], f"best single process, {on_threads}",
                               speeds["single"], "samples/s", Target(0.95)))
    result.extra["single_by_batch"] = {str(b): v for b, v in per_batch.items()}
    result.extra["worker_time_split"] = split
    per_step = procs.step_split(split, steps)
    single_step = 1e3 * BATCH / statistics.median(per_batch[BATCH])
    result.notes.append(f"Where a worker's step goes (its own timers, medians over the rounds of both): compute "
                        f"{per_step['compute_s']:.1f} ms (its batch, forward and backward on 1 thread, the gradient "
                        f"checks), exchange {per_step['comm_s']:.1f} ms, waiting for the ps and the other worker "
                        f"{per_step['wait_s']:.1f} ms; the single process's step of batch {BATCH} on {on_threads}: "
                        f"{single_step:.1f} ms.")
    result.notes.append(f"{steps} steps per repetition and process (the first 20 left out); the single process "
                        f"ran batches of {' and '.join(map(str, batches))} each round and the faster counts: "
                        + ", ".join(f"batch {b}: median {sorted(v)[len(v) // 2]:,.0f} samples/s"
                                    for b, v in per_batch.items()) + ".")
    return result
