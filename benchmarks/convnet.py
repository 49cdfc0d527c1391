"""A compute-bound model: 1 ps + 2 workers of the real runtime (one torch thread each; sync, async and async
pipelined) training ``workload.py``'s conv net against the best single process on the same 2 cores (2 torch threads,
the workers' batch or twice it, whichever is faster in that round); aggregate samples/s ratio."""

from __future__ import annotations

import statistics
from pathlib import Path

from . import procs
from .common import Result, Target, alternate, compare, repetitions
from .workload import TINY_STEPS

CONV = {"WORKLOAD_MODEL": "conv"}
BATCH = 64
THREADS = 2  # the single process's torch threads: the cores the cluster's processes share


# The cluster's modes, each against the best single process: sync (issue 19's row), async and async pipelined
# (issue 37's: a compute-bound model on a parameter server at least as fast as on one process)
MODES = {"sync": (dict(mode="sync"), Target(0.95)), "async": (dict(mode="async"), Target(1.0)),
         "async, pipelined": (dict(mode="async", pipeline=True), Target(1.0))}


def run(tiny: bool, out_dir: Path) -> Result:
    # tiny: more than the warm-up and a tick for each worker, whose share of an async run's steps varies
    steps = 4 * TINY_STEPS if tiny else 200
    clusters = {name: procs.workload_workers(workers=2, **how, **CONV, WORKLOAD_BATCH=str(BATCH))
                for name, (how, _) in MODES.items()}
    # tiny: one single process, of one thread: on a loaded machine two threads wait on each other at every op, ten
    # times as long as one thread takes
    batches, threads = ((BATCH,), 1) if tiny else ((BATCH, 2 * BATCH), THREADS)
    on_threads = f"{threads} thread{'s' if threads > 1 else ''}"
    single = {batch: procs.Rounds([procs.spawn("workload", "plain", threads=threads, **CONV,
                                               WORKLOAD_BATCH=str(batch))])
              for batch in batches}
    per_batch: dict[int, list[float]] = {batch: [] for batch in single}
    split: dict[str, list[dict]] = {name: [] for name in MODES}  # each worker's round: computing, exchanging, waiting

    def pscluster(name: str) -> float:
        outs = clusters[name].round(steps)
        split[name].extend(procs.worker_times(out) for out in outs)
        return sum(out["samples_per_s"] for out in outs)

    def best_single() -> float:
        for batch, rounds in single.items():
            per_batch[batch].append(rounds.round(steps)[0]["samples_per_s"])
        return max(per_batch[batch][-1] for batch in single)
    try:
        speeds = alternate({**{name: lambda name=name: pscluster(name) for name in MODES}, "single": best_single},
                           repetitions(tiny))
    finally:
        procs.close_all((*clusters.values(), *single.values()))
    result = Result("convnet", "A compute-bound conv net: 1 ps + 2 workers against the best single process", tiny)
    for name, (_, target) in MODES.items():
        result.rows.append(compare(f"conv net (2 conv + 2 dense, 1.2 MB), {name}, batch {BATCH} per worker",
                                   f"1 ps + 2 workers, {name}", speeds[name], f"best single process, {on_threads}",
                                   speeds["single"], "samples/s", target))
    result.extra["single_by_batch"] = {str(b): v for b, v in per_batch.items()}
    result.extra["worker_time_split"] = split
    single_step = 1e3 * BATCH / statistics.median(per_batch[BATCH])
    per_step = {name: procs.step_split(rounds, steps) for name, rounds in split.items()}
    result.notes.append("Where a worker's step goes (its own timers, medians over the rounds of both): "
                        + "; ".join(f"{name}: compute {t['compute_s']:.1f} ms, exchange {t['comm_s']:.1f} ms, "
                                    f"waiting {t['wait_s']:.1f} ms" for name, t in per_step.items())
                        + f" (compute: its batch, forward and backward on 1 thread, the gradient checks; waiting: for "
                        f"the ps and the other worker); the single process's step of batch {BATCH} on {on_threads}: "
                        f"{single_step:.1f} ms.")
    result.notes.append(f"{steps} steps per repetition and process (the first 20 left out); the single process "
                        f"ran batches of {' and '.join(map(str, batches))} each round and the faster counts: "
                        + ", ".join(f"batch {b}: median {sorted(v)[len(v) // 2]:,.0f} samples/s"
                                    for b, v in per_batch.items()) + ".")
    return result
